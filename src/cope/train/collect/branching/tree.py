"""Growing one epoch's rollout trees, wave by wave, on the ordinary rollout loop.

Each wave is one :func:`cope.rollout.loop.run_episodes` call over every task's new episodes, so a branched episode is
built by exactly the code that builds any episode (chat scaffold, native tool turns, the context-overflow policy,
env-crash aborts). A child of ``(parent, k)`` runs in a :class:`~cope.train.collect.branching.forks.TracingEnv` slot
(with env workers: a slot of a :class:`~cope.train.collect.branching.tracing_batch.TracingBatch` over the engine's env
batch) that answers the parent's first ``k`` steps from the parent's record, with a :class:`ScriptedActor` that hands back
the parent's sampled ids for those steps (generated once, never re-sampled): its transcript up to the end of step
``k``'s feedback is the parent's, id for id (checked), and it samples from step ``k + 1`` on.

The waves: first ``roots`` episodes per task from its start; then, per task with free slots, the trigger picks fork
points among the newest wave's episodes (:func:`~cope.train.collect.branching.triggers.choose_forks`); a task whose
newest wave gives no fork point fills its free slots with fresh roots (``fill``), so every task ends with exactly
``leaves`` episodes (GRPO's group size). The parent keeps its whole trajectory, so every episode of the tree is a leaf,
but for a child stopped early (``branch.stop_loops``, ``branch.stop_duplicates``:
:mod:`~cope.train.collect.branching.stops`): its slot ends it, it is never forked and the collector drops it; its slot
is not refilled.

Where it differs from SPARK (arXiv 2601.20209): the fork decision is taken after the parent's episode has run, from
its transcript, not while it runs; the decision reads only the parent's steps up to the fork point's next action, so
the same trees are drawn with the same probabilities, and the waves batch every task's children together.
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any, Callable

from cope.envs.base import Env, Task
from cope.envs.runtime.batch import EnvBatch
from cope.episode import Episode
from cope.rollout.loop import RolloutStats, Sampled, run_episodes
from cope.train.collect.branching.forks import TracingEnv
from cope.train.collect.branching.stops import REASONS, StopRule, link_kin
from cope.train.collect.branching.tracing_batch import BatchSlot, TracingBatch

ForkChooser = Callable[[list[tuple[int, Episode]], int, random.Random], list[tuple[int, int]]]


class ScriptedActor:
    """An actor that answers a slot's first actions from a script (a child's shared steps), the rest from ``inner``.

    Args:
        inner: the sampling actor (:class:`cope.rollout.hf_actor.CachedSamplingActor`).
    """

    def __init__(self, inner: Any):
        self.inner = inner
        self.scripts: dict[int, list[Sampled]] = {}  # slot key -> the parent's actions still to hand back

    def reset(self) -> None:
        self.inner.reset()

    def __call__(self, contexts: list[list[int]], admissible: list, keys: list[int]) -> list:
        out: list = [None] * len(contexts)
        todo = []
        for j, key in enumerate(keys):
            script = self.scripts.get(key)
            if script:
                out[j] = script.pop(0)
            else:
                todo.append(j)
        if todo:
            got = self.inner([contexts[j] for j in todo], [admissible[j] for j in todo], keys=[keys[j] for j in todo])
            for j, ids in zip(todo, got):
                out[j] = ids
        return out


@dataclass
class Node:
    """One episode of the trees: its slot (env record, snapshots), its parent's node index (-1: a root)."""

    episode: Episode
    slot: TracingEnv | BatchSlot
    parent: int
    fill: bool = False
    stop: str | None = None  # why it stopped early (no leaf then), None: a leaf


@dataclass
class Grown:
    """The epoch's trees: nodes in creation order, the waves' summed stats, and the events counted."""

    nodes: list[Node]
    stats: RolloutStats
    forks: int = 0
    fill_roots: int = 0
    replay_mismatch: int = 0
    replay_env_steps: int = 0
    stops: dict[str, int] = field(default_factory=lambda: dict.fromkeys(REASONS, 0))  # early stops by reason


@dataclass(frozen=True)
class Loop:
    """What each wave's :func:`run_episodes` call needs (the in-process engine's settings). ``envs``: the engine's env
    batch when its envs live in worker processes (each wave a :class:`TracingBatch` over it, every child replayed
    there); None: each slot a :class:`TracingEnv` over its own env in this process (``factory``, ``template``).
    ``stops``: checked by either slot kind after each of a child's own steps. ``max_live``: the env runtime's
    ``max_live_episodes`` (the env's ``max_instances`` when null), the most envs a wave keeps live at once."""

    factory: Callable[[], Env]
    template: Any
    tokenizer: Any
    chat: Any
    max_context: int
    max_action_tokens: int
    instructions: str | None
    by_replay: bool
    snapshot_depth: int
    envs: EnvBatch | None = None
    stops: StopRule | None = None  # the children's early stops (None: none)
    max_live: int | None = None  # live episodes at once: a wave runs in parts of this many (None: all at once)


