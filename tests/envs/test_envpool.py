"""The env worker pool (envs/runtime/pool.py): parallel steps, deadlines, restarts, replay, accounting.

Faults come from envs/runtime/chaos.py (a wrapper that kills its own process, sleeps or raises on cue)."""
from __future__ import annotations

import functools
import os
import subprocess
import sys
import time

import pytest

from cope.envs.base import Task
from cope.envs.maze import MazeEnv
from cope.envs.runtime.batch import InProcessEnvs
from cope.envs.runtime.chaos import ChaosEnv
from cope.envs.runtime.pool import EnvWorkerPool
from cope.envs.runtime.remote import RemoteEnv
from cope.envs.runtime.worker import WorkerFailure, WorkerTimeout

MAZE = functools.partial(MazeEnv, sizes=[6], max_steps=20)


def chaos(**kw):
    return functools.partial(ChaosEnv, env=MAZE, **kw)


def _task(i: int) -> Task:
    return Task("maze", "train", i)


def _first_moves(n_slots: int) -> list[str]:
    """A move that is open at the start of each task (so the step is valid and the episode goes on)."""
    out = []
    for i in range(n_slots):
        env = MAZE()
        obs = env.reset(_task(i)).observation
        out.append(obs.rsplit("Open: ", 1)[1].split(",")[0].strip(" ."))
    return out


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split()[2] != "Z"


def test_pool_matches_in_process_envs():
    """Same tasks, same actions: the pool's results equal stepping the envs here."""
    pool = EnvWorkerPool(MAZE, num_workers=2)
    local = InProcessEnvs(MAZE)
    try:
        items = [(s, _task(s)) for s in range(5)]
        a, b = pool.reset(items), local.reset(items)
        assert [r.observation for r in a] == [r.observation for r in b]
        moves = _first_moves(5)
        for _ in range(3):
            steps = [(s, moves[s]) for s in range(5)]
            ra, rb = pool.submit(steps).results(), local.submit(steps).results()
            assert [(r.observation, r.valid, r.reward, r.done) for r in ra] == [(r.observation, r.valid, r.reward, r.done) for r in rb]
        assert pool.name == "maze" and pool.max_steps == 20 and "north" in pool.instructions
        assert pool.stats["restarts"] == 0
    finally:
        pool.close()
        local.close()


def test_env_error_aborts_only_that_request():
    pool = EnvWorkerPool(chaos(error_on=["boom"]), num_workers=1)
    try:
        pool.reset([(0, _task(0)), (1, _task(1))])
        res = pool.submit([(0, "boom"), (1, "north")]).results()
        assert isinstance(res[0], RuntimeError) and "injected env error" in str(res[0])
        assert not isinstance(res[1], BaseException)
        assert pool.stats["restarts"] == 0  # an env error is not a worker failure
    finally:
        pool.close()


def test_killed_worker_is_restarted_and_other_episodes_replayed():
    pool = EnvWorkerPool(chaos(crash_on=["crash"]), num_workers=1)
    try:
        pool.reset([(0, _task(0)), (1, _task(1)), (2, _task(2))])
        moves = _first_moves(3)
        first = pool.submit([(1, moves[1]), (2, moves[2])]).results()
        pid = pool._workers[0].proc.pid
        res = pool.submit([(0, "crash"), (1, "east"), (2, "west")]).results()
        assert isinstance(res[0], WorkerFailure) and not isinstance(res[0], WorkerTimeout)
        # the other two episodes went on as if nothing happened: same results as an undisturbed env
        ref = InProcessEnvs(MAZE)
        ref.reset([(1, _task(1)), (2, _task(2))])
        ref.submit([(1, moves[1]), (2, moves[2])]).results()
        want = ref.submit([(1, "east"), (2, "west")]).results()
        assert [r.observation for r in res[1:]] == [r.observation for r in want]
        assert pool.stats["restarts"] == 1 and pool.stats["crashes"] == 1
        assert pool.stats["replays"] == 2 and pool.stats["replay_failures"] == 0
        assert pool._workers[0].proc.pid != pid and not _alive(pid)
        assert first and all(not isinstance(r, BaseException) for r in first)
        # slot 0 is usable again after a reset
        assert pool.reset([(0, _task(0))])[0].observation.startswith("Find the goal")
    finally:
        pool.close()


