"""bench/overlap_speed.py (epoch wall time by data.max_lag, side by side) and bench/gpu_overlap_check.py (its GPU phase):
the report's arithmetic on synthetic metrics (per-epoch rows out of a CSVLogger file, the steady window, medians,
ratios to lag 0, episodes per second, the projection's model), the round-robin order, the bench's env (sleeps only in
env workers, accepted by the config check) and epoch clock; the GPU check's refusal without CUDA, its preflight
(hydra, vLLM interpreter) and its runs' configs passing the config check on CPU; one real run of two lags (25 s)."""
from __future__ import annotations

import csv
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bench import gpu_overlap_check as gpu
from bench import overlap_speed as bench
from cope.run.config_check import check_config

REPO = Path(__file__).resolve().parents[1]


def _write_metrics(path: Path, epochs: list[dict[str, float]]) -> None:
    """A CSVLogger-like file: a step row (no epoch-level keys) and an epoch row per epoch, keys absent where not logged."""
    keys = sorted({k for e in epochs for k in e} | {"epoch", "step", "loss/total"})
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys)
        w.writeheader()
        for i, e in enumerate(epochs):
            w.writerow({"epoch": i, "step": i, "loss/total": 0.5})
            w.writerow({"epoch": i, "step": i, **e})


def _epochs(walls, rollout=1.0, wait=None, per_epoch=8) -> list[dict[str, float]]:
    out = []
    for i, wall in enumerate(walls):
        m = {bench.WALL: wall, "perf/rollout_seconds": rollout, "perf/epoch_seconds": 0.5, "counters/episodes": per_epoch * (i + 1)}
        if wait is not None:
            m["perf/rollout_wait_seconds"] = wait
        out.append({**m, "episodes": float(per_epoch), "epoch": float(i)})
    return out


def test_epoch_table_reads_each_epochs_row_and_its_episodes(tmp_path):
    _write_metrics(tmp_path / "metrics.csv", _epochs([5.0, 3.0, 4.0], wait=0.25))
    table = bench.epoch_table(tmp_path / "metrics.csv")
    assert [m["epoch"] for m in table] == [0, 1, 2]
    assert [m[bench.WALL] for m in table] == [5.0, 3.0, 4.0]
    assert [m["episodes"] for m in table] == [8, 8, 8]  # from the cumulative counter
    assert [m["steps"] for m in table] == [1, 1, 1]  # from the logged step (0, 1, 2: one optimizer step an epoch)
    assert all(m["perf/rollout_wait_seconds"] == 0.25 for m in table)


def test_summary_medians_over_the_same_steady_window_ratios_and_rates():
    # 6 epochs; window = epochs 1..3 for every lag (epoch 0 and the last max(lags) = 2 dropped)
    runs = {0: [_epochs([9, 4, 6, 5, 1, 1])],
            1: [_epochs([9, 3, 2, 4, 1, 1], wait=0.5)],
            2: [_epochs([9, 2, 2, 2, 1, 1], wait=0.0), _epochs([9, 3, 3, 3, 1, 1], wait=0.0)]}
    s = bench.summarize(runs)
    assert s[0]["steady_epochs"] == 3 and s[2]["steady_epochs"] == 6  # rounds pooled
    assert s[0]["epoch_s"] == 5 and s[1]["epoch_s"] == 3 and s[2]["epoch_s"] == 2.5
    assert s[1]["ratio"] == pytest.approx(3 / 5) and s[2]["speedup"] == pytest.approx(5 / 2.5) and s[0]["ratio"] == 1
    assert s[0]["wait_s"] is None and s[1]["wait_s"] == 0.5
    assert s[0]["episodes_per_s"] == pytest.approx(24 / 15)  # 3 epochs of 8 episodes in 4 + 6 + 5 s
    assert s[0]["episodes_per_s_fit"] == pytest.approx(48 / 26)  # the whole fit, fill and drain included
    assert bench.summarize(runs, drop_first=0, drop_last=0)[0]["epoch_s"] == 4.5


