"""The worker pool (envs/runtime/pool.py) against a fault at each point of the worker protocol: the env's
construction (``make``), ``reset``, ``step`` and ``close``, each fault a crash, a hang, an env error, a
closed reply pipe or a garbage reply (injected by envs/runtime/chaos.py), and a worker killed from outside
while a slot is being made. Each is survived, counted once, and costs exactly the request it hit."""
from __future__ import annotations

import functools
import os
import pickle
import signal
import struct
import time
from pathlib import Path

import pytest

from cope.envs.base import Task
from cope.envs.maze import MazeEnv
from cope.envs.runtime.chaos import GARBAGE, KINDS, ChaosEnv
from cope.envs.runtime.pool import EnvWorkerPool
from cope.envs.runtime.worker import WorkerFailure, WorkerTimeout

MAZE = functools.partial(MazeEnv, sizes=[6], max_steps=20)
STEP_S, RESET_S = 1.5, 3.0  # deadlines; a hang costs one of them


def _task(i: int) -> Task:
    return Task("maze", "train", i)


def _reference(plan: dict[int, list[str]]) -> dict[int, str]:
    """The last observation of each slot's actions on an undisturbed maze."""
    out = {}
    for s, actions in plan.items():
        env = MAZE()
        out[s] = env.reset(_task(s)).observation
        for a in actions:
            out[s] = env.step(a).observation
    return out


def _faulty_pool(tmp_path, point: str, kind: str) -> EnvWorkerPool:
    factory = functools.partial(ChaosEnv, env=MAZE, faults={point: kind}, armed=str(tmp_path / "armed"),
                                log_path=str(tmp_path / "faults.log"), max_faults=1, hang_seconds=60)
    return EnvWorkerPool(factory, num_workers=1, step_timeout_s=STEP_S, reset_timeout_s=RESET_S)


def _fired(tmp_path) -> list[tuple[str, str]]:
    log = tmp_path / "faults.log"
    return [tuple(line.split()[:2]) for line in log.read_text().splitlines()] if log.exists() else []


def _ok(r) -> bool:
    return not isinstance(r, BaseException)


def test_worker_killed_while_a_slot_is_made():
    """The reproduction of a reviewed pool bug: a step is in flight on worker 0 when it is killed; then a
    reset asks for a slot that worker never made. Making it finds the worker dead; the pool restarts
    it and makes the slot on the new worker (it used to write into the old, closed pipe:
    ``ValueError: I/O operation on closed file``)."""
    pool = EnvWorkerPool(MAZE, num_workers=1)
    try:
        assert _ok(pool.reset([(0, _task(0))])[0])
        inflight = pool.submit([(0, "north")])
        old = pool._workers[0]
        os.kill(old.proc.pid, signal.SIGKILL)
        old.proc.wait()
        first = pool.reset([(1, _task(1))])[0]
        assert _ok(first) and first.observation == MAZE().reset(_task(1)).observation
        (step,) = inflight.results()
        assert isinstance(step, WorkerFailure) and not isinstance(step, WorkerTimeout)
        assert pool.stats["restarts"] == pool.stats["crashes"] == 1 and pool.stats["timeouts"] == 0
        with pytest.raises(WorkerFailure, match="must not be used again"):
            old.send("describe")  # the dropped handle refuses instead of writing into a closed pipe
    finally:
        pool.close()


def test_worker_killed_while_idle_loses_nothing():
    """Killed between requests, with episodes live on it: nothing was being served, so nothing fails;
    both episodes are replayed onto the new worker and go on as undisturbed envs do."""
    pool = EnvWorkerPool(MAZE, num_workers=1)
    try:
        pool.reset([(0, _task(0)), (1, _task(1))])
        assert all(map(_ok, pool.submit([(0, "north"), (1, "east")]).results()))
        os.kill(pool._workers[0].proc.pid, signal.SIGKILL)
        time.sleep(0.2)
        res = pool.submit([(0, "south"), (1, "west")]).results()
        want = _reference({0: ["north", "south"], 1: ["east", "west"]})
        assert [r.observation for r in res] == [want[0], want[1]]
        assert pool.stats["restarts"] == pool.stats["crashes"] == 1
        assert pool.stats["replays"] == 2 and pool.stats["replay_failures"] == 0
    finally:
        pool.close()


@pytest.mark.long
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("point", ["make", "reset", "step"])
def test_fault_at_each_protocol_point(tmp_path, point, kind):
    """Slots 0 and 1 are mid-episode; then the request of slot 2 meets the fault (its env's
    construction, its reset, or its step). Exactly that request fails; a worker fault (not an env
    error) is one restart, counted as a timeout for a hang and as a crash otherwise, and slots 0 and
    1 are replayed and go on exactly as undisturbed envs do."""
    pool = _faulty_pool(tmp_path, point, kind)
    try:
        assert all(map(_ok, pool.reset([(0, _task(0)), (1, _task(1))])))
        assert all(map(_ok, pool.submit([(0, "north"), (1, "east")]).results()))
        if point == "step":
            assert _ok(pool.reset([(2, _task(2))])[0])
        (tmp_path / "armed").touch()
        t0 = time.monotonic()
        if point == "step":
            hit, *rest = pool.submit([(2, "south"), (0, "south"), (1, "west")]).results()
        else:
            (hit,) = pool.reset([(2, _task(2))])
            rest = pool.submit([(0, "south"), (1, "west")]).results()
        took = time.monotonic() - t0
        assert _fired(tmp_path) == [(point, kind)]
        want = _reference({0: ["north", "south"], 1: ["east", "west"]})
        assert [r.observation if _ok(r) else r for r in rest] == [want[0], want[1]]
        worker_fault = kind != "error"
        if kind == "error":
            assert type(hit) is RuntimeError and "injected env error" in str(hit)
        else:
            assert isinstance(hit, WorkerTimeout if kind == "hang" else WorkerFailure), hit
            assert kind == "hang" or not isinstance(hit, WorkerTimeout)
        assert pool.stats["restarts"] == int(worker_fault)
        assert pool.stats["timeouts"] == int(kind == "hang")
        assert pool.stats["crashes"] == int(worker_fault and kind != "hang")
        assert pool.stats["replays"] == 2 * int(worker_fault) and pool.stats["replay_failures"] == 0
        assert took < (RESET_S if point != "step" else STEP_S) + 5, took
        (tmp_path / "armed").unlink()
        assert _ok(pool.reset([(2, _task(2))])[0])  # the slot serves again
    finally:
        pool.close()


