"""bench/study.py end to end in miniature (--smoke): tuning picks a setting per arm, the test runs are
paired by seed, the report has every regime's table, the plots exist, and a second call reuses every run."""
from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow


def _study(out: Path, *regimes: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, str(REPO / "bench/study.py"), "--smoke", "--jobs", "2", "--out", str(out),
                           "--regimes", *regimes], cwd=REPO, env=env, capture_output=True, text=True, timeout=1500)


def test_study_smoke(tmp_path):
    out = tmp_path / "study"
    proc = _study(out, "prior", "echo6")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((out / "study.json").read_text())
    assert set(report["meta"]["choice"]) == {"prior/grpo", "prior/cope", "prior/echo"}
    test = report["test"]
    assert set(test) == {"prior", "echo6"} and set(test["echo6"]) == {"grpo", "echo"}
    for arm, row in test["prior"].items():
        assert row["seeds"] == [0, 1], arm
        assert len(row["runs"]["0"]["success"]) == 3  # the warm start and two validations
    assert row["delta_auc"][3] == 2  # paired over both seeds
    # the auxiliary arms logged their gradient cosine with the policy gradient on the sampled steps (every 4th)
    for run, key in ((out / "prior/test/cope" / test["prior"]["cope"]["setting"] / "seed0", "grad/cos_forecast_pg"),
                     (out / "echo6/test/echo" / test["echo6"]["echo"]["setting"] / "seed0", "grad/cos_echo_pg")):
        with (run / "csv/metrics.csv").open() as f:
            rows = list(csv.DictReader(f))
        steps = {r["step"] for r in rows if r.get("loss/pg")}
        cos = [float(r[key]) for r in rows if r.get(key)]
        assert steps and len(cos) == (len(steps) + 3) // 4 and all(-1.0 <= v <= 1.0 for v in cos), run
    text = (out / "study.md").read_text()
    assert "## prior:" in text and "## echo6:" in text and "Δ AUC vs GRPO" in text and "Tuning" in text
    sized = report["by_size"]["prior"]  # from the runs' csv/val_episodes files; echo6 has one size only
    assert sized and all(row["n"] == 2 for arms in sized.values() for row in arms.values())
    assert "Per maze size" in text and "echo6" not in report["by_size"]
    assert (out / "success_vs_episodes.png").stat().st_size > 0 and (out / "mechanism.png").stat().st_size > 0
    again = _study(out, "prior", "echo6")  # resumable: everything is reused
    assert again.returncode == 0 and "(reused)" in again.stdout and "(ok)" not in again.stdout
