"""Test-only mazes for branched rollouts with env workers (tests/test_branching_workers.py).

Light on purpose (the maze only, no torch): an env worker process imports this module to build them, found through
``PYTHONPATH=<tests>``; named by ``_target_`` in a composed config (``branch_envs.CopyOnlyMaze``).
"""
from __future__ import annotations

import os
from pathlib import Path

from cope.envs.maze import MazeEnv


class CopyOnlyMaze(MazeEnv):
    """A maze that forks by copy only (``fork()``, no deterministic replay): with env workers it cannot branch."""

    forks_by_replay = False


class CountingMaze(MazeEnv):
    """A maze that replays only by the letter: each observation carries how many steps its instance took across
    episodes, so a replay on an instance that stepped before never says what the original said."""

    fork = None  # no copy: only replay
    forks_by_replay = True

    def __init__(self, **kw):
        super().__init__(**{"sizes": [6], "max_steps": 8, **kw})
        self.taken = 0

    def step(self, action):
        out = super().step(action)
        self.taken += 1
        out.observation += f" ({self.taken})"
        return out


class CrashOnceMaze(MazeEnv):
    """A replayable maze whose worker process dies once (``os._exit``), at the first step after its ``after``-th reset
    (a child's first replayed step when ``after`` is a worker's share of the roots). Only in an env worker
    (``COPE_ENV_WORKER=1``), only once per run: the first to create the file ``marker`` dies."""

    fork = None
    forks_by_replay = True
    resets = 0  # of this process

    def __init__(self, marker: str, after: int, **kw):
        super().__init__(**{"sizes": [6], "max_steps": 8, **kw})
        self.marker, self.after = marker, after

    def reset(self, task):
        type(self).resets += 1
        return super().reset(task)

    def step(self, action):
        if os.environ.get("COPE_ENV_WORKER") == "1" and type(self).resets > self.after:
            try:
                Path(self.marker).touch(exist_ok=False)
            except FileExistsError:
                pass
            else:
                os._exit(17)
        return super().step(action)
