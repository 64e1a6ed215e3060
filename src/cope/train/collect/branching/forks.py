"""Forking an env mid-episode: a cheap copy where the env can, else a replay of the episode's actions.

Two optional capabilities of an env class (:mod:`cope.envs.base`; looked up on the class, nothing built):

* ``fork() -> Env``: an independent instance whose episode is where this one is now (the maze: a deep copy). A
  branched rollout snapshots the env after each step it may fork at, and forks that snapshot once per child.
* ``forks_by_replay = True``: the env is deterministic, so a fresh instance that resets to the same task and takes
  the same actions says the same things (the maze, TextWorld). A child's env is then rebuilt by that replay
  (SPARK, arXiv 2601.20209, rebuilds every child so); every observation of the replay is compared with the
  recorded one, and a mismatch raises :class:`ReplayMismatch` (the branch is aborted, never trained, and counted in
  ``rollout/branch_replay_mismatch``).

An env that declares neither cannot branch (:func:`fork_capability` refuses it by name).

:class:`TracingEnv` is one env slot of a branched rollout as :func:`cope.rollout.loop.run_episodes` sees it: a root
resets its own env; a child answers the parent's first ``k`` steps from the parent's record (the scripted actions
must be the parent's), then steps its forked env. Every slot records what its env said (:class:`Trace`), and keeps
snapshots where it may be forked later. With env workers (``data.env_runtime.workers > 0``) the envs live in other
processes and cannot be copied across them: :class:`~cope.train.collect.branching.tracing_batch.TracingBatch` plays
the same part one level down, over the engine's env batch, rebuilding every child by replay inside the workers with
the same checks (:func:`check_reset`, :func:`check_step`, :func:`shared_result`).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable

from cope.envs.base import Env, EnvReset, EnvStep, Task
from cope.train.collect.branching.stops import StopRule, check


class ReplayMismatch(RuntimeError):
    """A replayed fork said something other than the original episode: the env is not deterministic."""


@dataclass
class Trace:
    """What one slot's env said: its reset, then each action sent and its result; ``snapshots[k]`` is the env's state
    after step ``k`` (1-based) where the env forks by copy and a child may fork there."""

    task: Task
    first: EnvReset
    actions: list[str] = field(default_factory=list)
    results: list[EnvStep] = field(default_factory=list)
    snapshots: dict[int, Env] = field(default_factory=dict)


def replay_problem(factory: Any) -> tuple[str, str] | None:
    """``(argument, why)`` when the envs ``factory`` makes declare ``forks_by_replay`` but say, through their class's
    optional ``replay_problem(kwargs)`` (:mod:`cope.envs.base`), that these constructor arguments break it (tau2 with
    an LLM user); None otherwise. ``factory``: a class or a ``functools.partial`` of one (its keywords are read)."""
    cls = getattr(factory, "func", factory)
    check = getattr(cls, "replay_problem", None) if isinstance(cls, type) else None
    return check(dict(getattr(factory, "keywords", None) or {})) if check else None


def fork_capability(factory: Any) -> tuple[bool, bool, str]:
    """``(forks_by_copy, forks_by_replay, class name)`` of the envs ``factory`` makes (a class or a
    ``functools.partial`` of one: looked up on the class; anything else: on one instance, built and closed)."""
    cls = getattr(factory, "func", factory)
    probe = None
    if not isinstance(cls, type):
        probe = factory()
        cls = type(probe)
        probe.close()
    return callable(getattr(cls, "fork", None)), bool(getattr(cls, "forks_by_replay", False)), cls.__name__


def replay(factory: Callable[[], Env], trace: Trace, k: int) -> tuple[Env, int]:
    """A fresh env from ``factory`` reset to ``trace.task`` and stepped through its first ``k`` actions, each
    observation checked against the record. Returns ``(env, env steps taken)``; raises :class:`ReplayMismatch` (the
    env closed) when one differs."""
    env = factory()
    try:
        check_reset(trace, env.reset(trace.task))
        for i in range(k):
            check_step(trace, i, env.step(trace.actions[i]))
    except BaseException:
        env.close()
        raise
    return env, k


def check_reset(trace: Trace, first: EnvReset) -> None:
    """Raises :class:`ReplayMismatch` when a replayed reset's observation is not the one ``trace`` recorded."""
    if first.observation != trace.first.observation:
        raise ReplayMismatch(f"{trace.task.id}: the replayed reset's observation differs from the original's")