def test_hung_step_times_out_and_worker_restarts():
    pool = EnvWorkerPool(chaos(hang_on=["hang"]), num_workers=2, step_timeout_s=1.0)
    try:
        pool.reset([(s, _task(s)) for s in range(4)])
        t0 = time.monotonic()
        res = pool.submit([(0, "hang"), (1, "north"), (2, "south"), (3, "east")]).results()
        took = time.monotonic() - t0
        assert isinstance(res[0], WorkerTimeout)
        assert all(not isinstance(r, BaseException) for r in res[1:])
        assert took < 15, took
        assert pool.stats["timeouts"] == 1 and pool.stats["restarts"] == 1
        assert pool.stats["replays"] == 1  # slot 2 lives on worker 0 with the hung slot 0
    finally:
        pool.close()


def test_engine_accounts_for_a_crashed_episode():
    """Through the rollout engine (with overlap): the crashed episode is aborted and counted, its
    group-mates finish all their steps."""
    from tiny_fixtures import Scripted, tiny_chat, tiny_tokenizer

    from cope.rollout.loop import run_episodes

    tok, chat = tiny_tokenizer(), tiny_chat()
    ids = lambda a: [*tok.encode(a, add_special_tokens=False), chat.stop_id]  # noqa: E731
    pool = EnvWorkerPool(chaos(crash_on=["crash"]), num_workers=2)
    try:
        plans = {0: [ids("north"), ids("crash")], 1: [ids("north")] * 3, 2: [ids("south")] * 3, 3: [ids("east")] * 3}
        eps, stats = run_episodes(pool, [_task(0)] * 4, [0] * 4, Scripted(plans), tok, chat, max_context=512,
                                  max_action_tokens=8, chunks=2)
        assert eps[0].aborted and eps[0].num_steps == 2 and stats.env_errors == 1
        assert not any(e.aborted for e in eps[1:])
        assert pool.stats["restarts"] == 1
        ref, _ = run_episodes([MAZE() for _ in range(4)], [_task(0)] * 4, [0] * 4, Scripted(plans), tok, chat,
                              max_context=512, max_action_tokens=8)
        assert [e.tokens for e in eps[1:]] == [e.tokens for e in ref[1:]]  # undisturbed by the crash and restart
    finally:
        pool.close()


@pytest.mark.long
def test_training_survives_crashes_and_hangs(run_train, read_metrics, tmp_path):
    """A run whose env crashes and hangs at random steps keeps training with the full episode count;
    env/restarts, env/timeouts and env/aborted_episodes are logged."""
    result = run_train(["env=maze_chaos", "env.crash_prob=0.05", "env.hang_prob=0.05", "data.env_runtime.workers=2",
                        "data.env_runtime.step_timeout_s=1", "data.env_runtime.chunks=2", "trainer.max_epochs=2"], tmp_path)
    assert result["counters/episodes"] == 16
    cols = read_metrics(tmp_path / "csv" / "metrics.csv")
    for k in ("env/restarts", "env/timeouts", "env/crashes", "env/aborted_episodes", "env/groups_shrunk"):
        assert len(cols.get(k, [])) == 2, (k, cols.get(k))
    assert sum(cols["env/timeouts"]) > 0 and sum(cols["env/crashes"]) > 0
    assert sum(cols["env/restarts"]) == sum(cols["env/timeouts"]) + sum(cols["env/crashes"])
    assert sum(cols["env/aborted_episodes"]) > 0


def test_remote_env_round_trip_and_failure():
    env = RemoteEnv(target="cope.envs.runtime.chaos.ChaosEnv",
                    kwargs={"env": MAZE, "crash_on": ["crash"]}, timeout_s=5)
    try:
        local = MAZE()
        assert env.name == "maze" and env.instructions == local.instructions and env.num_tasks("test") == 1000
        assert env.reset(_task(3)).observation == local.reset(_task(3)).observation
        assert env.step("north").observation == local.step("north").observation
        with pytest.raises(WorkerFailure):
            env.step("crash")
        with pytest.raises(WorkerFailure, match="reset"):
            env.step("north")
        assert env.reset(_task(3)).observation == local.reset(_task(3)).observation  # a fresh child
    finally:
        env.close()


def test_remote_env_missing_interpreter_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        RemoteEnv(target="cope.envs.maze.MazeEnv", python=str(tmp_path / "nope" / "python"))


def test_worker_modules_import_without_torch():
    code = "import cope.envs.runtime.worker, cope.envs.runtime.remote, cope.envs.runtime.chaos, sys; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


