"""The branching collector (``+collector=branching``): each task's GRPO group sampled as a tree of forked episodes.

Follows SPARK (arXiv 2601.20209) and ARPO (arXiv 2507.19849): per task a budget of ``data.group_size`` leaves grown
from ``branch.roots`` roots; a child forks from a parent's state after a chosen step (``branch.trigger``,
:mod:`~cope.train.collect.branching.triggers`), so the turns it shares with its parent are generated and env-stepped
once (:mod:`~cope.train.collect.branching.tree`); its env is a fork of the parent's (a copy, or a checked replay:
:mod:`~cope.train.collect.branching.forks`). Every leaf is an ordinary :class:`~cope.episode.Episode` of its task's
group (``branch_of`` and ``shared_steps`` say where it forked), so the epoch builder computes GRPO advantages over
the leaves, SPARK's and ARPO's default, or TreeRL's node values (``algo.advantage_mode=node_value``:
:mod:`~cope.train.collect.branching.node_values`); with ``data.share_prefix=true`` the group packing forwards each
group as the trie of its leaves, every shared token once (:mod:`cope.train.packing.group_prefix`). With env workers
(``data.env_runtime.workers > 0``) the envs live in the engine's worker processes, reused by every wave and epoch,
and every child is rebuilt there by a checked replay (:mod:`~cope.train.collect.branching.tracing_batch`), so the env
must declare ``forks_by_replay``.

Which leaves are trained (QwenGyre, arXiv 2609.33848; :mod:`~cope.train.collect.branching.leaves`): identical
leaves of a task collapse to one (``branch.dedup``), and at most ``branch.j_max`` distinct leaves per task are drawn
uniformly from the epoch's seeded stream. The advantages are computed over every leaf first (node values over the
whole tree), then the epoch builder keeps the trained ones (``Collected.trained``). A child that repeats may stop
early (TreePO, arXiv 2508.17445; ``branch.stop_loops``, ``branch.stop_duplicates``:
:mod:`~cope.train.collect.branching.stops`): it is no leaf, its slot not refilled. Every rank still trains the
minibatch count of full groups (``Collected.nominal``), so DDP's optimizer steps meet whatever each rank dropped.

Where it differs: the fork decision is taken on the parent's finished transcript (same tree distribution, batched
waves); a task whose trigger picks no fork point fills its free slots with fresh roots (``rollout/branch_fill_roots``)
so every group grows ``group_size`` leaves (fewer where children stopped early). The engine lends the actor that
samples the waves (``lends_actor``): in process (``rollout=hf``) a cached sampler on the model, on a server
(``rollout=vllm``) requests on an adapter, a child's prompt its parent's ids (the server's prefix cache serves them);
with ``data.max_lag >= 1`` the trees grow in the collector thread on the held version the overlapped schedule names
(:mod:`cope.train.collect.lagged`). An env that forks only by copy runs only with its envs in this process
(``data.env_runtime.workers=0``); others are refused by name.

Metrics (``Collected.metrics``, the same keys every epoch on every rank): what the trees cost
(``rollout/branch_env_steps``: own env steps plus the replays' steps; ``rollout/branch_generated_tokens``) against
what independent episodes of the same leaves would have cost (``..._flat_env_steps_est``,
``..._flat_generated_tokens_est``: every leaf's whole length), ``rollout/branch_saving`` (1 - actual / flat env
steps), ``rollout/branch_token_saving``, ``rollout/branch_forks``, ``rollout/branch_leaves`` (grown, not stopped),
``rollout/branch_fill_roots``, ``rollout/branch_replay_mismatch``, ``rollout/branch_replay_env_steps``,
``rollout/branch_duplicate_leaves`` and ``rollout/branch_capped_leaves`` (leaves not trained: duplicates, over J_max),
``rollout/branch_trained_leaves``, ``rollout/branch_stop_loop`` and ``rollout/branch_stop_duplicate`` (children stopped
early; their own steps and tokens count in the cost, not in the flat estimates).
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import random
import time

from cope.capabilities import can
from cope.episode import Episode
from cope.train.collect.branching.forks import fork_capability, replay_problem
from cope.train.collect.branching.leaves import Chosen, choose_leaves, fork_from_twins
from cope.train.collect.branching.stops import StopRule
from cope.train.collect.branching.tree import Grown, Loop, ScriptedActor, close, grow
from cope.train.collect.branching.triggers import TRIGGERS, choose_forks
from cope.train.collect.collector import Collected, CollectorHost
from cope.train.collect.lagged import LaggedCollector

METRICS = ("rollout/branch_env_steps", "rollout/branch_generated_tokens", "rollout/branch_flat_env_steps_est",
           "rollout/branch_flat_generated_tokens_est", "rollout/branch_saving", "rollout/branch_token_saving",
           "rollout/branch_forks", "rollout/branch_leaves", "rollout/branch_fill_roots",
           "rollout/branch_replay_mismatch", "rollout/branch_replay_env_steps", "rollout/branch_duplicate_leaves",
           "rollout/branch_capped_leaves", "rollout/branch_trained_leaves", "rollout/branch_stop_loop",
           "rollout/branch_stop_duplicate")


def tree_cost(episodes: list[Episode], replay_env_steps: int = 0, stopped: list[Episode] = ()) -> dict[str, float]:
    """Env steps and generated tokens the trees took (each episode's own steps, after its shared ones, plus the
    replays' steps; ``stopped``: the children stopped early, which cost theirs too) and what independent episodes of
    the same leaves would have taken (every step of every leaf, ``episodes``)."""
    own = [s for e in [*episodes, *stopped] for s in e.steps[e.shared_steps:]]
    every = [s for e in episodes for s in e.steps]
    steps, flat = len(own) + replay_env_steps, len(every)
    tokens, flat_tokens = (sum(s.action_end - s.action_start for s in x) for x in (own, every))
    return {"rollout/branch_env_steps": float(steps), "rollout/branch_generated_tokens": float(tokens),
            "rollout/branch_flat_env_steps_est": float(flat), "rollout/branch_flat_generated_tokens_est": float(flat_tokens),
            "rollout/branch_saving": 1.0 - steps / flat if flat else 0.0,
            "rollout/branch_token_saving": 1.0 - tokens / flat_tokens if flat_tokens else 0.0}


class BranchingCollector:
    """Each task's group as a tree of forked episodes (see the module doc).

    Args:
        host: what the DataModule lends (:class:`~cope.train.collect.collector.CollectorHost`).
        group_size: leaves per task (``data.group_size``: the GRPO group).
        roots: episodes per task started from its beginning (``branch.roots``), in [1, group_size].
        trigger: ``random`` | ``uniform`` | ``tag`` | ``entropy`` (``branch.trigger``).
        p: a step's fork probability (``random``), ARPO's base probability (``entropy``), in [0, 1].
        tag: the marker in an action's text that forks before it (``tag``; SPARK's ``<explore>``).
        max_depth: forks only after steps 1..max_depth (None: any step).
        entropy_weight: ARPO's ``w`` (``entropy``).
        replay: rebuild every child's env by replay, even where the env forks by copy (checks determinism).
        dedup: train one leaf of each set of identical leaves of a task (``branch.dedup``).
        j_max: train at most this many distinct leaves per task, drawn uniformly (``branch.j_max``; None: all).
        stop_loops: stop a child whose env repeats an observation of its trajectory (``branch.stop_loops``).
        stop_duplicates: stop a child whose trajectory so far is its parent's or a sibling's
            (``branch.stop_duplicates``).
        max_lag: ``data.max_lag`` (passed by :func:`cope.train.datamodule.choose_collector`): 0 grows each epoch's
            trees at its start; L >= 1 grows epoch e's trees in the background on the version of epoch
            max(0, e - L) (:class:`~cope.train.collect.lagged.LaggedCollector` with this collector's trees as its
            run: the same schedule, holds, resume and behaviour correction as flat overlapped rollouts).
    """

    off_policy = False  # the weights that sample an epoch are the ones that score it (True on an instance with a lag)
    takes_max_lag = True  # choose_collector passes data.max_lag: the trees grow in the background at L >= 1
    needs_fork = True  # for a config rule: an env with fork() or forks_by_replay (env workers: replay), an engine
    # that lends its sampling actor

    def __init__(self, *, host: CollectorHost, group_size: int, roots: int = 2, trigger: str = "uniform",
                 p: float = 0.5, tag: str = "<explore>", max_depth: int | None = None, entropy_weight: float = 0.2,
                 replay: bool = False, dedup: bool = True, j_max: int | None = None, stop_loops: bool = False,
                 stop_duplicates: bool = False, max_lag: int = 0):
        if not 1 <= roots <= group_size:
            raise ValueError(f"branch.roots must be in [1, data.group_size={group_size}], got {roots}")
        if trigger not in TRIGGERS:
            raise ValueError(f"branch.trigger must be one of {TRIGGERS}, got {trigger!r}")
        if not 0.0 <= p <= 1.0:
            raise ValueError(f"branch.p must be in [0, 1], got {p}")
        if trigger == "tag" and not tag:
            raise ValueError("branch.tag must be a non-empty marker with branch.trigger=tag")
        if max_depth is not None and max_depth < 1:
            raise ValueError(f"branch.max_depth must be null (any step) or >= 1, got {max_depth}")
        if j_max is not None and (isinstance(j_max, bool) or j_max < 1):
            raise ValueError(f"branch.j_max must be null (no cap) or an integer >= 1, got {j_max}")
        engine, sampling = host.engine, host.sampling
        name = type(engine).__name__
        if not can(engine, "lends_actor") or not hasattr(engine, "env_factory") or not hasattr(engine, "slots"):
            raise ValueError(f"data.engine = {name}: the branching collector (data.collector) grows its trees with an "
                             "engine that lends its sampling actor (lends_actor: rollout=hf in process, rollout=vllm on "
                             "its server); this one does not")
        if sampling.temperature <= 0:
            raise ValueError("data.sampling.temperature=0: a greedy child re-samples its parent's action; branched "
                             "rollouts need a temperature > 0")
        if trigger == "entropy" and sampling.top_p < 1:
            raise ValueError(f"branch.trigger=entropy needs the sampled tokens' log-probs, which the in-process sampler "
                             f"gives only at data.sampling.top_p=1 (got {sampling.top_p}); set data.sampling.top_p=1 or "
                             "use another branch.trigger")
        by_copy, by_replay, env_name = fork_capability(engine.env_factory)
        problem = replay_problem(engine.env_factory) if by_replay else None
        if problem and not by_copy:
            raise ValueError(f"env.{problem[0]}: {env_name} replays deterministically only with other settings "
                             f"({problem[1]}), and branched rollouts rebuild a child by replay; use the default collector")
        by_replay = by_replay and problem is None
        if not (by_copy or by_replay):
            raise ValueError(f"env: {env_name} cannot fork (no fork() and no forks_by_replay = True), so data.collector="
                             "branching cannot branch its episodes; use the default collector")
        if replay and not by_replay:
            raise ValueError(f"branch.replay=true: {env_name} does not declare forks_by_replay (deterministic replay)")
        workers = engine.runtime.workers
        if workers and not by_replay:
            raise ValueError(f"data.env_runtime.workers={workers}: env {env_name} forks only by copy (fork(), no "
                             "forks_by_replay), and an env in a worker process cannot be copied into another slot; with "
                             "env workers the branching collector rebuilds each child by replay. Set "
                             "data.env_runtime.workers=0 or use an env that declares forks_by_replay")
        self.host, self.leaves, self.roots, self.trigger = host, int(group_size), int(roots), trigger
        self.p, self.tag, self.max_depth, self.entropy_weight = float(p), tag, max_depth, float(entropy_weight)
        self.in_workers = workers > 0
        self.by_replay = bool(replay) or not by_copy or self.in_workers
        self.dedup, self.j_max = bool(dedup), None if j_max is None else int(j_max)
        self.stops = StopRule(loops=bool(stop_loops), duplicates=bool(stop_duplicates))
        self.lagged = LaggedCollector(host=host, max_lag=max_lag, run=self._run_job) if max_lag else None
        self.off_policy = self.lagged is not None  # sampled L epochs ago: the minibatches carry behaviour log-probs

    def collect(self, epoch: int) -> Collected:
        if self.lagged is not None:  # grown in the background on the version of epoch e - max_lag
            return self.lagged.collect(epoch)
        t0 = time.perf_counter()
        tasks, groups, rng = self.host.task_stream(epoch)
        seed = rng.randrange(2**31)  # after the tasks, before the minibatch order: as the synchronous collector
        with self.host.precision():  # as the lagged thread enters it around its run
            got = self._collect(tasks, groups, rng, seed, None, self._sigterm)
        for e in got.episodes:
            e.sampled_epoch = epoch
        got.seconds = time.perf_counter() - t0
        return got

    def _sigterm(self) -> None:
        if self.host.stopping():
            from lightning.pytorch.utilities.exceptions import SIGTERMException

            raise SIGTERMException

    def _run_job(self, job, check) -> Collected:
        """A queued collection's trees (``data.max_lag >= 1``, in the collector thread): the held version it was queued
        under samples, with its seed; ``check`` stops it between waves."""
        return self._collect(job.tasks, job.groups, job.rng, job.seed, job.version, check)

    def _collect(self, tasks, groups, rng: random.Random, seed: int, version: int | None, check) -> Collected:
        """The trees of one epoch's task stream sampled by ``version`` (None: synced to the weights as they are now),
        their trained leaves chosen and their cost counted (no collective: it may run off the main thread)."""
        branch_rng = random.Random(seed ^ 0x5EED)  # the fork decisions, from the same stream
        order = list(dict.fromkeys(groups))
        task_of = dict(zip(groups, tasks))
        for g in order:
            if groups.count(g) != self.leaves:
                raise ValueError(f"branch: group {g} has {groups.count(g)} tasks, data.group_size={self.leaves} expected")
        grown = self._grow([task_of[g] for g in order], order, seed, branch_rng, version, check)
        try:
            # each task's leaves together, in creation order (parents before children); branch_of renumbered. A child
            # stopped early is no leaf (and never a parent): it only counts in the cost
            leaves = [i for i, n in enumerate(grown.nodes) if n.stop is None]
            ordered = sorted(leaves, key=lambda i: (order.index(grown.nodes[i].episode.group), i))
            new = {old: j for j, old in enumerate(ordered)}
            episodes = []
            for i in ordered:
                e = grown.nodes[i].episode
                e.branch_of = new[e.branch_of] if e.branch_of >= 0 else -1
                episodes.append(e)
            stopped = [n.episode for n in grown.nodes if n.stop is not None]
        finally:
            close(grown)
        chosen = choose_leaves(episodes, dedup=self.dedup, j_max=self.j_max, rng=random.Random(seed ^ 0x1EAF))
        fork_from_twins(episodes, chosen)  # before the advantages: node values read one path per trajectory
        metrics = self._metrics(episodes, stopped, grown, chosen)
        stats = dataclasses.replace(grown.stats, errors=list(grown.stats.errors), episodes=len(episodes) + len(stopped),
                                    env_steps=int(metrics["rollout/branch_env_steps"]),
                                    generated_tokens=int(metrics["rollout/branch_generated_tokens"]))
        return Collected(episodes, [e.group for e in episodes], stats, rng, 0.0, metrics, trained=chosen.trained,
                         nominal=len(tasks))

    def _grow(self, tasks, groups, seed: int, rng: random.Random, version: int | None, check) -> Grown:
        policy, engine, s = self.host.policy(), self.host.engine, self.host.sampling
        if policy is None:
            raise RuntimeError("BranchingCollector: no policy bound yet (RolloutDataModule.connect must run first)")
        if version is None:
            engine.sync(self.host.version())
        choose = functools.partial(self._choose, vocab=len(policy.tokenizer))
        with contextlib.ExitStack() as stack:
            # the engine's actor: in process on the model as it is now (its whole weights) or on a held version's
            # sampler copy; on a server the newest or a held version, its log-probs with every answer. Log-probs are
            # needed by the entropy trigger and, off-policy, by the behaviour correction
            inner = stack.enter_context(engine.actor(s, seed, version=version,
                                                     logprobs=self.trigger == "entropy" or self.off_policy))
            # env workers: the engine's own batch (its worker processes serve every wave, epoch and validation)
            envs = stack.enter_context(engine.slots()) if self.in_workers else None
            template = None
            if envs is None:
                template = engine.env_factory()
                template.close()
            depth = 0 if self.by_replay else (self.max_depth or template.max_steps)
            loop = Loop(engine.env_factory, template, policy.tokenizer, policy.chat, engine.max_context,
                        s.max_action_tokens, engine.instructions, self.by_replay, depth, envs,
                        self.stops if self.stops.on else None, engine.runtime.max_live_episodes)
            return grow(loop, tasks, groups, leaves=self.leaves, roots=self.roots, actor=ScriptedActor(inner),
                        choose=choose, rng=rng, check=check)

    def _choose(self, parents, slots: int, rng: random.Random, vocab: int):
        return choose_forks(self.trigger, parents, slots, rng, p=self.p, tag=self.tag, max_depth=self.max_depth,
                            entropy_weight=self.entropy_weight, vocab=vocab)

    @staticmethod
    def _metrics(episodes: list[Episode], stopped: list[Episode], grown: Grown, chosen: Chosen) -> dict[str, float]:
        out = dict.fromkeys(METRICS, 0.0)
        out.update(tree_cost(episodes, grown.replay_env_steps, stopped))
        out.update({"rollout/branch_forks": float(grown.forks), "rollout/branch_leaves": float(len(episodes)),
                    "rollout/branch_fill_roots": float(grown.fill_roots),
                    "rollout/branch_replay_mismatch": float(grown.replay_mismatch),
                    "rollout/branch_replay_env_steps": float(grown.replay_env_steps),
                    "rollout/branch_duplicate_leaves": float(chosen.duplicates),
                    "rollout/branch_capped_leaves": float(chosen.capped),
                    "rollout/branch_trained_leaves": float(len(chosen.trained)),
                    **{f"rollout/branch_stop_{reason}": float(n) for reason, n in grown.stops.items()}})
        return out

    def cancel(self) -> None:
        """Stops the background collections (``data.max_lag >= 1``); nothing else runs between epochs."""
        if self.lagged is not None:
            self.lagged.cancel()

    def state_dict(self) -> dict:
        """With ``data.max_lag >= 1`` the lagged rollouts' counts (the episodes a resume discards); else nothing: no
        tree is in flight between epochs, so a checkpoint never holds half a tree."""
        return self.lagged.state_dict() if self.lagged is not None else {}

    def load_state_dict(self, state: dict) -> None:
        if self.lagged is not None:
            self.lagged.load_state_dict(state)