def check_step(trace: Trace, i: int, res: EnvStep) -> None:
    """Raises :class:`ReplayMismatch` when replayed step ``i`` (0-based) did not say what ``trace`` recorded."""
    old = trace.results[i]
    if (res.observation, bool(res.done)) != (old.observation, bool(old.done)):
        raise ReplayMismatch(f"{trace.task.id}: replayed step {i + 1} ({trace.actions[i]!r}) says "
                             f"{res.observation!r}, the original said {old.observation!r}")


def shared_result(parent: Trace, n: int, action: str) -> EnvStep:
    """A child's shared step ``n`` (0-based): the parent's recorded result, never an env's; the action sent must be the
    parent's (RuntimeError otherwise: the scripted actor handed back something else)."""
    if action != parent.actions[n]:
        raise RuntimeError(f"branched rollout: shared step {n + 1} sent {action!r}, the parent sent {parent.actions[n]!r}")
    return parent.results[n]


class TracingEnv:
    """One env slot of a branched rollout (see the module doc).

    Args:
        factory: makes a fresh env instance (a root's, or a replayed child's).
        template: an instance whose ``name``, ``max_steps``, ``instructions`` the slot reports.
        parent: the parent's trace (None: a root).
        k: a child's shared steps (the parent's first ``k`` are answered from ``parent``).
        by_replay: rebuild a child's env by replay (else fork the parent's snapshot after step ``k``).
        snapshot_depth: keep a snapshot after each own step up to this depth (0: none; forks by copy only).
        stops: the early stops of a child (:mod:`~cope.train.collect.branching.stops`; None: none). A stopped child
            answers ``done`` (its env's own result otherwise), sets ``stop`` and is never forked.

    Attributes:
        kin: the wave's slots of the same parent (itself included), set by the wave: a duplicate's siblings.
        stop: why the child stopped early (``loop``, ``duplicate``), None if it did not.
    """

    def __init__(self, factory: Callable[[], Env], template: Any, parent: Trace | None = None, k: int = 0,
                 by_replay: bool = False, snapshot_depth: int = 0, stops: StopRule | None = None):
        self.factory, self.parent, self.k, self.by_replay = factory, parent, k, by_replay
        self.snapshot_depth, self.stops = snapshot_depth, stops
        self.kin: list[TracingEnv] = [self]
        self.stop: str | None = None
        self.name, self.max_steps, self.instructions = template.name, template.max_steps, template.instructions
        self.env: Env | None = None
        self.trace: Trace | None = None
        self.replayed_steps = 0  # env steps a replayed fork took to get here (part of the tree's real cost)
        self.mismatch = False

    def reset(self, task: Task) -> EnvReset:
        if self.parent is None:
            self.env = self.factory()
            first = self.env.reset(task)
        elif self.by_replay:
            try:
                self.env, self.replayed_steps = replay(self.factory, self.parent, self.k)
            except ReplayMismatch:
                self.mismatch, self.replayed_steps = True, self.k
                raise
            first = self.parent.first
        else:
            self.env = self.parent.snapshots[self.k].fork()  # the snapshot stays, for a sibling at the same depth
            first = self.parent.first
        self.trace = Trace(task, first)
        return dataclasses.replace(first)

    def step(self, action: str) -> EnvStep:
        t = self.trace
        n = len(t.actions)
        if n < self.k:  # a shared step: the parent's result, never the env's
            res = shared_result(self.parent, n, action)
        else:
            res = self.env.step(action)
        t.actions.append(action)
        t.results.append(res)
        if n >= self.k and check(self, self.stops):  # the loop ends the episode here; the tree drops it
            return dataclasses.replace(res, done=True)
        if n >= self.k and not res.done and n + 1 <= self.snapshot_depth:
            t.snapshots[n + 1] = self.env.fork()
        return res

    def release(self) -> None:
        """Closes the slot's live env once its episode is over (its snapshots stay for the children that fork them):
        a tree keeps at most a wave's envs live, whatever its size."""
        if self.env is not None:
            self.env.close()
            self.env = None

    def close(self) -> None:
        """Closes the slot's env and its snapshots (after the rollout, once no child will fork them)."""
        self.release()
        if self.trace is not None:
            for s in self.trace.snapshots.values():
                s.close()
            self.trace.snapshots.clear()
