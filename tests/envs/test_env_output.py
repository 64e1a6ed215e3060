"""What envs print reaches the run's log only up to a cap (`cope.envs.runtime.output`), in worker processes
(`EnvWorkerPool`) and in this process (`InProcessEnvs`); the rest is counted (``output_capped``), and the
episodes go on (a chatty env) or abort on their deadline (an env that prints without end)."""
from __future__ import annotations

import functools
import os
import sys
from pathlib import Path

import pytest

from cope.envs.base import EnvStep, Task
from cope.envs.runtime.batch import InProcessEnvs
from cope.envs.runtime.output import OutputCap
from cope.envs.runtime.pool import EnvWorkerPool
from cope.envs.runtime.worker import WorkerTimeout

CAP = 64 << 10
SLACK = 4 << 10  # the notice line and pytest's own lines
PER_STEP = 4 << 20  # 64 times the cap on every step


def _task(i: int = 0) -> Task:
    return Task("maze", "train", i)


@pytest.fixture
def faulty(monkeypatch):
    monkeypatch.setenv("PYTHONPATH", f"{Path(__file__).parent}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    import faulty_env  # the workers import it by name

    return faulty_env


def test_cap_forwards_exactly_the_limit_then_one_notice():
    cap = OutputCap(limit=10, label="test")
    r, w = os.pipe()
    out_r, out_w = os.pipe()
    cap.drain(r, out_w)
    for _ in range(3):
        os.write(w, b"0123456789abcdef")
    os.close(w)
    assert cap.wait(5)
    with os.fdopen(out_r, "rb") as f:
        got = f.read()
    assert got.startswith(b"0123456789\n[test: more than 10 bytes of output;") and got.count(b"[test:") == 1
    assert (cap.forwarded, cap.dropped, cap.capped) == (10, 38, True)


def test_chatty_env_in_workers_is_capped_and_completes(faulty, capfd):
    """Before the cap: the worker's stderr was the parent's, so all 12 MB went into the run's log."""
    factory = functools.partial(faulty.ChattyMaze, per_step=PER_STEP, sizes=[6], max_steps=3)
    pool = EnvWorkerPool(factory, num_workers=1, max_output_bytes=CAP)
    try:
        assert not isinstance(pool.reset([(0, _task())])[0], BaseException)
        steps = [pool.submit([(0, a)]).results()[0] for a in ("north", "south", "east")]
        assert all(isinstance(s, EnvStep) for s in steps) and steps[-1].done
        assert pool.stats["output_capped"] == 1 and pool.stats["restarts"] == 0
    finally:
        pool.close()
    err = capfd.readouterr().err
    assert CAP <= len(err) <= CAP + SLACK and err.count("bytes of output; the rest is dropped") == 1


def test_endless_printer_in_a_worker_is_capped_and_aborted_by_its_deadline(faulty, capfd):
    """An env that prints forever (TextWorld's interpreter on "\\help" wrote 16 GB in 20 s): its step times
    out, its episode aborts, the pool goes on with a fresh worker, and the log got at most the cap."""
    factory = functools.partial(faulty.FloodMaze, sizes=[6], max_steps=5)
    pool = EnvWorkerPool(factory, num_workers=1, step_timeout_s=1.5, max_output_bytes=CAP)
    try:
        pool.reset([(0, _task())])
        assert isinstance(pool.submit([(0, "flood")]).results()[0], WorkerTimeout)
        assert pool.stats["timeouts"] == 1 and pool.stats["output_capped"] == 1
        pool.reset([(0, _task())])
        assert isinstance(pool.submit([(0, "north")]).results()[0], EnvStep)
    finally:
        pool.close()
    err = capfd.readouterr().err
    assert CAP <= len(err) <= CAP + SLACK


def test_chatty_env_in_process_is_capped(faulty, capfd):
    envs = InProcessEnvs(functools.partial(faulty.ChattyMaze, per_step=PER_STEP, sizes=[6], max_steps=3),
                         max_output_bytes=CAP)
    envs.reset([(0, _task())])
    steps = [envs.submit([(0, a)]).results()[0] for a in ("north", "south", "east")]
    print("after the steps", file=sys.stderr, flush=True)  # this process's stderr is its own again
    envs.close()
    assert all(isinstance(s, EnvStep) for s in steps) and steps[-1].done
    assert envs.stats["output_capped"] == 1
    err = capfd.readouterr().err
    assert CAP <= len(err) <= CAP + SLACK and err.endswith("after the steps\n")
    assert envs.output.forwarded == CAP and envs.output.dropped == 3 * PER_STEP - CAP
