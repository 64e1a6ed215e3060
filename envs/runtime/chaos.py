"""Fault injection for env robustness checks: an env wrapper that breaks its worker on cue.

``ChaosEnv`` wraps any env factory and injects faults at each point of the worker protocol where env
code runs: ``make`` (the env's construction, which the worker does on the ``make`` command),
``reset``, ``step`` and ``close`` (the worker closes its envs on ``exit``). The faults:

* ``crash``: the process exits at once (as a segfaulting game engine or an OOM-killed JVM would);
* ``hang``: it sleeps for ``hang_seconds`` (past any deadline);
* ``error``: the env raises (an env error: the episode is aborted, the worker lives);
* ``pipe``: the worker's reply channel is closed while the process lives on;
* ``garbage``: bytes that are not a reply are written into the reply channel.

A ``pipe`` or ``garbage`` fault leaves the worker unusable, so after one the process injects no
more (the parent kills it; a second fault there would be one the parent never sees).

Run with ``data.env_runtime.workers > 0`` to see the worker pool restart workers, replay live episodes and
count ``env/restarts``, ``env/crashes``, ``env/timeouts`` and ``env/aborted_episodes``; in-process,
only ``error`` is survivable (a crash takes the trainer down with it, which is the point of the
workers). So by default (``only_in_workers``) faults fire only inside an env worker process: the tiny
model's warm start and the trainer's own probe instance, which run in-process, see the plain env.
Random faults at ``reset``/``step`` draw from a generator seeded by the task and the step number, so
replaying an episode's actions meets the same (absent) faults again; at ``make``/``close`` (no task)
each call draws afresh, so a fresh worker does not meet its predecessor's fault. ``log_path`` records every
fault fired (one line ``point kind pid``), which lets a test compare what was injected with what the
pool counted; ``max_faults`` stops injecting after that many (counted in the log, across processes).
Stdlib only. The worker-pool tests use it; to try it on a run, wrap an env config::

    env:
      _target_: cope.envs.runtime.chaos.ChaosEnv
      _partial_: true
      env: {_target_: cope.envs.maze.MazeEnv, _partial_: true}
      crash_prob: 0.001
      hang_prob: 0.001
"""
from __future__ import annotations

import fcntl
import os
import pickle
import random
import struct
import time
from typing import Callable

from cope.envs.base import Env, EnvReset, EnvStep, Task

POINTS = ("make", "reset", "step", "close")
KINDS = ("crash", "hang", "error", "pipe", "garbage")
_CHANNEL_FD_VAR = "COPE_ENV_WORKER_FD"  # set by cope.envs.runtime.worker in the child (not imported: it runs as __main__)
_broken = False  # this process's channel was broken by a pipe/garbage fault: inject nothing more
_WRONG = pickle.dumps("not a reply")
GARBAGE = (  # what a garbage fault writes into the reply channel (one of them, by process id)
    struct.pack("!Q", 9) + b"\xff" * 9,  # a frame that does not unpickle
    struct.pack("!Q", len(_WRONG)) + _WRONG,  # a pickle that is not (request id, ok, value)
    struct.pack("!Q", 1 << 62),  # a length prefix no reply has
)


class InjectedError(RuntimeError):
    pass


