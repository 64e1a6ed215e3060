"""Task streams per (seed, rank, epoch): distinct per rank, unchanged by a checkpoint round trip.

The reproduction of the bug: two DataModules set up as ranks 0 and 1 drew different tasks fresh, and the same
tasks once both loaded rank 0's ``state_dict()`` (what every rank restores from rank 0's checkpoint)."""
from __future__ import annotations

import functools
from types import SimpleNamespace

from cope.envs.maze import MazeEnv
from cope.train.datamodule import RolloutDataModule
from cope.train.seeding import derive_seed

MAZE = functools.partial(MazeEnv, sizes=[5], max_steps=4)


def _dm(rank: int) -> RolloutDataModule:
    dm = RolloutDataModule(env=MAZE, tasks_per_epoch=2, group_size=1, seed=0, progress=False)
    dm.tokenizer = object()  # setup only checks that connect() ran
    dm.trainer = SimpleNamespace(global_rank=rank, lightning_module=None)  # no module: no micro-batch budget to bind
    dm.setup("fit")
    return dm


def _tasks(dm: RolloutDataModule, epoch: int) -> list[int]:
    return [t.index for t in dm.sample_tasks(epoch)[0]]


def test_ranks_draw_different_tasks_before_and_after_loading_rank0_state():
    r0, r1 = _dm(0), _dm(1)
    fresh = [(_tasks(r0, e), _tasks(r1, e)) for e in range(3)]
    assert all(a != b for a, b in fresh)
    state = r0.state_dict()
    assert set(state) == {"counters"}  # nothing rank-specific travels in rank 0's checkpoint
    for dm in (r0, r1):
        dm.load_state_dict(state)
    assert [(_tasks(r0, e), _tasks(r1, e)) for e in range(3)] == fresh
    assert _tasks(r0, 1) != _tasks(r0, 2)  # a new stream every epoch


def test_derived_seeds_are_stable_and_distinct():
    assert derive_seed(0, "tasks", 0, 0) == derive_seed(0, "tasks", 0, 0) == 6808430702839487390
    seeds = {derive_seed(s, n, r, e) for s in (0, 1) for n in ("tasks", "anchors") for r in (0, 1) for e in (0, 1)}
    assert len(seeds) == 16
