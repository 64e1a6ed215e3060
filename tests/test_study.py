"""python -m bench.study end to end in miniature (--smoke): tuning picks a setting per arm, the test runs are
paired by seed, the report has every regime's table, the plots exist, and a second call reuses every run."""
from __future__ import annotations

import csv
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow


def _study(out: Path, *regimes: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "bench.study", "--smoke", "--jobs", "2", "--out", str(out),
                           "--regimes", *regimes], cwd=REPO, env=env, capture_output=True, text=True, timeout=1500)


def test_study_smoke(tmp_path):
    """One regime (`prior`: GRPO, CoPE and ECHO, tuned then tested, 12 runs); a second regime would rerun the same
    code (the per-size arithmetic is test_study_report's, a regime with no tuning run the SmolLM2 smoke's)."""
    out = tmp_path / "study"
    proc = _study(out, "prior")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((out / "study.json").read_text())
    assert set(report["meta"]["choice"]) == {"prior/grpo", "prior/cope", "prior/echo"}
    test = report["test"]
    assert set(test) == {"prior"} and set(test["prior"]) == {"grpo", "cope", "echo"}
    for arm, row in test["prior"].items():
        assert row["seeds"] == [0, 1], arm
        assert len(row["runs"]["0"]["success"]) == 3  # the warm start and two validations
    assert row["delta_auc"][3] == 2  # paired over both seeds
    # the auxiliary arms logged their gradient cosine with the policy gradient on the sampled steps (every 4th)
    for arm, key in (("cope", "grad/cos_forecast_pg"), ("echo", "grad/cos_echo_pg")):
        run = out / "prior/test" / arm / test["prior"][arm]["setting"] / "seed0"
        with (run / "csv/metrics.csv").open() as f:
            rows = list(csv.DictReader(f))
        steps = {r["step"] for r in rows if r.get("loss/pg")}
        cos = [float(r[key]) for r in rows if r.get(key)]
        assert steps and len(cos) == (len(steps) + 3) // 4 and all(-1.0 <= v <= 1.0 for v in cos), run
    text = (out / "study.md").read_text()
    assert "## prior:" in text and "Δ AUC vs GRPO" in text and "Tuning" in text
    assert re.search(r"Wall time of the finished runs: [1-9]\d* tuning \+ 6 test runs", text)  # 3 arms x 2 seeds
    sized = report["by_size"]["prior"]  # from the runs' csv/val_episodes files
    assert sized and all(row["n"] == 2 for arms in sized.values() for row in arms.values())
    assert "Per maze size" in text
    assert (out / "success_vs_episodes.png").stat().st_size > 0 and (out / "mechanism.png").stat().st_size > 0
    again = _study(out, "prior")  # resumable: everything is reused
    assert again.returncode == 0 and "(reused)" in again.stdout and "(ok)" not in again.stdout


def test_study_smoke_smollm2(tmp_path):
    """The SmolLM2 regime (study4) in miniature with the real model: one setting per arm (no tuning run), one
    seed, one epoch; the CoPE arms get cope.mask_projected=false, the report has the answer forms and the
    launcher prints each CoPE run's early forecast samples; each test run's last checkpoint is evaluated by
    eval.py (on 1 task in the smoke) and the evaluation is recorded and reported."""
    from smollm2_fixtures import smollm2_folder

    smollm2_folder()  # converted once in this session's COPE_CACHE, which the train.py runs inherit
    out = tmp_path / "study"
    proc = _study(out, "smollm2")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((out / "study.json").read_text())
    assert report["meta"]["regimes"]["smollm2"]["arm_overrides"]["cope_turns"] == ["cope.mask_projected=false"]
    assert not (out / "smollm2/tune").exists()  # a 1-setting search runs no tuning job
    test = report["test"]["smollm2"]
    assert set(test) == {"grpo", "cope_authors", "cope_turns", "echo"} and all(row["seeds"] == [0] for row in test.values())
    final = report["final"]["smollm2"]
    assert set(final) == set(test) and all(row["seeds"] == [0] and row["tasks"] == [1] for row in final.values())
    for arm, row in test.items():
        run = Path("smollm2/test") / arm / row["setting"] / "seed0"
        summary = json.loads((out / run / "eval1/summary.json").read_text())
        assert summary["complete"] and summary["tasks"] == 1 and 0.0 <= summary["success"] <= 1.0, arm
        kept = json.loads((out / "records" / run / "record.json").read_text())["files"]
        assert {"eval1/summary.json", "eval1/episodes.csv"} <= set(kept), arm
    for arm in ("cope_authors", "cope_turns"):
        run = out / "smollm2/test" / arm / test[arm]["setting"] / "seed0"
        cfg = (run / ".hydra/config.yaml").read_text()
        assert "mask_projected: false" in cfg and "smollm2" in cfg, arm
        assert f"test {arm} " in proc.stdout and "forecast samples" in proc.stdout.split(f"test {arm} ")[1].splitlines()[0]
    text = (out / "study.md").read_text()
    assert test["grpo"]["val/projected_actions"] is not None and "projected answers" in text
    assert "| CoPE (authors', turns) | CoPE (authors') |" in text  # the two layouts against each other
    assert "| ECHO | CoPE (authors') |" in text and "Final evaluation" in text and "Smallest effect" not in text  # 1 seed


