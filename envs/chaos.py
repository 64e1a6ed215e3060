"""Fault injection for env robustness checks: an env wrapper that crashes, hangs or raises on cue.

``ChaosEnv`` wraps any env factory and, on chosen actions or at random, kills its own process
(``crash``: as a segfaulting game engine or an OOM-killed JVM would), sleeps past any deadline
(``hang``), or raises (``error``). Run with ``data.env_workers > 0`` to see the worker pool restart
workers, replay live episodes and count ``env/restarts``, ``env/timeouts`` and
``env/aborted_episodes``; in-process, only ``error`` is survivable (a crash takes the trainer down
with it, which is the point of the workers). So by default (``only_in_workers``) faults fire only
inside an env worker process: the tiny model's warm start and the trainer's own probe instance, which
run in-process, see the plain env. Random faults draw from a generator seeded by the
task and the step number, so replaying an episode's actions meets the same (absent) faults again.
Stdlib only. The worker-pool tests use it; to try it on a run, wrap an env config::

    env:
      _target_: cope.envs.chaos.ChaosEnv
      _partial_: true
      env: {_target_: cope.envs.maze.MazeEnv, _partial_: true}
      crash_prob: 0.001
      hang_prob: 0.001
"""
from __future__ import annotations

import os
import random
import time
from typing import Callable

from cope.envs.base import Env, EnvReset, EnvStep, Task


class InjectedError(RuntimeError):
    pass


class ChaosEnv:
    """Args:
        env: factory of the wrapped env.
        crash_on / hang_on / error_on: actions (exact text) that trigger the fault.
        crash_prob / hang_prob / error_prob: per-step probabilities of a random fault.
        hang_seconds: how long a hang sleeps.
        seed: seed of the random faults.
        max_steps: overrides the wrapped env's step limit (None: keep it).
        only_in_workers: inject faults only inside env worker processes (``COPE_ENV_WORKER`` set).
    """

    def __init__(self, env: Callable[[], Env], crash_on: list[str] | None = None, hang_on: list[str] | None = None,
                 error_on: list[str] | None = None, crash_prob: float = 0.0, hang_prob: float = 0.0,
                 error_prob: float = 0.0, hang_seconds: float = 3600.0, seed: int = 0, max_steps: int | None = None,
                 only_in_workers: bool = True):
        for k, v in dict(crash_prob=crash_prob, hang_prob=hang_prob, error_prob=error_prob).items():
            if not 0.0 <= v <= 1.0:
                raise ValueError(f"{k} must be in [0, 1], got {v}")
        self.env = env()
        self.name, self.max_steps = self.env.name, max_steps or self.env.max_steps
        self.crash_on, self.hang_on, self.error_on = set(crash_on or ()), set(hang_on or ()), set(error_on or ())
        self.probs = (crash_prob, hang_prob, error_prob)
        self.hang_seconds, self.seed = hang_seconds, seed
        self.active = not only_in_workers or os.environ.get("COPE_ENV_WORKER") == "1"
        self._task: Task | None = None
        self._t = 0

    @property
    def instructions(self) -> str:
        return self.env.instructions

    def num_tasks(self, split: str) -> int:
        return self.env.num_tasks(split)

    def reset(self, task: Task) -> EnvReset:
        self._task, self._t = task, 0
        return self.env.reset(task)

    def step(self, action: str) -> EnvStep:
        self._t += 1
        if not self.active:
            return self.env.step(action)
        rng = random.Random(f"{self.seed}/{self._task.id if self._task else ''}/{self._t}")
        u = rng.random()
        crash_p, hang_p, error_p = self.probs
        if action in self.crash_on or u < crash_p:
            os._exit(70)
        if action in self.hang_on or crash_p <= u < crash_p + hang_p:
            time.sleep(self.hang_seconds)
        if action in self.error_on or crash_p + hang_p <= u < crash_p + hang_p + error_p:
            raise InjectedError(f"injected env error at step {self._t} (action {action!r})")
        return self.env.step(action)

    def close(self) -> None:
        self.env.close()
