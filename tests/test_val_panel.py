"""The held-out panel: ``data.val_tasks`` test tasks from ``data.val_offset`` on (a tuning panel is another offset)."""
from __future__ import annotations

import functools

import pytest

from cope.envs.maze import MazeEnv
from cope.train.datamodule import RolloutDataModule

MAZE = functools.partial(MazeEnv, sizes=[5], max_steps=4, num_test_tasks=100)


def _panel(dm: RolloutDataModule) -> list[int]:
    return [i for chunk in dm.val_dataloader() for i in chunk]


def test_default_panel_is_the_first_tasks():
    dm = RolloutDataModule(env=MAZE, val_tasks=10, val_batch_size=4, progress=False)
    assert _panel(dm) == list(range(10))
    assert [len(c) for c in dm.val_dataloader()] == [4, 4, 2]


def test_offset_panel_is_disjoint_from_the_reported_one():
    reported = _panel(RolloutDataModule(env=MAZE, val_tasks=40, progress=False))
    tuning = _panel(RolloutDataModule(env=MAZE, val_tasks=40, val_offset=50, progress=False))
    assert tuning == list(range(50, 90)) and not set(reported) & set(tuning)


@pytest.mark.parametrize("offset, n, key", [(-1, 10, "data.val_offset"), (95, 10, "data.val_offset + data.val_tasks")])
def test_bad_panel_fails_before_any_rollout(offset, n, key):
    with pytest.raises(ValueError, match=key.replace("+", r"\+")):
        RolloutDataModule(env=MAZE, val_tasks=n, val_offset=offset, progress=False)
