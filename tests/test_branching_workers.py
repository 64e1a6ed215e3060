"""Branched rollouts with env workers (``data.env_runtime.workers > 0``, cope.train.collect.branching.tracing_batch).

An env in a worker process cannot be copied into another slot, so every child is rebuilt there by a checked replay.
The tiny random policy: the same seed grows the same trees (ids, rewards, forks, metrics) in process and with
workers, the workers are the engine's (started once, reused by every wave and epoch), a replay that says something
else aborts its child and is counted, a worker that dies mid-replay aborts only the child it was serving, and an env
that forks only by copy is refused before any work. ``train.py``'s path trains on the maze (the same run as in
process) and on TextWorld."""
from __future__ import annotations

import functools
import itertools
import os
from pathlib import Path

import pytest
import torch
from conftest import metric_rows
from tiny_fixtures import maze_factory, tiny_policy

from cope.rollout import engine as engine_module
from cope.rollout.engine import EnvRuntime, HFEngine, Sampling
from cope.train.collect.branching.collector import BranchingCollector
from cope.train.collect.collector import CollectorHost
from cope.train.datamodule import RolloutDataModule

TESTS = Path(__file__).resolve().parent
G, ROOTS = 8, 4


def _collect(policy, workers: int, env=maze_factory, tasks: int = 3, epochs: int = 1, max_context: int = 512, **branch):
    dm = RolloutDataModule(env=env, tasks_per_epoch=tasks, group_size=G, minibatch_size=G * tasks,
                           max_context=max_context, sampling=Sampling(max_action_tokens=4), val_tasks=0, progress=False,
                           env_runtime=EnvRuntime(workers=workers),
                           collector=functools.partial(BranchingCollector, group_size=G, **{"roots": ROOTS, **branch}))
    dm.connect(policy)
    try:
        return [dm.collect_epoch(e) for e in range(epochs)]
    finally:
        dm.teardown("fit")


def _trees(rec) -> list[tuple]:
    return [(e.task.id, e.group, e.tokens, e.roles, e.reward, e.success, e.branch_of, e.shared_steps, e.end_reason,
             [(s.action_text, s.valid, s.reward) for s in e.steps]) for e in rec.episodes]


def _timeless(metrics: dict) -> dict:
    return {k: v for k, v in metrics.items() if not k.startswith("perf/")}


def _check_children(episodes) -> None:
    """Every group holds exactly G leaves; each child's transcript up to its fork is its parent's, id for id."""
    for _g, members in itertools.groupby(episodes, key=lambda e: e.group):
        assert len(list(members)) == G
    for e in episodes:
        if e.branch_of >= 0 and not e.aborted:
            parent = episodes[e.branch_of]
            end = parent.steps[e.shared_steps - 1].obs_end
            assert e.tokens[:end] == parent.tokens[:end] and e.roles[:end] == parent.roles[:end]


@pytest.fixture(scope="module")
def policy():
    return tiny_policy()


@pytest.fixture
def tests_on_path(monkeypatch):
    """Env worker processes find the test-only envs of tests/branch_envs.py."""
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in (str(TESTS), os.environ.get("PYTHONPATH")) if p))