def test_projection_is_the_sync_and_lagged_model():
    p = bench.projection(rollout_s=3.0, rest_s=1.0, sync_s=0.1)
    assert p["here"]["sync"] == 4.0 and p["here"]["lagged"] == pytest.approx(3.1)
    assert p["here"]["speedup"] == pytest.approx(4.0 / 3.1) and p["here"]["R_over_T"] == 3.0
    rows = {r["R_over_T"]: r for r in p["ratios"]}
    assert set(rows) == set(bench.RATIOS)
    assert rows[1.0]["speedup"] == pytest.approx(2.0 / 1.1)  # the bound 2x, less the sync (0.1 of T)
    assert rows[4.0]["lagged"] == pytest.approx(4.1) and rows[0.25]["lagged"] == pytest.approx(1.1)
    assert bench.projection(1.0, 1.0)["here"]["speedup"] == 2.0


def test_render_labels_the_projection_a_model_and_carries_the_caveat():
    runs = {lag: [_epochs([4, 3, 3, 3])] for lag in (0, 1)}
    s = bench.summarize(runs)
    md = bench.render({"engine": "hf", "caveat": "loaded machine", "summary": json.loads(json.dumps(s)),
                       "projection": bench.projection(1.0, 2.0), "overrides": ["debug=fast"], "threads": 1, "rounds": 1,
                       "epochs": 4, "order": [0, 1]})
    assert "loaded machine" in md and "a model, not a measurement" in md and "| 1 | 2 | 3.00 | 1.00x |" in md


def test_round_robin_rotates_the_order():
    assert bench.plan([0, 1, 2], 3) == [(0, 0), (0, 1), (0, 2), (1, 1), (1, 2), (1, 0), (2, 2), (2, 0), (2, 1)]


def test_slow_maze_sleeps_only_in_env_workers(monkeypatch):
    monkeypatch.delenv("COPE_ENV_WORKER", raising=False)
    here = bench.SlowMaze(step_seconds=0.2, reset_seconds=0.2)
    assert (here.step_seconds, here.reset_seconds) == (0.0, 0.0)  # the trainer's own instances: the plain maze
    monkeypatch.setenv("COPE_ENV_WORKER", "1")
    env = bench.SlowMaze(step_seconds=0.05, max_steps=4)
    from cope.envs.base import Task

    env.reset(Task("maze", "train", 0))
    t0 = time.perf_counter()
    env.step("north")
    assert time.perf_counter() - t0 >= 0.05 and env.max_steps == 4
    with pytest.raises(ValueError, match="step_seconds"):
        bench.SlowMaze(step_seconds=-1)


def test_the_benchs_overrides_pass_the_config_check(compose, tmp_path):
    """Both engines' runs compose and pass the config check (SlowMaze typed through MazeEnv's keys, the epoch clock a
    callback block); a mistyped SlowMaze key is refused naming it."""
    from lightning.pytorch import Callback

    assert issubclass(bench.EpochClock, Callback)
    for engine in ("hf", "vllm"):
        cfg = compose([*bench.COMMON, *bench.SIZES, *bench.engine_overrides(engine, 2, 0.05, "1"), "data.max_lag=1"], tmp_path)
        check_config(cfg)
    bad = compose([*bench.COMMON, *bench.engine_overrides("hf", 2, 0.05, "1"), "+env.step_secs=1"], tmp_path)
    with pytest.raises(Exception, match="env.step_secs"):
        check_config(bad)


def test_gpu_check_refuses_without_cuda_at_once(tmp_path):
    pytest.importorskip("torch")
    import torch

    if torch.cuda.is_available():
        pytest.skip("checks the refusal on a machine without CUDA")
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, str(REPO / "bench" / "gpu_overlap_check.py")], cwd=tmp_path, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 2 and "no CUDA device" in proc.stderr and "Traceback" not in proc.stderr
    assert time.perf_counter() - t0 < 60 and not (tmp_path / "gpu_overlap_check.json").exists()


