"""The env-batch interface the rollout engine steps envs through (:class:`EnvBatch`), and its in-process implementation.

``reset(items)`` and ``submit(items) -> Pending`` (steps, collected later with ``Pending.results()``),
where ``items`` are ``(slot, argument)`` pairs and each result is an ``EnvReset``/``EnvStep`` or the
exception that stands for it (the engine aborts that episode). :class:`InProcessEnvs` keeps the
instances in this process and steps them one after another; :class:`cope.envs.runtime.pool.EnvWorkerPool` keeps
them in worker processes. ``stats`` counts runtime events (:data:`STATS` names them; here only
``output_capped``: what the envs printed while reset or stepped went over the cap of
:mod:`cope.envs.runtime.output` and the rest was dropped; the worker events stay 0).
"""
from __future__ import annotations

import logging
from typing import Any, Callable, Protocol, runtime_checkable

from cope.envs.base import Env, EnvReset, Task
from cope.envs.runtime.output import MAX_OUTPUT_BYTES, OutputCap

log = logging.getLogger(__name__)

STATS = ("restarts", "timeouts", "crashes", "replays", "replay_failures", "close_failures", "output_capped")


class Pending:
    """Results of submitted requests, in item order, available after :meth:`results`."""

    def __init__(self, n: int, pump: Callable[["Pending"], None] | None = None):
        self.values: list[Any] = [None] * n
        self.left = n
        self._pump = pump

    def set(self, i: int, value: Any) -> None:
        self.values[i] = value
        self.left -= 1

    def results(self) -> list[Any]:
        if self.left and self._pump is not None:
            self._pump(self)
        return self.values


@runtime_checkable
class EnvBatch(Protocol):
    """What the rollout loop (:func:`cope.rollout.loop.run_episodes`) needs from the env instances of its slots.

    Implemented by :class:`InProcessEnvs` (this process) and :class:`cope.envs.runtime.pool.EnvWorkerPool`
    (worker processes). Slots are indices ``0..n-1``; the instance of a slot is made on first use and reused.
    """

    name: str  # the env's name (task ids, metrics)
    max_steps: int  # its step budget
    instructions: str  # its system prompt
    stats: dict[str, int]  # cumulative runtime events, keys :data:`STATS`

    def reset(self, items: list[tuple[int, Task]]) -> list[EnvReset | BaseException]:
        """Starts an episode in each ``(slot, task)``; results in item order, an exception for a failed reset."""
        ...

    def submit(self, items: list[tuple[int, str]]) -> Pending:
        """One action per ``(slot, action)``; ``Pending.results()``: ``EnvStep | BaseException`` in item order."""
        ...

    def close(self) -> None:
        """Frees every instance (and worker process)."""
        ...


class InProcessEnvs:
    """Env instances in this process, stepped one after another (``data.env_runtime.workers=0``).

    While they are made, reset or stepped, what they print goes through ``output`` (at most
    ``max_output_bytes`` reach stderr, :meth:`cope.envs.runtime.output.OutputCap.redirect`)."""

    def __init__(self, env_factory: Callable[[], Env] | None = None, envs: list[Env] | None = None,
                 max_output_bytes: int = MAX_OUTPUT_BYTES):
        self.factory, self.envs = env_factory, list(envs or [])
        self.stats = dict.fromkeys(STATS, 0)
        self.output = OutputCap(max_output_bytes, label="in-process envs")
        first = self.envs[0] if self.envs else None
        if first is None:
            first = env_factory()
            self.envs.append(first)
        self.name, self.max_steps, self.instructions = first.name, first.max_steps, first.instructions

    def ensure(self, n: int) -> None:
        while len(self.envs) < n:
            if self.factory is None:
                raise ValueError(f"{n} episodes but only {len(self.envs)} env instances were given")
            self.envs.append(self.factory())

    def _each(self, method: str, items: list[tuple[int, Any]]) -> list[Any]:
        out = []
        with self.output.redirect():
            self.ensure(max((s for s, _ in items), default=-1) + 1)
            for slot, arg in items:
                try:
                    out.append(getattr(self.envs[slot], method)(arg))
                except Exception as e:  # noqa: BLE001 - an env error aborts its episode, never the run
                    out.append(e)
        if self.output.capped and not self.stats["output_capped"]:
            self.stats["output_capped"] = 1
            log.warning("in-process envs printed more than %d bytes: the rest of their output is dropped "
                        "(env/output_capped)", self.output.limit)
        return out

    def reset(self, items: list[tuple[int, Task]]) -> list[Any]:
        return self._each("reset", items)

    def submit(self, items: list[tuple[int, str]]) -> Pending:
        p = Pending(len(items))
        for i, v in enumerate(self._each("step", items)):
            p.set(i, v)
        return p

    def close(self) -> None:
        for e in self.envs:
            e.close()
        self.envs = []
