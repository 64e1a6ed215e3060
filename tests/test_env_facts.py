"""What the DataModule learns of an env before any episode (``cope.envs.base.env_facts``): names, task counts and the
wave size, from the class and one constructed instance, with no engine (JVM, game, sandbox) started."""
from __future__ import annotations

import functools

import pytest

from cope.envs.base import env_facts
from cope.envs.maze import MazeEnv
from cope.train.datamodule import RolloutDataModule


def test_maze_facts():
    facts = env_facts(functools.partial(MazeEnv, sizes=[5], num_test_tasks=7))
    assert (facts.name, facts.test_tasks, facts.max_instances) == ("maze", 7, None)
    assert facts.train_tasks == MazeEnv(sizes=[5]).num_tasks("train")


def test_scienceworld_datamodule_starts_no_jvm(monkeypatch):
    """ScienceWorld's instances each hold a JVM once reset: building the DataModule (task counts, the wave size
    from the class's ``max_instances``) must not start one."""
    pytest.importorskip("scienceworld")
    from cope.envs.scienceworld import env as sw

    def no_jvm(*a, **k):
        raise AssertionError("a JVM was started to describe the env")

    monkeypatch.setattr(sw, "Simulator", no_jvm)
    factory = functools.partial(sw.ScienceWorldEnv, tasks=["boil"], max_variations_per_task=3)
    dm = RolloutDataModule(env=factory, val_tasks=2, progress=False)
    assert (dm.env_name, dm.num_train_tasks, dm.num_test_tasks) == ("scienceworld", 3, 3)
    assert dm.engine.runtime.max_live_episodes == sw.ScienceWorldEnv.max_instances == 16  # waves of the class's limit