def test_study_smoke_baselines(tmp_path):
    """The papers' comparison set (`baselines`: RWML+GRPO, WM-SFT, expert SFT, ECHO) in miniature, tiny model: one setting per arm,
    one seed; GRPO on SFT trains from its prerequisite SFT run's adapter (relative path, so its record names no
    machine), the report has every arm and the share of the SFT gain line; a second call reuses everything."""
    out = tmp_path / "study"
    proc = _study(out, "baselines_tiny")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((out / "study.json").read_text())
    test = report["test"]["baselines_tiny"]
    assert set(test) == {"grpo", "rwml_grpo", "wm_sft", "echo", "grpo_sft"} and all(r["seeds"] == [0] for r in test.values())
    pre = out / "baselines_tiny/pre/sft/expert/seed0"
    assert (pre / "done").exists() and (pre / "csv/adapter/adapter_model.safetensors").exists()
    run = out / "baselines_tiny/test/grpo_sft" / test["grpo_sft"]["setting"] / "seed0"
    overrides = (run / ".hydra/overrides.yaml").read_text()
    assert "model.adapter=" in overrides and "pre/sft/expert/seed0/csv/adapter" in overrides
    rwml = out / "baselines_tiny/test/rwml_grpo" / test["rwml_grpo"]["setting"] / "seed0"
    with (rwml / "csv/metrics.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert any(r.get("rwml/triplets") for r in rows), "the RWML stage logged no triplets"
    md = (out / "study.md").read_text()
    assert "Share of the SFT gain ECHO recovers" in md
    # what the auxiliary stages trained on: RWML's row (WM-SFT's only where its steps had samples: the cold micro
    # model's actions are all malformed here, no observation comes back)
    aux = report["aux_signal"]["baselines_tiny"]
    assert "rwml_grpo" in aux and set(aux) <= {"rwml_grpo", "wm_sft"} and aux["rwml_grpo"]["rwml_epochs"] == 1
    assert aux["rwml_grpo"]["rwml_copy_reward"] is not None
    assert "What the auxiliary stages had to train on" in md
    again = _study(out, "baselines_tiny")
    assert again.returncode == 0 and "(ok)" not in again.stdout, again.stdout[-2000:]


def test_study_smoke_branching(tmp_path):
    """The branched rollouts' learning bench (`branching`) in miniature: flat GRPO and the branched arm (`+collector=branching`),
    one seed; the branched run logged its trees' cost, and the report compares the arms at equal env steps and at equal
    generated tokens (its tables and its figure)."""
    out = tmp_path / "study"
    proc = _study(out, "branching")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((out / "study.json").read_text())
    assert set(report["test"]["branching"]) == {"grpo", "grpo_branch"}
    run = out / "branching/test/grpo_branch/roots2/seed0"
    with (run / "csv/metrics.csv").open() as f:
        rows = [r for r in csv.DictReader(f) if r.get("rollout/branch_env_steps")]
    assert rows and all(float(r["rollout/branch_env_steps"]) < float(r["rollout/branch_flat_env_steps_est"]) for r in rows)
    steps, tokens = report["equal_steps"]["branching"]  # at equal env steps, then at equal generated tokens
    assert steps["key"] == "env_steps" and tokens["key"] == "generated_tokens"
    for equal in (steps, tokens):
        assert list(equal["budget"]) == ["0"] and equal["arms"]["grpo_branch"]["steps_ratio"] < 1.0
    text = (out / "study.md").read_text()
    assert "Held-out success at equal env steps" in text and "Held-out success at equal generated tokens" in text
    assert (out / "success_vs_env_steps.png").stat().st_size > 0
