"""The branching collector (``+collector=branching``): each task's GRPO group sampled as a tree of forked episodes.

Follows SPARK (arXiv 2601.20209) and ARPO (arXiv 2507.19849): per task a budget of ``data.group_size`` leaves grown
from ``branch.roots`` roots; a child forks from a parent's state after a chosen step (``branch.trigger``,
:mod:`~cope.train.collect.branching.triggers`), so the turns it shares with its parent are generated and env-stepped
once (:mod:`~cope.train.collect.branching.tree`); its env is a fork of the parent's (a copy, or a checked replay:
:mod:`~cope.train.collect.branching.forks`). Every leaf is an ordinary :class:`~cope.episode.Episode` of its task's
group (``branch_of`` and ``shared_steps`` say where it forked), so the epoch builder computes GRPO advantages over
the leaves, SPARK's and ARPO's default; with ``data.share_prefix=true`` the group packing forwards the group's
common prefix once.

Where it differs: the fork decision is taken on the parent's finished transcript (same tree distribution, batched
waves); a task whose trigger picks no fork point fills its free slots with fresh roots (``rollout/branch_fill_roots``)
so every group has exactly ``group_size`` leaves; node-value (TreeRL) advantages and QwenGyre's J_max leaf cap are not
here yet. Only the in-process engine (``rollout=hf``) with envs in this process (``data.env_runtime.workers=0``) runs
it; others are refused by name.

Metrics (``Collected.metrics``, the same keys every epoch on every rank): what the trees cost
(``rollout/branch_env_steps``: own env steps plus the replays' steps; ``rollout/branch_generated_tokens``) against
what independent episodes of the same leaves would have cost (``..._flat_env_steps_est``,
``..._flat_generated_tokens_est``: every leaf's whole length), ``rollout/branch_saving`` (1 - actual / flat env
steps), ``rollout/branch_token_saving``, ``rollout/branch_forks``, ``rollout/branch_leaves``,
``rollout/branch_fill_roots``, ``rollout/branch_replay_mismatch``, ``rollout/branch_replay_env_steps``.
"""
from __future__ import annotations

import dataclasses
import functools
import random
import time

from cope.capabilities import can
from cope.episode import Episode
from cope.train.collect.branching.forks import fork_capability
from cope.train.collect.branching.tree import Grown, Loop, ScriptedActor, close, grow
from cope.train.collect.branching.triggers import TRIGGERS, choose_forks
from cope.train.collect.collector import Collected, CollectorHost

METRICS = ("rollout/branch_env_steps", "rollout/branch_generated_tokens", "rollout/branch_flat_env_steps_est",
           "rollout/branch_flat_generated_tokens_est", "rollout/branch_saving", "rollout/branch_token_saving",
           "rollout/branch_forks", "rollout/branch_leaves", "rollout/branch_fill_roots",
           "rollout/branch_replay_mismatch", "rollout/branch_replay_env_steps")