def grow(loop: Loop, tasks: list[Task], groups: list[int], *, leaves: int, roots: int, actor: ScriptedActor,
         choose: ForkChooser, rng: random.Random, check: Callable[[], None] = lambda: None) -> Grown:
    """The trees of ``tasks`` (one per task, group ``groups[i]``), ``leaves`` episodes each (see the module doc).
    ``check()`` runs before every wave and raises to stop (a SIGTERM, a cancelled background collection).
    Raises RuntimeError when a child's shared ids differ from its parent's (a bug, never an env event)."""
    out = Grown([], RolloutStats())
    free = dict.fromkeys(groups, leaves)
    task_of = dict(zip(groups, tasks))
    specs = []  # (group, parent node or -1, k, fill) of the next wave
    for g in groups:
        specs += [(g, -1, 0, False)] * roots
        free[g] -= roots
    try:
        while specs:
            check()
            first = len(out.nodes)
            _wave(loop, specs, task_of, actor, out)
            specs = []
            for g in groups:
                if not free[g]:
                    continue
                newest = [(i, n.episode) for i, n in enumerate(out.nodes[first:], start=first)
                          if n.episode.group == g and n.stop is None]  # a stopped child is no parent
                forks = choose(newest, free[g], rng)[: free[g]]
                specs += [(g, i, k, False) for i, k in forks] or [(g, -1, 0, True)] * free[g]
                out.forks += len(forks)
                out.fill_roots += 0 if forks else free[g]
                free[g] -= len(forks) or free[g]
    except BaseException:
        close(out)
        raise
    return out


def _wave(loop: Loop, specs: list[tuple[int, int, int, bool]], task_of: dict[int, Task], actor: ScriptedActor,
          out: Grown) -> None:
    """One wave over ``specs``: one :func:`run_episodes` call, or one per part of ``loop.max_live`` slots in order
    (``data.env_runtime.max_live_episodes``); its episodes appended to ``out.nodes``. Every slot of the wave is made
    first and its kin linked over the whole wave, so a child of a later part is compared with the finished siblings of
    earlier parts as in one lock-step call (the one checked second stops)."""
    forks = [(out.nodes[parent].slot.trace, k) if parent >= 0 else (None, 0) for _g, parent, k, _ in specs]
    size = loop.max_live or len(specs)
    parts: list[tuple[int, Any, list]] = []  # (first spec, env batch or slot list, slots)
    for s in range(0, len(specs), size):
        if loop.envs is not None:  # env workers: the part's slots over the engine's batch, children replayed there
            batch = TracingBatch(loop.envs, forks[s: s + size], loop.stops)
            parts.append((s, batch, batch.slots))
        else:
            slots = [TracingEnv(loop.factory, loop.template, trace, k, loop.by_replay, loop.snapshot_depth, loop.stops)
                     for trace, k in forks[s: s + size]]
            parts.append((s, slots, slots))
    link_kin([slot for *_, slots in parts for slot in slots])
    done = 0
    try:
        for s, envs, slots in parts:
            _part(loop, specs[s: s + len(slots)], task_of, actor, envs, slots, out)
            done += 1
    except BaseException:
        for *_, slots in parts[done:]:
            for slot in slots:
                slot.close()
        raise


def _part(loop: Loop, specs: list[tuple[int, int, int, bool]], task_of: dict[int, Task], actor: ScriptedActor,
          envs: Any, slots: list, out: Grown) -> None:
    """One :func:`run_episodes` call over ``specs`` in ``slots`` (``envs``: the batch or the slot list)."""
    actor.scripts = {}
    for j, (_g, parent, k, _) in enumerate(specs):
        if parent >= 0:
            pe = out.nodes[parent].episode
            actor.scripts[j] = [Sampled(pe.tokens[s.action_start: s.action_end], s.sampler_logprobs) for s in pe.steps[:k]]
    try:
        eps, stats = run_episodes(envs, [task_of[g] for g, *_ in specs], [g for g, *_ in specs], actor, loop.tokenizer,
                                  loop.chat, loop.max_context, loop.max_action_tokens, instructions=loop.instructions)
    except BaseException:
        for s in slots:
            s.close()
        raise
    out.stats.add(stats)
    for (_g, parent, k, fill), ep, slot in zip(specs, eps, slots):
        out.replay_env_steps += slot.replayed_steps
        out.replay_mismatch += int(slot.mismatch)
        if parent >= 0:
            ep.branch_of, ep.shared_steps = parent, k
            pe = out.nodes[parent].episode
            end = pe.steps[k - 1].obs_end
            if not ep.aborted and (ep.tokens[:end] != pe.tokens[:end] or ep.roles[:end] != pe.roles[:end]):
                raise RuntimeError(f"branched rollout of {ep.task.id}: a child's first {k} steps are not its parent's ids")
        if slot.stop is not None:
            out.stops[slot.stop] += 1
        slot.release()  # its episode is over: a child forks from a snapshot or a replay, never from the live env
        out.nodes.append(Node(ep, slot, parent, fill, slot.stop))


def close(grown: Grown) -> None:
    """Closes every slot's env and snapshots."""
    for n in grown.nodes:
        n.slot.close()