class _HeavyMaze(MazeEnv):
    max_instances = 3  # as a JVM-backed env declares how many instances may live at once


def test_max_instances_bounds_live_episodes_and_instances():
    """An env's max_instances turns data.env_runtime.max_live_episodes=null into waves of that size: an epoch of
    8 episodes runs with 3 env instances; an explicit data.env_runtime.max_live_episodes wins."""
    from tiny_fixtures import tiny_policy

    from cope.rollout.engine import EnvRuntime, Sampling
    from cope.train.datamodule import RolloutDataModule

    heavy = functools.partial(_HeavyMaze, sizes=[6], max_steps=4)
    assert RolloutDataModule(env=heavy, env_runtime=EnvRuntime(max_live_episodes=5), progress=False).engine.runtime.max_live_episodes == 5
    dm = RolloutDataModule(env=heavy, tasks_per_epoch=2, group_size=4, max_context=512, sampling=Sampling(max_action_tokens=4),
                           progress=False)
    assert dm.engine.runtime.max_live_episodes == 3
    policy = tiny_policy()
    dm.connect(policy)
    eps, stats = dm.engine.rollout([_task(i // 4) for i in range(8)], [i // 4 for i in range(8)], dm.sampling)
    assert len(eps) == 8 and stats.episodes == 8 and [e.task.index for e in eps] == [i // 4 for i in range(8)]
    assert len(dm.engine.env_batch().envs) == 3
    dm.teardown("fit")


def test_replay_that_crashes_loses_its_slot_and_replays_the_others_again(tmp_path, monkeypatch):
    """Slot 0's step kills the worker; replaying slot 1 works, replaying slot 2 kills the new worker too
    (its replay meets a fault). Slot 2 is reported lost (never stepped on a fresh, un-reset env); slot
    1's restored state died with that worker, so it is replayed once more on a third worker and goes on
    exactly as an undisturbed env does; the pool keeps serving."""
    from pathlib import Path

    monkeypatch.setenv("PYTHONPATH", f"{Path(__file__).parent}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    import faulty_env  # noqa: F401 - the workers import it by name

    flag = tmp_path / "flag"
    factory = functools.partial(faulty_env.FlagCrashMaze, flag=str(flag), sizes=[6], max_steps=20)
    pool = EnvWorkerPool(factory, num_workers=1, reset_timeout_s=60)
    try:
        pool.reset([(0, _task(0)), (1, _task(1)), (2, _task(2))])
        assert not any(isinstance(r, BaseException) for r in pool.submit([(1, "north"), (2, "east")]).results())
        flag.write_text("on")  # from now on, "east" (slot 2's history) kills the worker
        res = pool.submit([(0, "crash"), (1, "north"), (2, "north")]).results()
        assert isinstance(res[0], WorkerFailure)
        ref = MAZE()
        ref.reset(_task(1))
        ref.step("north")
        assert res[1].observation == ref.step("north").observation
        assert isinstance(res[2], WorkerFailure) and "lost" in str(res[2])
        assert pool.stats["restarts"] == pool.stats["crashes"] == 2
        assert pool.stats["replays"] == 3 and pool.stats["replay_failures"] == 1
        flag.unlink()
        assert not any(isinstance(r, BaseException) for r in pool.reset([(1, _task(1)), (2, _task(2))]))
        assert not isinstance(pool.submit([(1, "north")]).results()[0], BaseException)
    finally:
        pool.close()


def test_large_requests_and_replies_do_not_deadlock(monkeypatch):
    """Eight 100 kB actions to one worker whose answers are 200 kB each: more than a pipe holds both ways.
    The worker's reader thread keeps taking requests, so neither side blocks forever."""
    import threading
    from pathlib import Path

    monkeypatch.setenv("PYTHONPATH", f"{Path(__file__).parent}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    import faulty_env

    pool = EnvWorkerPool(functools.partial(faulty_env.LoudMaze, sizes=[6], max_steps=20), num_workers=1)
    out = {}

    def run():
        pool.reset([(s, _task(s)) for s in range(8)])
        out["res"] = pool.submit([(s, "n" * 100_000) for s in range(8)]).results()

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(60)
    try:
        assert not t.is_alive(), "deadlock: parent and worker both blocked on full pipes"
        assert [len(r.observation) for r in out["res"]] == [200_000] * 8
    finally:
        if not t.is_alive():
            pool.close()