def test_gpu_check_preflight_names_what_is_missing(monkeypatch):
    import importlib.util

    import torch

    args = gpu.argparse.Namespace(engine="vllm", vllm_python=None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "hydra" else real(name, *a))
    assert gpu.preflight(args) == (3, "gpu_overlap_check: hydra is not importable; install hydra-core before the check")
    monkeypatch.setattr(importlib.util, "find_spec", real)
    args.vllm_python = "/nonexistent/python"
    code, msg = gpu.preflight(args)
    assert code == 3 and "no vLLM interpreter at /nonexistent/python" in msg and "--engine hf" in msg
    args.vllm_python = sys.executable  # the trainer's venv: no vllm in it
    code, msg = gpu.preflight(args)
    assert code == 3 and "cannot import vllm" in msg
    assert gpu.preflight(gpu.argparse.Namespace(engine="hf", vllm_python=None)) is None


@pytest.mark.parametrize("engine", ["vllm", "hf", "branch"])
def test_gpu_check_runs_are_lag_0_and_1_on_one_gpu_and_pass_the_config_check(compose, tmp_path, engine, capsys, monkeypatch):
    """The runs' configs as the GPU machine checks them (CUDA reported present: the check refuses trainer=gpu here)."""
    import peft  # noqa: F401 - before CUDA is faked: peft probes CUDA streams on import (the test alone failed)
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    args = gpu.argparse.Namespace(engine=engine, lags=[0, 1], epochs=4, gpu_memory_utilization=0.3, vllm_python=None)
    runs = gpu.plan(args)
    assert [r["lag"] for r in runs] == [0, 1] and [r["overrides"][-1] for r in runs] == ["data.max_lag=0", "data.max_lag=1"]
    for r in runs:
        o = r["overrides"]
        assert "trainer=gpu" in o and "trainer.max_epochs=4" in o
        if engine == "vllm":
            assert {"rollout=vllm", "data.engine.max_loras=2", "data.engine.gpu_memory_utilization=0.3"} <= set(o)
        assert ("+collector=branching" in o) == (engine == "branch")
        cfg = compose(o, tmp_path)
        check_config(cfg)
        assert cfg.data.max_lag == r["lag"] and cfg.trainer.accelerator == "gpu" and cfg.model.hidden_size == 896
        if engine == "vllm":
            assert cfg.data.engine.gpu_memory_utilization == 0.3 and list(cfg.data.engine.server_args) == ["--enforce-eager"]
    assert gpu.main(["--plan", "--engine", engine]) == 0
    assert capsys.readouterr().out.count("python train.py") == 2
    with pytest.raises(SystemExit):
        gpu.main(["--plan", "--lags", "1"])  # no baseline


@pytest.mark.long
def test_two_lags_side_by_side(tmp_path):
    """The bench itself: lag 0 and lag 1 of the micro model (3 epochs each, real train.py runs, env workers with the
    sleeping maze): the report's numbers come from the runs' own metrics."""
    out = tmp_path / "hf"
    rc = bench.main(["--engine", "hf", "--lags", "0", "1", "--epochs", "3", "--workers", "1", "--step-seconds", "0.01",
                     "--overrides", "debug=fast", "model.hidden_size=64", "--workdir", str(tmp_path / "runs"), "--out", str(out)])
    assert rc == 0
    result = json.loads(out.with_suffix(".json").read_text())
    s = result["summary"]
    assert s["0"]["steady_epochs"] == 1 and s["1"]["steady_epochs"] == 1 and s["0"]["ratio"] == 1.0
    assert s["1"]["wait_s"] is not None and s["1"]["lag_mean"] == 1.0 and s["0"]["wait_s"] is None
    assert s["0"]["episodes_per_s"] > 0 and s["0"]["env_s"] > 0  # the workers slept
    assert [m["episodes"] for m in result["epochs_by_lag"]["1"][0]] == [8.0, 8.0, 8.0]
    assert "a model, not a measurement" in out.with_suffix(".md").read_text()