def tree_cost(episodes: list[Episode], replay_env_steps: int = 0) -> dict[str, float]:
    """Env steps and generated tokens the trees took (each episode's own steps, after its shared ones, plus the
    replays' steps) and what independent episodes of the same leaves would have taken (every step of every leaf)."""
    own = [s for e in episodes for s in e.steps[e.shared_steps:]]
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
    """

    off_policy = False  # the weights that sample an epoch are the ones that score it
    needs_fork = True  # an env with fork() or forks_by_replay, an in-process engine: for a config rule to read

    def __init__(self, *, host: CollectorHost, group_size: int, roots: int = 4, trigger: str = "uniform",
                 p: float = 0.5, tag: str = "<explore>", max_depth: int | None = None, entropy_weight: float = 0.2,
                 replay: bool = False):
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
        engine, sampling = host.engine, host.sampling
        name = type(engine).__name__
        if not can(engine, "samples_in_process") or not hasattr(engine, "env_factory"):
            raise ValueError(f"data.engine = {name}: the branching collector (data.collector) runs the in-process engine "
                             "only for now (rollout=hf); a server engine (rollout=vllm) is not supported yet")
        if engine.runtime.workers:
            raise ValueError(f"data.env_runtime.workers={engine.runtime.workers}: the branching collector forks envs in "
                             "this process only for now; set data.env_runtime.workers=0")
        if sampling.temperature <= 0:
            raise ValueError("data.sampling.temperature=0: a greedy child re-samples its parent's action; branched "
                             "rollouts need a temperature > 0")
        if trigger == "entropy" and sampling.top_p < 1:
            raise ValueError(f"branch.trigger=entropy needs the sampled tokens' log-probs, which the in-process sampler "
                             f"gives only at data.sampling.top_p=1 (got {sampling.top_p}); set data.sampling.top_p=1 or "
                             "use another branch.trigger")
        by_copy, by_replay, env_name = fork_capability(engine.env_factory)
        if not (by_copy or by_replay):
            raise ValueError(f"env: {env_name} cannot fork (no fork() and no forks_by_replay = True), so data.collector="
                             "branching cannot branch its episodes; use the default collector")
        if replay and not by_replay:
            raise ValueError(f"branch.replay=true: {env_name} does not declare forks_by_replay (deterministic replay)")
        self.host, self.leaves, self.roots, self.trigger = host, int(group_size), int(roots), trigger
        self.p, self.tag, self.max_depth, self.entropy_weight = float(p), tag, max_depth, float(entropy_weight)
        self.by_replay = bool(replay) or not by_copy

    def collect(self, epoch: int) -> Collected:
        t0 = time.perf_counter()
        tasks, groups, rng = self.host.task_stream(epoch)
        seed = rng.randrange(2**31)  # after the tasks, before the minibatch order: as the synchronous collector
        branch_rng = random.Random(seed ^ 0x5EED)  # the fork decisions, from the same stream
        order = list(dict.fromkeys(groups))
        task_of = dict(zip(groups, tasks))
        for g in order:
            if groups.count(g) != self.leaves:
                raise ValueError(f"branch: group {g} has {groups.count(g)} tasks, data.group_size={self.leaves} expected")
        grown = self._grow([task_of[g] for g in order], order, seed, branch_rng)
        try:
            # each task's tree together, in creation order (parents before children); branch_of renumbered
            ordered = sorted(range(len(grown.nodes)), key=lambda i: (order.index(grown.nodes[i].episode.group), i))
            new = {old: j for j, old in enumerate(ordered)}
            episodes = []
            for i in ordered:
                e = grown.nodes[i].episode
                e.branch_of = new[e.branch_of] if e.branch_of >= 0 else -1
                e.sampled_epoch = epoch
                episodes.append(e)
        finally:
            close(grown)
        metrics = self._metrics(episodes, grown)
        stats = dataclasses.replace(grown.stats, errors=list(grown.stats.errors), episodes=len(episodes),
                                    env_steps=int(metrics["rollout/branch_env_steps"]),
                                    generated_tokens=int(metrics["rollout/branch_generated_tokens"]))
        return Collected(episodes, [e.group for e in episodes], stats, rng, time.perf_counter() - t0, metrics)

    def _grow(self, tasks, groups, seed: int, rng: random.Random) -> Grown:
        from cope.rollout.hf_actor import CachedSamplingActor  # torch-side

        policy, engine, s = self.host.policy(), self.host.engine, self.host.sampling
        if policy is None:
            raise RuntimeError("BranchingCollector: no policy bound yet (RolloutDataModule.connect must run first)")
        engine.sync(self.host.version())
        entropy = self.trigger == "entropy"
        inner = CachedSamplingActor(policy.model, policy.pad_id, policy.chat.stop_ids, s.max_action_tokens,
                                    s.temperature, s.top_p, seed=seed, logprobs=entropy)
        template = engine.env_factory()
        template.close()
        depth = 0 if self.by_replay else (self.max_depth or template.max_steps)
        loop = Loop(engine.env_factory, template, policy.tokenizer, policy.chat, engine.max_context, s.max_action_tokens,
                    engine.instructions, self.by_replay, depth)
        choose = functools.partial(self._choose, vocab=len(policy.tokenizer))
        model = policy.model
        was_training = model.training
        model.eval()
        try:
            with policy.full_weights(), self.host.precision():
                return grow(loop, tasks, groups, leaves=self.leaves, roots=self.roots, actor=ScriptedActor(inner),
                            choose=choose, rng=rng, stopping=self.host.stopping)
        finally:
            model.train(was_training)

    def _choose(self, parents, slots: int, rng: random.Random, vocab: int):
        return choose_forks(self.trigger, parents, slots, rng, p=self.p, tag=self.tag, max_depth=self.max_depth,
                            entropy_weight=self.entropy_weight, vocab=vocab)

    @staticmethod
    def _metrics(episodes: list[Episode], grown: Grown) -> dict[str, float]:
        out = dict.fromkeys(METRICS, 0.0)
        out.update(tree_cost(episodes, grown.replay_env_steps))
        out.update({"rollout/branch_forks": float(grown.forks), "rollout/branch_leaves": float(len(episodes)),
                    "rollout/branch_fill_roots": float(grown.fill_roots),
                    "rollout/branch_replay_mismatch": float(grown.replay_mismatch),
                    "rollout/branch_replay_env_steps": float(grown.replay_env_steps)})
        return out

    def cancel(self) -> None:
        """Nothing runs between epochs, so there is nothing to stop."""

    def state_dict(self) -> dict:
        return {}  # nothing is in flight between epochs

    def load_state_dict(self, state: dict) -> None:
        """Nothing to restore."""
