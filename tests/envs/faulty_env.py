"""Mazes that misbehave on cue (imported by env workers in tests/envs/test_envpool*.py, which put this
folder on PYTHONPATH): one kills its process on an action while a flag file exists (lets a test make a
*replay* crash), one answers with huge observations, one writes given bytes into the reply channel, one
prints a lot on every step, one prints without end on one action."""
from __future__ import annotations

import os
import sys

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


class GarbageMaze(MazeEnv):
    """Writes ``garbage`` (hex) into the worker's reply channel before answering ``action``."""

    def __init__(self, garbage: str, action: str = "garble", **kw):
        super().__init__(**kw)
        self.garbage, self.action = bytes.fromhex(garbage), action

    def step(self, action: str):
        if action == self.action:
            os.write(int(os.environ["COPE_ENV_WORKER_FD"]), self.garbage)
        return super().step(action)


class ChattyMaze(MazeEnv):
    """Prints ``per_step`` bytes on every step: half to stdout at the C level (os.write, as a game
    interpreter does), half to stderr through Python (print)."""

    def __init__(self, per_step: int, **kw):
        super().__init__(**kw)
        self.per_step = per_step

    def step(self, action: str):
        half = self.per_step // 2
        for i in range(0, half, 1 << 16):
            os.write(1, b"o" * min(1 << 16, half - i))
        print("e" * (self.per_step - half), file=sys.stderr, end="", flush=True)
        return super().step(action)


class FloodMaze(MazeEnv):
    """Prints to stdout without end on ``action`` (TextWorld's interpreter did on ``\\help``)."""

    def __init__(self, action: str = "flood", **kw):
        super().__init__(**kw)
        self.action = action

    def step(self, action: str):
        while action == self.action:
            os.write(1, b"DUMB-FROTZ runtime help\n" * 4096)
        return super().step(action)
