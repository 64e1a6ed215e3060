"""The SFT collector (``data.collector``, :mod:`cope.train.collect.collector`): each epoch's demonstration episodes.

A collector like the RL ones, so the DataModule, the minibatches, packing, micro-batching, checkpoints and the
held-out validation are RL's, unchanged. Per epoch and rank it hands over one demonstration per task of the epoch
(``data.tasks_per_epoch``; ``data.group_size`` is not used: a demonstration is the same every time, there is no
group to compare), made by :func:`cope.rollout.loop.run_episodes` with an actor that emits the demonstration's
actions (:mod:`cope.algos.sft.actors`), on env instances of its own in this process (the expert is asked on the
instance; ``data.env_runtime`` is validation's), in waves of ``max_live_episodes``.

Which demonstrations (``source``, :mod:`cope.algos.sft.demos`):

* ``expert``: the tasks of the epoch's task stream (``host.task_stream(epoch)``: derived from the seed, the rank
  and the epoch, as RL draws them: the same after a resume, distinct per rank), acted by the env's expert;
* ``file``: the kept demonstrations of a ``trajectories.jsonl``, in shuffled passes: the demonstrations a run
  trains are the concatenation of permutations 0, 1, 2, ... of the kept list (permutation k drawn from the seed and
  k), cut into consecutive slices of ``data.tasks_per_epoch``, epoch e's slices going to ranks 0..W-1 in order. A
  function of (seed, epoch, rank, world), so nothing needs to be checkpointed but the file's fingerprint, which a
  resume checks (another file, or another ``sft.keep``, would train other demonstrations).

A demonstration that cannot be trained as it is, is skipped, never truncated, and counted: one that does not fit
(``sft/skipped_too_long``: the loop ended it with ``end_reason="context"``, or its final feedback turn did not fit
``data.max_context`` and was dropped, or one of its actions, with its end-of-turn id, is longer than the sampling cap
``data.sampling.max_action_tokens``, which counts that id: the policy could never emit it closed), one that did not succeed with
``keep=success`` (``sft/skipped_failed``), and one that did not replay as given (``sft/skipped_broken``: the expert
had no action for a live episode or raised, the env raised, the recorded actions ended before the episode, or the env
received other text than the demonstration's action; an exception is logged as a warning naming the env and the
error). A skipped demonstration stays in the epoch as a stub, the task's first prompt only (every rank then trains
the same number of minibatches under DDP, and no loss trains it): ``end_reason="skipped"``, which no failure count
reads (``env/aborted_episodes``, ``rollout/aborted``, ``health/aborted_frac``), except where the env, a worker or the
expert raised: that stub stays ``"aborted"``, an env failure the run-health rule sees. ``sft/demos`` and
``sft/demo_tokens`` count the demonstrations trained and their action tokens. The same keys every epoch, on every
rank (this rank's counts).

Not off-policy: no policy sampled these episodes, so there are no behaviour log-probs to carry; the policy gradient,
which would need them, is off in ``algo=sft``.
"""
from __future__ import annotations

import hashlib
import random
import time
from pathlib import Path
from typing import Any, Callable

from cope.algos.sft.actors import ExpertActor, ScriptedActor
from cope.algos.sft.demos import KEEP, SOURCES, Demo, check_expert, env_class, read_trajectories, select_demos
from cope.envs.base import SPLITS, Env, env_facts
from cope.envs.runtime.batch import InProcessEnvs
from cope.episode import EndReason, Episode
from cope.rollout.loop import RolloutStats, run_episodes
from cope.train.collect.collector import Collected, CollectorHost
from cope.train.seeding import derive_seed

SKIPS = ("too_long", "failed", "broken")


def bound_policy(host: CollectorHost) -> Any:
    """The policy the DataModule was connected to (its tokenizer and chat scaffold): the host's ``policy()``."""
    policy = host.policy()
    if policy is None:
        raise RuntimeError("DemoCollector: the DataModule must be connected to the policy (connect) before collecting")
    return policy


def skipped_stub(ep: Episode, failed: bool = False) -> Episode:
    """A skipped demonstration as it stays in the epoch: its task's first prompt only, no loss trains it.
    ``end_reason`` ``SKIPPED`` (no failure), or ``ABORTED`` with ``failed`` (the env, a worker or the expert raised)."""
    n = ep.prompt_len or len(ep.tokens)
    return Episode(task=ep.task, group=ep.group, tokens=ep.tokens[:n], roles=ep.roles[:n], prompt_len=ep.prompt_len,
                   end_reason=EndReason.ABORTED if failed else EndReason.SKIPPED, sampled_epoch=ep.sampled_epoch)