class ChaosEnv:
    """Args:
        env: factory of the wrapped env.
        crash_on / hang_on / error_on: actions (exact text) whose step triggers the fault.
        crash_prob / hang_prob / error_prob / pipe_prob / garbage_prob: per-call probabilities of a
            random fault at each point in ``points``.
        points: the protocol points where random faults may fire (default: steps only).
        faults: ``{point: kind}``: that fault at every call of that point (e.g. ``{"make": "crash"}``;
            with ``max_faults`` to fire it a given number of times).
        hang_seconds: how long a hang sleeps.
        seed: seed of the random faults.
        max_steps: overrides the wrapped env's step limit (None: keep it).
        only_in_workers: inject faults only inside env worker processes (``COPE_ENV_WORKER`` set).
        log_path: file that gets one line ``point kind pid`` per fault fired (None: no log).
        max_faults: fire at most this many faults in all (needs ``log_path``, where they are counted).
        armed: path of a file: faults fire only while it exists (None: always), so a test can arm
            them at a chosen moment, after the pool has built its first env.
    """

    def __init__(self, env: Callable[[], Env], crash_on: list[str] | None = None, hang_on: list[str] | None = None,
                 error_on: list[str] | None = None, crash_prob: float = 0.0, hang_prob: float = 0.0,
                 error_prob: float = 0.0, pipe_prob: float = 0.0, garbage_prob: float = 0.0,
                 points: list[str] | tuple[str, ...] = ("step",), faults: dict[str, str] | None = None,
                 hang_seconds: float = 3600.0, seed: int = 0, max_steps: int | None = None,
                 only_in_workers: bool = True, log_path: str | None = None, max_faults: int | None = None,
                 armed: str | None = None):
        probs = dict(crash=crash_prob, hang=hang_prob, error=error_prob, pipe=pipe_prob, garbage=garbage_prob)
        for k, v in probs.items():
            if not 0.0 <= v <= 1.0:
                raise ValueError(f"{k}_prob must be in [0, 1], got {v}")
        if sum(probs.values()) > 1.0:
            raise ValueError(f"the fault probabilities sum to {sum(probs.values())} > 1")
        faults = dict(faults or {})
        for point in [*points, *faults]:
            if point not in POINTS:
                raise ValueError(f"unknown fault point {point!r}; expected one of {POINTS}")
        for kind in faults.values():
            if kind not in KINDS:
                raise ValueError(f"unknown fault kind {kind!r}; expected one of {KINDS}")
        if max_faults is not None and log_path is None:
            raise ValueError("max_faults needs log_path (the faults are counted there, across worker processes)")
        self.on = {"crash": set(crash_on or ()), "hang": set(hang_on or ()), "error": set(error_on or ())}
        self.probs, self.points, self.faults = probs, tuple(points), faults
        self.hang_seconds, self.seed = hang_seconds, seed
        self.log_path, self.max_faults, self.armed = log_path, max_faults, armed
        self.active = not only_in_workers or os.environ.get("COPE_ENV_WORKER") == "1"
        self._task: Task | None = None
        self._t = 0
        self._inject("make", f"{seed}/make/{os.getpid()}/{random.random()}")
        self.env = env()
        self.name, self.max_steps = self.env.name, max_steps or self.env.max_steps

    @property
    def instructions(self) -> str:
        return self.env.instructions

    def num_tasks(self, split: str) -> int:
        return self.env.num_tasks(split)

    def reset(self, task: Task) -> EnvReset:
        self._task, self._t = task, 0
        self._inject("reset", f"{self.seed}/reset/{task.id}")
        return self.env.reset(task)

    def step(self, action: str) -> EnvStep:
        self._t += 1
        self._inject("step", f"{self.seed}/{self._task.id if self._task else ''}/{self._t}", action)
        return self.env.step(action)

    def close(self) -> None:
        self._inject("close", f"{self.seed}/close/{os.getpid()}/{random.random()}")
        self.env.close()

    # -- faults -----------------------------------------------------------------------------------
    def _draw(self, point: str, seed: str, action: str | None) -> str | None:
        if point in self.faults:
            return self.faults[point]
        for kind, actions in self.on.items():
            if action is not None and action in actions:
                return kind
        if point not in self.points:
            return None
        u, acc = random.Random(seed).random(), 0.0
        for kind, p in self.probs.items():
            acc += p
            if u < acc:
                return kind
        return None

    def _inject(self, point: str, seed: str, action: str | None = None) -> None:
        global _broken
        if not self.active or _broken or (self.armed is not None and not os.path.exists(self.armed)):
            return
        kind = self._draw(point, seed, action)
        if kind is None or not self._record(point, kind):
            return
        if kind == "crash":
            os._exit(70)
        if kind == "hang":
            time.sleep(self.hang_seconds)
        if kind == "error":
            raise InjectedError(f"injected env error at {point} (step {self._t}, action {action!r})")
        fd = int(os.environ.get(_CHANNEL_FD_VAR, "-1"))
        if kind in ("pipe", "garbage") and fd >= 0:
            _broken = True
            if kind == "garbage":
                os.write(fd, GARBAGE[os.getpid() % len(GARBAGE)])
            else:  # the reply pipe's only write end goes; the process lives on, writing into /dev/null
                null = os.open(os.devnull, os.O_WRONLY)
                os.dup2(null, fd)
                os.close(null)

    def _record(self, point: str, kind: str) -> bool:
        """Log the fault; False when ``max_faults`` were fired already (then it does not fire)."""
        if self.log_path is None:
            return True
        with open(self.log_path, "a+") as f:
            fcntl.flock(f, fcntl.LOCK_EX)  # workers fire concurrently; the count must be exact
            f.seek(0)
            if self.max_faults is not None and len(f.readlines()) >= self.max_faults:
                return False
            f.write(f"{point} {kind} {os.getpid()}\n")
            f.flush()
            os.fsync(f.fileno())
        return True
