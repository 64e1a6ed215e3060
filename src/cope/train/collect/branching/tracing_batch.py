"""One wave of a branched rollout over the engine's env batch: children rebuilt by replay where the envs live.

With env workers (``data.env_runtime.workers > 0``, :class:`cope.envs.runtime.pool.EnvWorkerPool`) an env instance
lives in a worker process and cannot be copied into another slot, so every child is rebuilt by replay (SPARK, arXiv
2601.20209, rebuilds every child so): its slot's env is reset to the task and stepped through the parent's first ``k``
actions inside the workers (every child of the wave in lock step, one batched request per replayed step), each
observation compared with the parent's record (:func:`~cope.train.collect.branching.forks.check_reset`,
:func:`~cope.train.collect.branching.forks.check_step`). A mismatch aborts that child (never trained; counted in
``rollout/branch_replay_mismatch``); every replayed step is counted in ``rollout/branch_replay_env_steps``.

:class:`TracingBatch` is the wave's :class:`~cope.envs.runtime.batch.EnvBatch` as
:func:`cope.rollout.loop.run_episodes` sees it, wrapping the engine's own batch (slot ``j`` of the wave is slot ``j``
there), so the worker processes are the engine's, reused by every wave and epoch, and a worker that dies or hangs
aborts the episode it was serving as in any rollout (counted in ``env/*``). It does what
:class:`~cope.train.collect.branching.forks.TracingEnv` does for one in-process env, one level down: a child's first
``k`` steps are answered from the parent's record (the scripted actions must be the parent's), the rest go to the
engine's batch, and each slot records what its env said (:class:`~cope.train.collect.branching.forks.Trace`). The
in-process path and this one give the same trees for the same seed (tests/test_branching_workers.py).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from cope.envs.base import EnvReset, Task
from cope.envs.runtime.batch import EnvBatch, Pending
from cope.train.collect.branching.forks import ReplayMismatch, Trace, check_reset, check_step, shared_result
from cope.train.collect.branching.stops import StopRule, check, link_kin


@dataclass
class BatchSlot:
    """One slot of a :class:`TracingBatch` (read by the tree as a ``TracingEnv`` is): its parent's trace and shared
    steps (None, 0: a root), what its env said, and what its replay cost."""

    parent: Trace | None = None
    k: int = 0
    trace: Trace | None = None
    replayed_steps: int = 0  # env steps its replay took (part of the tree's real cost)
    mismatch: bool = False
    kin: list[BatchSlot] = field(default_factory=list)  # the wave's slots of the same parent, itself included
    stop: str | None = None  # why the child stopped early (cope.train.collect.branching.stops), None if it did not

    def release(self) -> None:
        """Nothing to free: the env instance stays in the engine's batch for the next wave."""

    def close(self) -> None:
        """Nothing to free: the env instance stays in the engine's batch for the next wave."""


class TracingBatch:
    """The env batch of one wave (see the module doc).

    Args:
        inner: the engine's env batch (its worker pool), not closed here.
        forks: per slot ``(parent trace, k)``: ``(None, 0)`` for a root, else the child's parent and shared steps.
        stops: the children's early stops (:mod:`~cope.train.collect.branching.stops`; None: none): a stopped child
            is answered ``done`` (the env's own result otherwise) and its slot's ``stop`` set.
    """

    def __init__(self, inner: EnvBatch, forks: list[tuple[Trace | None, int]], stops: StopRule | None = None):
        self.inner, self.stops = inner, stops
        self.slots = [BatchSlot(parent, k) for parent, k in forks]
        link_kin(self.slots)
        self.name, self.max_steps, self.instructions = inner.name, inner.max_steps, inner.instructions
        self.stats = inner.stats

    def reset(self, items: list[tuple[int, Task]]) -> list[EnvReset | BaseException]:
        """Resets every slot in the engine's batch, then replays the children's shared steps there in lock step."""
        out: list[Any] = list(self.inner.reset(items))
        replaying = []  # item indices of the children whose replay goes on
        for i, ((j, task), first) in enumerate(zip(items, out)):
            s = self.slots[j]
            if isinstance(first, BaseException):
                continue
            if s.parent is None:
                s.trace = Trace(task, first)
                continue
            try:
                check_reset(s.parent, first)
            except ReplayMismatch as e:
                out[i] = self._mismatch(s, e)
                continue
            replaying.append(i)
        n = 0
        while replaying := [i for i in replaying if n < self.slots[items[i][0]].k]:
            todo = [(items[i][0], self.slots[items[i][0]].parent.actions[n]) for i in replaying]
            for i, res in zip(list(replaying), self.inner.submit(todo).results()):
                s = self.slots[items[i][0]]
                if isinstance(res, BaseException):  # the env raised, or its worker died: aborted as any episode
                    out[i] = res
                    replaying.remove(i)
                    continue
                try:
                    check_step(s.parent, n, res)
                except ReplayMismatch as e:
                    out[i] = self._mismatch(s, e)
                    replaying.remove(i)
            n += 1
        for i, ((j, task), first) in enumerate(zip(items, out)):
            s = self.slots[j]
            if s.parent is not None and not isinstance(first, BaseException):
                s.replayed_steps, s.trace = s.k, Trace(task, s.parent.first)
                out[i] = dataclasses.replace(s.parent.first)
        return out

    @staticmethod
    def _mismatch(slot: BatchSlot, err: ReplayMismatch) -> ReplayMismatch:
        slot.mismatch, slot.replayed_steps = True, slot.k  # as the in-process replay counts it
        return err

    def submit(self, items: list[tuple[int, str]]) -> Pending:
        """A child's shared step is answered from its parent's record, every other step by the engine's batch."""
        answered: dict[int, Any] = {}
        forward, where = [], []
        for i, (j, action) in enumerate(items):
            s = self.slots[j]
            n = len(s.trace.actions)
            if n >= s.k:
                forward.append((j, action))
                where.append(i)
                continue
            try:
                answered[i] = res = shared_result(s.parent, n, action)
            except RuntimeError as e:  # the scripted actor sent something else: the episode aborts (the tree checks)
                answered[i] = e
                continue
            s.trace.actions.append(action)
            s.trace.results.append(res)
        sent = self.inner.submit(forward) if forward else None
        p = Pending(len(items), lambda p: self._collect(p, forward, where, sent))
        for i, value in answered.items():
            p.set(i, value)
        return p

    def _collect(self, p: Pending, forward: list[tuple[int, str]], where: list[int], sent: Pending) -> None:
        for i, (j, action), res in zip(where, forward, sent.results()):  # in slot order, as the in-process envs step
            s = self.slots[j]
            if not isinstance(res, BaseException):
                s.trace.actions.append(action)
                s.trace.results.append(res)
                if check(s, self.stops):  # the loop ends the episode here; the tree drops it
                    res = dataclasses.replace(res, done=True)
            p.set(i, res)

    def close(self) -> None:
        """Leaves the engine's batch open: its workers serve the next wave, the next epoch and validation."""
