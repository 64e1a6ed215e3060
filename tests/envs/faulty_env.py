"""A maze that kills its process on an action while a flag file exists (imported by env workers in
tests/envs/test_envpool.py, which put this folder on PYTHONPATH): lets a test make a *replay* crash."""
from __future__ import annotations

import os

from cope.envs.maze import MazeEnv


class FlagCrashMaze(MazeEnv):
    def __init__(self, flag: str, crash_on: str = "east", always_crash_on: str = "crash", **kw):
        super().__init__(**kw)
        self.flag, self.crash_on, self.always_crash_on = flag, crash_on, always_crash_on

    def step(self, action: str):
        if action == self.always_crash_on or (action == self.crash_on and os.path.exists(self.flag)):
            os._exit(70)
        return super().step(action)


class LoudMaze(MazeEnv):
    """Answers every step with a 200 kB observation (larger than a pipe buffer)."""

    def step(self, action: str):
        r = super().step("north")
        r.observation = "x" * 200_000
        return r