def test_workers_grow_the_same_trees_as_in_process_and_are_started_once(policy, monkeypatch):
    """branch.replay=true: in process each child's env is a fresh instance replayed here; with workers a pooled instance
    replayed in its worker. Same seed: the same episodes, id for id, the same forks and the same metrics, epoch by
    epoch. The engine's one pool of 2 workers serves every wave of both epochs."""
    pools, processes = [], []

    class CountedPool(engine_module.EnvWorkerPool):
        def __init__(self, *a, **kw):
            pools.append(self)
            super().__init__(*a, **kw)

    import cope.envs.runtime.pool as pool_module

    class CountedProcess(pool_module.WorkerProcess):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            processes.append(self.proc.pid)

    here = _collect(policy, 0, epochs=2, replay=True)
    monkeypatch.setattr(engine_module, "EnvWorkerPool", CountedPool)
    monkeypatch.setattr(pool_module, "WorkerProcess", CountedProcess)
    there = _collect(policy, 2, epochs=2, replay=True)
    assert len(pools) == 1 and len(processes) == 2  # the engine's workers, reused by the waves and the epochs
    for a, b in zip(here, there):
        assert _trees(a) == _trees(b)
        assert _timeless(a.metrics) == _timeless(b.metrics)
        _check_children(b.episodes)
        m = b.metrics
        shared = sum(e.shared_steps for e in b.episodes)
        assert m["rollout/branch_forks"] == 3 * (G - ROOTS) and m["rollout/branch_leaves"] == 3 * G
        assert m["rollout/branch_replay_mismatch"] == 0 and m["rollout/branch_replay_env_steps"] == shared > 0
        assert m["env/restarts"] == 0
    assert _trees(there[0]) != _trees(there[1])  # the epochs differ: the comparison is not of two empty trees


def test_a_replay_that_drifts_in_the_workers_aborts_its_child_and_is_counted(policy, tests_on_path):
    from branch_envs import CountingMaze

    (rec,) = _collect(policy, 2, env=CountingMaze, tasks=2)
    children = [e for e in rec.episodes if e.branch_of >= 0]
    m = rec.metrics
    assert children and all(e.aborted for e in children) and not any(e.aborted for e in rec.episodes if e.branch_of < 0)
    assert m["rollout/branch_replay_mismatch"] == len(children)
    assert m["rollout/branch_replay_env_steps"] == sum(e.shared_steps for e in children)
    assert m["env/aborted_episodes"] >= len(children) and m["env/restarts"] == 0  # an env event, not a worker's


def test_a_worker_that_dies_mid_replay_aborts_that_child_only(policy, tests_on_path, tmp_path):
    """Each worker serves 4 of the 8 roots (2 tasks x 4), so the first step after a worker's 5th reset is a child's
    first replayed step: the first worker there dies. The pool restarts it and replays its other slots; the child it
    was serving is aborted (an env crash, counted), every other episode runs on."""
    from branch_envs import CrashOnceMaze

    env = functools.partial(CrashOnceMaze, marker=str(tmp_path / "crashed"), after=ROOTS)
    (rec,) = _collect(policy, 2, env=env, tasks=2)
    assert (tmp_path / "crashed").exists()
    aborted = [e for e in rec.episodes if e.aborted]
    m = rec.metrics
    assert len(aborted) == 1 and aborted[0].branch_of >= 0
    assert m["env/crashes"] == 1 and m["env/restarts"] == 1 and m["rollout/branch_replay_mismatch"] == 0
    assert m["rollout/branch_leaves"] == 2 * G
    _check_children(rec.episodes)


def _host(engine) -> CollectorHost:
    return CollectorHost(engine=engine, sampling=Sampling(), task_stream=None, rollout=None, version=lambda: 0,
                         max_epochs=lambda: None, world=lambda: 1, stopping=lambda: False)


def test_an_env_that_forks_only_by_copy_is_refused_with_workers(compose, tmp_path):
    from branch_envs import CopyOnlyMaze

    from cope.run.config_check import check_config
    from cope.run.config_keys import ConfigError

    engine = HFEngine(env=CopyOnlyMaze, runtime=EnvRuntime(workers=2), max_context=512)
    with pytest.raises(ValueError, match=r"data\.env_runtime\.workers=2: env CopyOnlyMaze forks only by copy"):
        BranchingCollector(host=_host(engine), group_size=G)
    BranchingCollector(host=_host(HFEngine(env=CopyOnlyMaze, runtime=EnvRuntime(), max_context=512)), group_size=G)
    BranchingCollector(host=_host(HFEngine(env=maze_factory, runtime=EnvRuntime(workers=2), max_context=512)),
                       group_size=G)
    # before any work, from the config alone (the env class's capabilities, resolved from its _target_)
    base = ["+collector=branching", "branch.roots=2", "data.env_runtime.workers=2"]
    with pytest.raises(ConfigError, match=r"data\.env_runtime\.workers = 2: .*CopyOnlyMaze forks only by copy"):
        check_config(compose([*base, "env._target_=branch_envs.CopyOnlyMaze"], tmp_path))
    check_config(compose(base, tmp_path))  # the maze replays: accepted