class DemoCollector:
    """Demonstration episodes for supervised fine-tuning (see the module doc).

    Args:
        host: what the DataModule lends (:class:`~cope.train.collect.collector.CollectorHost`).
        env: the env factory (``${env}``); the collector's own instances, in this process.
        source: ``expert`` (the env's ``expert_action()``) or ``file`` (``path``).
        path: ``source=file``: a ``trajectories.jsonl`` of this trainer (:mod:`cope.algos.sft.demos`).
        keep: ``success`` (only demonstrations that succeed) or ``all`` (failures too).
        split: the split training draws from (``data.train_split``); a file's tasks must be of it.
        seed: the run seed (``source=file``: the order of the passes over the file).
        max_context: ``data.max_context``; longer demonstrations are skipped.
        instructions: ``data.instructions``, the system prompt replacing the env's own (None: the env's).
        max_live_episodes: demonstrations run at once (None: the env's ``max_instances``, else all of an epoch's).
    """

    off_policy = False  # no sampler: nothing to correct for (the policy gradient is off)

    @staticmethod
    def needs_expert(node) -> bool:
        """Whether the collector built from config ``node`` asks the env for its expert (a config rule reads it)."""
        return (node.get("source") or "expert") == "expert"

    def __init__(self, *, host: CollectorHost, env: Callable[[], Env], source: str = "expert", path: str | None = None,
                 keep: str = "success", split: str = "train", seed: int = 0, max_context: int = 2048,
                 instructions: str | None = None, max_live_episodes: int | None = None):
        if source not in SOURCES:
            raise ValueError(f"sft.source must be one of {SOURCES}, got {source!r}")
        if keep not in KEEP:
            raise ValueError(f"sft.keep must be one of {KEEP}, got {keep!r}")
        if split not in SPLITS:
            raise ValueError(f"data.train_split must be one of {SPLITS}, got {split!r}")
        if (path is None) != (source == "expert"):
            raise ValueError("sft.path names the demonstrations of sft.source=file: set both" if source == "file" else
                             f"sft.path={path!r} is read only with sft.source=file: set it, or sft.path=null")
        if max_context < 1:
            raise ValueError(f"data.max_context must be >= 1, got {max_context}")
        if max_live_episodes is not None and max_live_episodes < 1:
            raise ValueError(f"data.collector.max_live_episodes must be null or >= 1, got {max_live_episodes}")
        self.host, self.env_factory, self.source, self.keep = host, env, source, keep
        self.seed, self.max_context, self.instructions = int(seed), int(max_context), instructions
        cls = env_class(env)
        self.max_live = max_live_episodes or getattr(cls, "max_instances", None)
        self.demos: list[Demo] = []
        self.replayed: dict[str, int] = {}  # source=file: the replay outcomes of the file's episodes (demos.py)
        self.fingerprint: str | None = None
        if source == "expert":
            check_expert(env)
        else:
            facts = env_facts(env)  # one instance built and closed, no episode
            demos = read_trajectories(path, facts.name, split, facts.train_tasks if split == "train" else facts.test_tasks)
            self.demos, self.replayed = select_demos(demos, env, keep)
            digest = hashlib.sha256(Path(path).read_bytes())
            self.fingerprint = f"{digest.hexdigest()[:16]}/keep={keep}/{len(self.demos)}"
        self._envs: InProcessEnvs | None = None
        self._perms: dict[int, list[int]] = {}

    # -- the protocol ---------------------------------------------------------------------------
    def collect(self, epoch: int) -> Collected:
        t0 = time.perf_counter()
        stream = self.host.task_stream(epoch)
        firsts = [i for i, g in enumerate(stream.groups) if i == 0 or stream.groups[i - 1] != g]  # one per group
        groups = [stream.groups[i] for i in firsts]
        scripts = self._draw(epoch, len(firsts)) if self.source == "file" else None
        tasks = [d.task for d in scripts] if scripts is not None else [stream.tasks[i] for i in firsts]
        policy = bound_policy(self.host)
        if self._envs is None:
            self._envs = InProcessEnvs(self.env_factory)
        wave = self.max_live or len(tasks)
        episodes: list[Episode] = []
        stats = RolloutStats()
        counts = dict.fromkeys(SKIPS, 0)
        for s in range(0, len(tasks), wave):  # each wave reuses env slots 0..wave-1
            part = slice(s, s + wave)
            actor = (ExpertActor(policy.tokenizer, policy.chat.stop_id, self._envs.envs) if scripts is None else
                     ScriptedActor(policy.tokenizer, policy.chat.stop_id, [d.actions for d in scripts[part]]))
            eps, st = run_episodes(self._envs, tasks[part], groups[part], actor, policy.tokenizer, policy.chat,
                                   self.max_context, self.host.sampling.max_action_tokens, progress=self._turn_done,
                                   instructions=self.instructions)
            stats.add(st)
            for key, ep in enumerate(eps):
                skip = self.skip_reason(ep, actor.given.get(key, []), scripts[s + key].actions if scripts else None)
                if skip is not None:
                    counts[skip] += 1
                    failed = ep.aborted and key not in actor.lacking  # the loop aborted it, not for want of an action
                    ep = skipped_stub(ep, failed=failed)
                episodes.append(ep)
        for e in episodes:
            e.sampled_epoch = epoch
        kept = [e for e in episodes if not e.aborted]
        metrics = {"sft/demos": float(len(kept)), "sft/demo_tokens": float(sum(e.num_action_tokens for e in kept)),
                   **{f"sft/skipped_{k}": float(v) for k, v in counts.items()}}
        return Collected(episodes, groups, stats, stream.rng, time.perf_counter() - t0, metrics)

    def cancel(self) -> None:
        """Closes the collector's env instances (nothing runs between epochs); the next collection makes new ones."""
        envs, self._envs = self._envs, None
        if envs is not None:
            envs.close()

    def state_dict(self) -> dict:
        """The file's fingerprint (``source=file``): what a resume checks; the draws themselves need no state."""
        return {"sft_demos": self.fingerprint} if self.fingerprint else {}

    def load_state_dict(self, state: dict) -> None:
        """Refuses to resume on other demonstrations than the checkpoint's (a checkpoint without any: accepted)."""
        saved = state.get("sft_demos")
        if saved and self.fingerprint and saved != self.fingerprint:
            raise ValueError(f"the checkpoint trained on the demonstrations {saved} (sha256 prefix/keep/kept), "
                             f"sft.path now gives {self.fingerprint}: resume with the same file and sft.keep, or start "
                             f"a new run from its adapter (model.adapter=<run>/csv/adapter)")

    # -- helpers --------------------------------------------------------------------------------
    def skip_reason(self, ep: Episode, given: list[str], script: tuple[str, ...] | None) -> str | None:
        """Why ``ep`` is not trained (one of :data:`SKIPS`), or None. ``given``: the actions the actor gave it;
        ``script``: the file's actions (None: the expert's)."""
        if ep.aborted:
            return "broken"
        cap = self.host.sampling.max_action_tokens
        if (ep.truncated or len(ep.tokens) > self.max_context or (ep.steps and ep.steps[-1].obs_start < 0)
                or any(s.action_end - s.action_start > cap for s in ep.steps)):  # the stop id counts in the cap
            return "too_long"  # the context, the final feedback turn dropped (it did not fit), or the action cap
        if [s.action_text for s in ep.steps] != given or (script is not None and list(script) != given):
            return "broken"
        if self.keep == "success" and not ep.success:
            return "failed"
        return None

    def _draw(self, epoch: int, n: int) -> list[Demo]:
        """This rank's ``n`` demonstrations of ``epoch`` from the shuffled passes over the file (module doc)."""
        total, start = len(self.demos), (epoch * self.host.world() + self.host.rank()) * n
        out = []
        for p in range(start, start + n):
            k, i = divmod(p, total)
            if k not in self._perms:
                if len(self._perms) > 4:
                    self._perms.clear()
                order = list(range(total))
                random.Random(derive_seed(self.seed, "sft-demos", 0, k)).shuffle(order)
                self._perms[k] = order
            out.append(self.demos[self._perms[k][i]])
        return out

    def _turn_done(self, finished: int) -> None:
        if self.host.stopping():  # a SIGTERM: the epoch is left unfinished, resume runs it again (cope.run.preemption)
            from lightning.pytorch.utilities.exceptions import SIGTERMException

            raise SIGTERMException
