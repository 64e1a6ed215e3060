"""The benchmark scripts run end to end with their smallest settings and write their outputs.

Numbers are not checked (a micro model on a shared CPU): only that each script finishes, prints its
summary line and leaves the files the README promises. ``COPE_CACHE`` comes from conftest's session
fixture, so the micro model is built (seconds) in a temp folder.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow


def _run(script: str, args: list[str], timeout: float = 600) -> subprocess.CompletedProcess:
    """``python -m bench.<script> args`` from the repository root, as bench/README.md runs it."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    module = "bench." + script.removesuffix(".py")
    proc = subprocess.run([sys.executable, "-m", module, *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def test_step_overhead_smoke(tmp_path):
    out = tmp_path / "so.md"
    proc = _run("step_overhead.py", ["--model-overrides", "debug=fast", "--steps", "2", "--warmup", "1",
                                     "--episodes", "8", "--min-success", "0", "--out", str(out)])
    assert "CoPE packed / GRPO = " in proc.stdout and "ECHO / GRPO = " in proc.stdout
    text = out.read_text()
    for name in ("GRPO", "CoPE (packed)", "CoPE (plain)", "ECHO", "CoPE+ECHO"):
        assert f"| {name} |" in text
    report = json.loads(out.with_suffix(".json").read_text())
    assert report["episodes"] == 8 and report["variants"]["GRPO"]["ratio"] == pytest.approx(1.0)
    assert all(len(v["times_s"]) == 2 and v["mean_s"] > 0 for v in report["variants"].values())


def test_cope_update_cost_smoke(tmp_path):
    out = tmp_path / "cuc.md"
    _run("cope_update_cost.py", ["--model-overrides", "debug=fast", "model.warm_start_steps=150", "env.sizes=[5]",
                                 "env.min_distance=1", "--episodes", "8", "--minibatch-size", "8", "--epochs", "1", "--warmup", "0",
                                 "--kept-tiles", "--out", str(out)])
    text = out.read_text()
    for name in ("GRPO", "GRPO (groups shared)", "CoPE (separate)", "CoPE (separate, shared)", "CoPE (joint, dense mask)",
                 "CoPE (joint, tree)"):
        assert f"| {name} |" in text
    report = json.loads(out.with_suffix(".json").read_text())
    v = report["variants"]
    assert v["GRPO"]["ratio"] == pytest.approx(1.0) and all(x["mean_s"] > 0 and x["peak_bytes"] > 0 for x in v.values())
    assert v["CoPE (joint, tree)"]["steps"] == v["CoPE (joint, dense mask)"]["steps"] == v["GRPO"]["steps"]  # joint: no step of its own
    tree, mask = v["CoPE (joint, tree)"], v["CoPE (joint, dense mask)"]
    # tree attention joins each group's packed rows into the group's trie (what they share forwarded once): fewer
    # tokens, cells and visible cells than the dense mask over the same rows unshared
    assert tree["tokens"] < mask["tokens"] and tree["visible"] < mask["visible"] and tree["cells"] < mask["cells"]
    groups = v["GRPO (groups shared)"]  # each group's prompt once; the same targets
    assert groups["tokens"] < v["GRPO"]["tokens"] and groups["targets"] == v["GRPO"]["targets"]
    assert all(x["flops_7b"] > 0 for x in v.values())
    assert v["CoPE (separate)"]["steps"] == v["GRPO"]["steps"] + -(-report["samples"] // 16)  # + one per 16 samples
    dense, shared = v["CoPE (separate)"], v["CoPE (separate, shared)"]
    assert shared["steps"] == dense["steps"] and shared["targets"] == dense["targets"]  # the same samples trained
    assert shared["tokens"] < dense["tokens"] and shared["cells"] < dense["cells"] and shared["visible"] < dense["visible"]
    floor = report["forecast_token_floor"]  # each history once, plus the samples: no layout forwards fewer
    assert floor <= shared["forecast_tokens"] < dense["forecast_tokens"] and "vs their floor" in text
    assert shared["tokens"] - shared["forecast_tokens"] == v["GRPO"]["tokens"]  # the policy steps: GRPO's batches
    assert all(x["visible"] <= x["cells"] for x in v.values())
    kept = v["CoPE (joint, tree, tiles kept)"]  # the same work, its tile calls' activations kept for backward
    assert (kept["tokens"], kept["cells"], kept["steps"]) == (tree["tokens"], tree["cells"], tree["steps"])
    assert kept["peak_bytes"] > tree["peak_bytes"] and "GRPO (groups shared, tiles kept)" in v


def test_wm_sft_cost_smoke(tmp_path):
    out = tmp_path / "wm.md"
    _run("wm_sft_cost.py", ["--model-overrides", "debug=fast", "model.warm_start_steps=150", "env.sizes=[5]",
                            "--episodes", "4", "--epochs", "1", "--warmup", "0", "--out", str(out)])
    text = out.read_text()
    for name in ("GRPO", "WM-SFT (plain)", "WM-SFT (packed, dense mask)", "WM-SFT (packed, tree)"):
        assert f"| {name} |" in text
    v = json.loads(out.with_suffix(".json").read_text())["variants"]
    plain, dense, tree = v["WM-SFT (plain)"], v["WM-SFT (packed, dense mask)"], v["WM-SFT (packed, tree)"]
    assert plain["targets"] == dense["targets"] == tree["targets"] > v["GRPO"]["targets"]  # the same samples trained
    assert tree["tokens"] <= dense["tokens"] < plain["tokens"]  # the history once per episode, not once per sample
    assert tree["cells"] < dense["cells"] and all(x["mean_s"] > 0 for x in v.values())


def test_step_vs_raw_smoke(tmp_path):
    out = tmp_path / "svr.json"
    proc = _run("step_vs_raw.py", ["--quick", "--json", str(out)])
    assert "raw/trainer" in proc.stdout and "peak memory per step" in proc.stdout
    report = json.loads(out.read_text())
    assert report["speed"] and report["memory"]
    for row in report["speed"]:
        assert row["raw_mean_s"] > 0 and row["trainer_mean_s"] > 0 and row["before_mean_s"] > 0 and row["raw_over_trainer"] > 0


@pytest.mark.parametrize("envs", [["maze", "webshop"], ["textworld"]])
def test_env_speed_smoke(envs, tmp_path):
    """bench/env_speed.py replays through every variant (raw where the package exists) and writes its table."""
    if envs == ["textworld"]:
        pytest.importorskip("textworld", reason="needs the textworld extra")
    proc = _run("env_speed.py", ["--envs", *envs, "--episodes", "2", "--steps", "3", "--rounds", "1",
                                 "--workers", "1", "2", "--cache-dir", str(tmp_path / "cache"), "--out", str(tmp_path)])
    data = json.loads((tmp_path / "env_speed.json").read_text())["results"]
    assert sorted(data) == sorted(envs), proc.stdout
    for name in envs:
        keys = set(data[name]["steps_per_s"])
        assert {"adapter", "pool 1", "pool 2"} <= keys and all(v > 0 for v in data[name]["steps_per_s"].values())
        assert ("raw" in keys) == (name == "textworld")
    assert (tmp_path / "env_speed.md").read_text().count("\n") >= 4


def test_rollout_speed_smoke(tmp_path):
    """bench/rollout_speed.py runs the three settings with the micro policy and prints a line for each."""
    proc = _run("rollout_speed.py", ["--env", "maze", "--episodes", "4", "--rounds", "1", "--workers", "2",
                                     "--cache-dir", str(tmp_path / "cache")])
    lines = [ln for ln in proc.stdout.splitlines() if "speed-up" in ln]
    assert [ln.split()[0] for ln in lines] == ["in-process", "workers", "workers+overlap"], proc.stdout
    assert all(" 0 " not in ln.split("env steps")[1] for ln in lines)


def test_warm_start_prior_smoke(tmp_path):
    """bench/warm_start_prior.py builds a random and an expert micro warm start, measures both, writes its table;
    a second call adds a build seed, loads the cached build and keeps the rows it did not redo."""
    out = tmp_path / "wsp.json"
    common = ["--tasks", "4", "--cache-dir", str(tmp_path / "cache"), "--overrides", "debug=fast", "--out", str(out)]
    proc = _run("warm_start_prior.py", ["--probs", "random", "0.5", *common])
    assert "expert 0.5" in proc.stdout and "random" in proc.stdout
    rows = json.loads(out.read_text())["rows"]
    assert [r["warm_start"] for r in rows] == ["random", "0.5"] and all(r["built"] and r["build_seconds"] > 0 for r in rows)
    assert all(r["val_panel"] == 8 and 0 <= r["greedy_val_panel"] <= 1 for r in rows)  # debug=fast: data.val_tasks=8
    _run("warm_start_prior.py", ["--probs", "0.5", "--build-seeds", "0", "1", *common])
    rows = json.loads(out.read_text())["rows"]
    assert [(r["warm_start"], r["build_seed"], r["built"]) for r in rows] == [("random", 0, True), ("0.5", 0, False), ("0.5", 1, True)]
    assert rows[1]["build_seconds"] > 0  # the earlier build's time is kept


def test_branch_cost_smoke(tmp_path):
    """bench/branch_cost.py collects flat and branched epochs at equal leaves and writes its table, the tree cheaper
    in env steps (a uniform trigger on the maze always forks)."""
    out = tmp_path / "branch.md"
    _run("branch_cost.py", ["--tasks", "2", "--roots", "2", "--rounds", "1", "--out", str(out),
                            "--cache-dir", str(tmp_path / "cache")])
    rows = [ln.split("|") for ln in out.read_text().splitlines() if ln.startswith("| flat") or ln.startswith("| branching")]
    assert [r[1].strip() for r in rows] == ["flat", "branching roots=2"]
    assert float(rows[1][5].strip().rstrip("x")) < 1.0  # env steps vs flat
    assert float(rows[1][10].strip().rstrip("x")) < 1.0  # tokens the update forwards (prefix tries) vs flat
    assert float(rows[0][11]) > 0 and float(rows[1][11]) > 0  # the update's seconds per leaf, both measured


def test_rwml_calibration_smoke(tmp_path):
    """bench/rwml_calibration.py samples world-model predictions of a warm-started micro model's own transitions and
    writes the reward tables (every threshold, the copy and constant predictors beside the policy) and its JSON."""
    _run("rwml_calibration.py", ["--epochs", "1", "--triplets", "3", "--predictions", "4", "--train-group", "2",
                                 "--out", str(tmp_path), "--overrides", "debug=fast", "model.warm_start_steps=150",
                                 "env.sizes=[5]", "env.min_distance=1"])
    got = json.loads((tmp_path / "calibration.json").read_text())
    assert got["chosen"] == 3 and len(got["samples"]) == 3 and all(len(s["predictions"]) == 4 for s in got["samples"])
    assert set(got["distance"]) == {"0.05", "0.1", "0.15", "0.2", "0.3", "0.4", "0.5", "0.6"}
    assert all(0 <= v["spread_at_g"] <= v["spread"] <= 1 for v in got["distance"].values())
    md = (tmp_path / "calibration.md").read_text()
    assert "| tau_d | mean reward |" in md and "with a spread at G=2" in md and "copy's reward" in md