@pytest.fixture(scope="module")
def tw_games(tmp_path_factory) -> Path:
    """A game cache the TextWorld tests share (each game is generated once, 2-5 s)."""
    pytest.importorskip("textworld")
    return tmp_path_factory.mktemp("tw") / "textworld"


@pytest.mark.long
def test_workers_grow_the_same_trees_on_textworld(policy, tw_games):
    """TextWorld with branch.replay=true (in process it could also copy its game): the same trees with workers."""
    from cope.envs.textworld.env import TextWorldEnv

    env = functools.partial(TextWorldEnv, challenge="tw-coin_collector", level=3, cache_dir=str(tw_games), max_steps=4,
                            num_train_tasks=1)
    here, = _collect(policy, 0, env=env, tasks=1, max_context=2048, replay=True)
    there, = _collect(policy, 2, env=env, tasks=1, max_context=2048, replay=True)
    assert _trees(here) == _trees(there) and _timeless(here.metrics) == _timeless(there.metrics)
    _check_children(there.episodes)
    m = there.metrics
    assert m["rollout/branch_forks"] > 0 and m["rollout/branch_replay_env_steps"] > 0
    assert m["rollout/branch_replay_mismatch"] == 0 and m["env/restarts"] == 0


MAZE_RUN = ["+collector=branching", "branch.roots=2", "branch.replay=true"]


@pytest.mark.long
def test_train_py_trains_the_same_run_with_env_workers_on_the_maze(run_train, tmp_path):
    """``debug=fast +collector=branching data.env_runtime.workers=2``: every metrics row (wall-clock aside) and the
    final adapter are the in-process run's."""
    from safetensors.torch import load_file

    runs = {}
    for workers in (0, 2):
        out = tmp_path / f"workers{workers}"
        result = run_train([*MAZE_RUN, f"data.env_runtime.workers={workers}"], out)
        assert result["rollout/branch_forks"] > 0 and result["rollout/branch_replay_env_steps"] > 0
        runs[workers] = (metric_rows(out / "csv" / "metrics.csv"),
                         load_file(str(out / "csv" / "adapter" / "adapter_model.safetensors")))
    (rows0, adapter0), (rows2, adapter2) = runs[0], runs[2]
    assert rows0 == rows2 and len([r for r in rows2 if "rollout/branch_leaves" in r]) == 2
    assert all(float(r["rollout/branch_leaves"]) == 8 for r in rows2 if "rollout/branch_leaves" in r)
    assert adapter0.keys() == adapter2.keys() and all(torch.equal(adapter0[k], adapter2[k]) for k in adapter0)


@pytest.mark.long
def test_train_py_trains_with_env_workers_on_textworld(run_train, read_metrics, tw_games, tmp_path):
    result = run_train(
        ["+collector=branching", "branch.roots=2", "data.env_runtime.workers=2", "env=textworld",
         f"env.cache_dir={tw_games}", "env.challenge=tw-coin_collector", "env.level=3", "env.num_train_tasks=1",
         "env.num_test_tasks=1", "env.max_steps=3", "model.tokenizer_episodes=4", "model.warm_start_walks=4",
         "model.warm_start_steps=2", "data.tasks_per_epoch=1", "data.val_tasks=1", "data.val_batch_size=1",
         "trainer.max_epochs=1", "validate_before_fit=false"], tmp_path)
    assert result["counters/episodes"] == 4 and result["rollout/branch_leaves"] == 4
    assert result["rollout/branch_forks"] > 0 and result["rollout/branch_replay_env_steps"] > 0
    assert result["rollout/branch_replay_mismatch"] == 0
    cols = read_metrics(tmp_path / "csv" / "metrics.csv")
    assert cols["env/restarts"] == [0.0] and cols["env/aborted_episodes"] == [0.0]