@pytest.mark.long
@pytest.mark.parametrize("kind", KINDS)
def test_fault_while_closing(tmp_path, kind):
    """A worker whose env crashes, hangs, raises, closes the pipe or answers garbage while the pool
    closes: close returns within the deadline, kills the worker and counts one close failure."""
    pool = _faulty_pool(tmp_path, "close", kind)
    pid = pool._workers[0].proc.pid
    pool.reset([(0, _task(0)), (1, _task(1))])
    (tmp_path / "armed").touch()
    t0 = time.monotonic()
    pool.close()
    assert time.monotonic() - t0 < STEP_S + 5
    assert _fired(tmp_path) == [("close", kind)]
    assert pool.stats["close_failures"] == 1 and pool.stats["restarts"] == 0
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


def test_clean_close_counts_nothing(tmp_path):
    pool = _faulty_pool(tmp_path, "close", "crash")  # never armed
    pool.reset([(0, _task(0))])
    pool.close()
    assert pool.stats["close_failures"] == 0 and _fired(tmp_path) == []


@pytest.mark.parametrize("kind", ["crash", "garbage"])
def test_fault_while_building_the_first_env(tmp_path, kind):
    """The pool's first request (build slot 0's env and describe it) meets a worker fault: the pool
    retries on a new worker and comes up, with the restart counted."""
    factory = functools.partial(ChaosEnv, env=MAZE, faults={"make": kind}, log_path=str(tmp_path / "faults.log"),
                                max_faults=1)
    pool = EnvWorkerPool(factory, num_workers=1, reset_timeout_s=RESET_S)
    try:
        assert pool.name == "maze" and pool.stats["restarts"] == pool.stats["crashes"] == 1
        assert _fired(tmp_path) == [("make", kind)]
    finally:
        pool.close()


def test_env_that_cannot_be_built_is_a_clear_error():
    factory = functools.partial(ChaosEnv, env=MAZE, faults={"make": "error"})
    with pytest.raises(RuntimeError, match="cannot build and describe the env.*injected env error at make"):
        EnvWorkerPool(factory, num_workers=1, reset_timeout_s=RESET_S)


def test_chaos_config_errors_name_the_argument():
    with pytest.raises(ValueError, match="unknown fault point 'exit'"):
        ChaosEnv(env=MAZE, faults={"exit": "crash"})
    with pytest.raises(ValueError, match="unknown fault kind 'boom'"):
        ChaosEnv(env=MAZE, faults={"step": "boom"})
    with pytest.raises(ValueError, match="max_faults needs log_path"):
        ChaosEnv(env=MAZE, max_faults=1)
    with pytest.raises(ValueError, match="sum to"):
        ChaosEnv(env=MAZE, crash_prob=0.6, garbage_prob=0.6)


_TRUNCATED = struct.pack("!Q", 1000) + b"\x80\x04"  # a frame that never completes: only the deadline ends it
_WRONG_ID = pickle.dumps((10**6, True, None))
_WRONG_ID = struct.pack("!Q", len(_WRONG_ID)) + _WRONG_ID  # well formed, but answers no request sent


@pytest.mark.parametrize("garbage", [*GARBAGE, _TRUNCATED, _WRONG_ID],
                         ids=["not-a-pickle", "wrong-shape", "huge-length", "truncated", "wrong-request-id"])
@pytest.mark.long
def test_every_garbled_reply_is_a_worker_failure(garbage, monkeypatch):
    """Each way a reply can be garbled is one counted restart (a truncated frame is a timeout: the
    parent reads against the request's deadline, never blocking past it) and fails only the
    request it answered."""
    monkeypatch.setenv("PYTHONPATH", f"{Path(__file__).parent}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    import faulty_env

    factory = functools.partial(faulty_env.GarbageMaze, garbage=garbage.hex(), sizes=[6], max_steps=20)
    pool = EnvWorkerPool(factory, num_workers=1, step_timeout_s=STEP_S, reset_timeout_s=RESET_S)
    try:
        pool.reset([(0, _task(0)), (1, _task(1))])
        hit, other = pool.submit([(0, "garble"), (1, "east")]).results()
        assert isinstance(hit, WorkerTimeout if garbage is _TRUNCATED else WorkerFailure), hit
        assert other.observation == _reference({1: ["east"]})[1]
        assert pool.stats["restarts"] == 1
        assert pool.stats["timeouts" if garbage is _TRUNCATED else "crashes"] == 1
    finally:
        pool.close()
