"""The study's final evaluation (bench.study.final_eval): the launcher evaluates each test run's last checkpoint and
records it, the report's table and paired differences from hand-made evaluations (seeds without one named with the
reason), ECHO against CoPE (authors', list) in the regime's tables, and the committed study4 records restore under
this launcher (its jobs' overrides are the ones that made them)."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from bench.study import final_eval
from bench.study import launch as study
from bench.study import runs as sample_efficiency
from bench.study.markdown import NAMES, markdown
from bench.study.report import summarize

REPO = Path(__file__).resolve().parents[1]
FAKE_TRAIN = '''import sys
from pathlib import Path
run = Path(next(a.split("=", 1)[1] for a in sys.argv if a.startswith("hydra.run.dir=")))
(run / "csv").mkdir(parents=True)
(run / "csv/learning_curve.csv").write_text("epoch,episodes,val_success\\n0,8,0.5\\n")
(run / "csv/learning_curve_train.csv").write_text("epoch,episodes\\n0,8\\n")
(run / "checkpoints").mkdir()
(run / "checkpoints/last.ckpt").write_text("big, not recorded")
'''
FAKE_EVAL = '''import json, sys
from pathlib import Path
args = dict(a.split("=", 1) for a in sys.argv[1:] if "=" in a)
out = Path(args["eval.out"])
out.mkdir(parents=True, exist_ok=True)
with (out.parents[6] / "evals.jsonl").open("a") as f:
    f.write(json.dumps(sys.argv[1:]) + "\\n")
n = int(args["eval.count"])
(out / "episodes.csv").write_text("index,success\\n" + "".join(f"{i},{i % 2}\\n" for i in range(n)))
(out / "summary.json").write_text(json.dumps({"tasks": n, "complete": True, "success": 0.5, "success_ci95": [0, 1]}))
'''


def test_the_launcher_evaluates_each_test_run_and_records_it(tmp_path, monkeypatch):
    (tmp_path / "train.py").write_text(FAKE_TRAIN)
    (tmp_path / "eval.py").write_text(FAKE_EVAL)
    monkeypatch.setattr(sample_efficiency, "REPO", tmp_path)
    monkeypatch.setattr(study, "REPO", tmp_path)
    ov = ("trainer.max_epochs=1", "data.val_batch_size=32", "data.val_batch_size=4")
    jobs = [study.Job("smollm2", "test", "echo", "lam", s, ov, final_eval=2) for s in (0, 1)]
    jobs.append(study.Job("smollm2", "tune", "echo", "lam", 100, ov))  # final_eval 0: not evaluated
    out, records = tmp_path / "out", tmp_path / "records"
    assert [r["rc"] for r in study.run_jobs(jobs, out, 2, 1, records)] == [0, 0, 0]
    calls = [json.loads(line) for line in (tmp_path / "evals.jsonl").read_text().splitlines()]
    assert len(calls) == 2
    run = jobs[0].dir(out)
    call = next(c for c in calls if "seed=0" in c)
    assert call[:2] == ["algo=echo", "seed=0"] and call[2:5] == list(ov)
    for arg in (f"ckpt_path={run}/checkpoints/last.ckpt", "eval.count=2", "eval.temperature=0", "eval.batch_size=4",
                "eval.split=test", "eval.start=0", f"eval.out={run}/eval2"):
        assert arg in call, arg
    manifest = json.loads((jobs[0].dir(records) / "record.json").read_text())
    assert {"eval2/summary.json", "eval2/episodes.csv"} <= set(manifest["files"])
    assert not any(n.startswith("eval") for n in json.loads((jobs[2].dir(records) / "record.json").read_text())["files"])

    shutil.rmtree(out)  # a fresh checkout: restored from the records with their evaluation, nothing evaluated again
    assert [r["rc"] for r in study.run_jobs(jobs, out, 2, 1, records)] == [0, 0, 0]
    assert len((tmp_path / "evals.jsonl").read_text().splitlines()) == 2
    assert final_eval.read(jobs[1].dir(out)) == {"tasks": 2, "success": 0.5, "replayed": False}
    shutil.rmtree(jobs[0].dir(out) / "eval2")  # a run restored (by an earlier launch) from a record made before evaluations
    assert [r["rc"] for r in study.run_jobs(jobs, out, 2, 1, records)] == [0, 0, 0]  # its checkpoint is gone: no eval.py
    assert len((tmp_path / "evals.jsonl").read_text().splitlines()) == 2
    assert final_eval.read(jobs[0].dir(out)) == {"reason": final_eval.GONE}


def test_an_evaluation_stopped_before_its_last_task_is_not_recorded(tmp_path, monkeypatch):
    """eval.py stopped by SIGTERM exits 0 with ``complete: false``: the launcher keeps the run unrecorded (a record
    would be restored as final on a fresh checkout, its checkpoint gone) and the next launch finishes the evaluation."""
    (tmp_path / "train.py").write_text(FAKE_TRAIN)
    (tmp_path / "eval.py").write_text(FAKE_EVAL.replace('"complete": True', '"complete": n < 2'))
    monkeypatch.setattr(sample_efficiency, "REPO", tmp_path)
    monkeypatch.setattr(study, "REPO", tmp_path)
    job = study.Job("smollm2", "test", "echo", "lam", 0, ("trainer.max_epochs=1", "data.val_batch_size=4"), final_eval=2)
    out, records = tmp_path / "out", tmp_path / "records"
    assert [r["rc"] for r in study.run_jobs([job], out, 1, 1, records)] == [final_eval.INCOMPLETE]
    assert not (job.dir(records) / "record.json").exists()
    (tmp_path / "eval.py").write_text(FAKE_EVAL)  # the next launch: the evaluation completes, the run is recorded
    assert [r["rc"] for r in study.run_jobs([job], out, 1, 1, records)] == [0]
    assert "eval2/summary.json" in json.loads((job.dir(records) / "record.json").read_text())["files"]


def _run(root: Path, arm: str, seed: int, final: float, success: float | None, restored: bool = True) -> dict:
    """A finished test run: a two-point curve ending at ``final``; an eval256 summary with ``success`` (None: none)."""
    d = root / arm / f"seed{seed}"
    (d / "csv").mkdir(parents=True)
    (d / "csv/learning_curve.csv").write_text(f"epoch,episodes,env_steps,val_success\n-1,0,0,0.0\n11,96,700,{final}\n")
    if success is not None:
        (d / "eval256").mkdir()
        (d / "eval256/summary.json").write_text(json.dumps({"tasks": 256, "complete": True, "success": success}))
    elif restored:
        (d / "restored_from").write_text("records\n")
    return {"rc": 0, "dir": str(d), "job": study.Job("smollm2", "test", arm, "s", seed)}


# per arm and seed: (final success of the curve, greedy success on the 256 tasks or None)
RUNS = {
    "grpo": {0: (0.5, None), 1: (0.5, None), 2: (0.5, None), 3: (0.5, 0.50), 4: (0.5, 0.60)},
    "cope_authors": {0: (0.6, None), 1: (0.6, None), 2: (0.6, None), 3: (0.6, 0.55), 4: (0.6, 0.75)},
    "cope_turns": {3: (0.5, 0.52), 4: (0.5, None)},  # seed 4: trained here, its evaluation did not finish
    "echo": {0: (0.7, 0.40), 1: (0.6, 0.45), 2: (0.7, 0.50), 3: (0.6, 0.60), 4: (0.7, 0.65)},
}


def _meta() -> dict:
    info = {"title": "t", "threshold": 0.4, "overrides": [], "arm_overrides": {}, "tuned_in": None, "by_size": None,
            "budget": [], "panels": {"tune": [], "test": []}, "seeds": {"tune": [100], "test": [0, 1, 2, 3, 4]},
            "final_eval": 256}
    return {"regimes": {"smollm2": info}, "choice": {}, "common": []}


def test_the_final_evaluation_table_and_echo_against_cope(tmp_path):
    results = [_run(tmp_path, arm, s, final, ev, restored=(arm, s) != ("cope_turns", 4))
               for arm, seeds in RUNS.items() for s, (final, ev) in seeds.items()]
    summary = summarize(results, _meta())
    table = summary["final"]["smollm2"]
    assert table["grpo"]["seeds"] == [3, 4] and table["grpo"]["success"][0] == pytest.approx(0.55)
    assert table["grpo"]["missing"] == dict.fromkeys((0, 1, 2), final_eval.GONE)
    assert table["cope_turns"]["missing"] == {4: final_eval.FAILED}
    echo = table["echo"]
    assert echo["seeds"] == [0, 1, 2, 3, 4] and echo["success"][0] == pytest.approx(0.52) and echo["tasks"] == [256]
    mean, lo, hi, pairs = echo["delta_grpo"]  # seeds 3, 4: +0.10, +0.05
    assert pairs == 2 and mean == pytest.approx(0.075) and (lo, hi) == pytest.approx((0.05, 0.10))
    t = echo["delta_grpo_t"]  # 12.706 * sd(0.10, 0.05) / sqrt(2) = 12.706 * 0.025
    assert t[0] == pytest.approx(0.075) and final_eval.half_width(t) == pytest.approx(12.706 * 0.025)
    assert echo["delta_cope_authors"][0] == pytest.approx(-0.025) and echo["delta_cope_authors_t"][3] == 2  # +0.05, -0.10
    assert "delta_cope_authors" not in table["cope_authors"] and "delta_grpo" not in table["grpo"]
    assert table["cope_turns"]["delta_grpo"][3] == 1 and final_eval.half_width(table["cope_turns"]["delta_grpo_t"]) is None

    text = markdown(summary, _meta())
    assert "| ECHO | `s` | 256 | 0, 1, 2, 3, 4 | 0.520 [" in text
    # ECHO: Δ vs GRPO, then Δ vs CoPE (authors')
    assert "| +0.075 [+0.050, +0.100] better (t: no) | -0.025 [-0.100, +0.050] no (t: no) |" in text
    assert ("Not evaluated (checkpoint gone: recorded before the final evaluation existed): GRPO seed 0, GRPO seed 1, "
            "GRPO seed 2, CoPE (authors') seed 0, CoPE (authors') seed 1, CoPE (authors') seed 2;") in text
    assert f"Not evaluated ({final_eval.FAILED}): CoPE (authors', turns) seed 4;" in text
    # one evaluated seed (turns: seed 3 only): its mean and its one pair's difference, without a degenerate interval
    assert ("| CoPE (authors', turns) | `s` | 256 | 3 | 0.520 (1 seed) | +0.020 (1 pair: no interval) | "
            "-0.030 (1 pair: no interval) |") in text
    # the curve's tables: ECHO against GRPO, and against CoPE (authors', list) in the between-arms table (+0.06 on
    # the last validation: 0.1, 0.0, 0.1, 0.0, 0.1 over seeds 0..4)
    assert summary["test"]["smollm2"]["echo"]["delta_final"][0] == pytest.approx(0.16)
    between = next(p for p in summary["between"]["smollm2"] if (p["arm"], p["base"]) == ("echo", "cope_authors"))
    assert between["delta_final"][0] == pytest.approx(0.06) and between["delta_final_t"][3] == 5
    assert "| ECHO | CoPE (authors') | " in text
    half = final_eval.half_width(between["delta_final_t"])  # sd of (0.1, 0, 0.1, 0, 0.1) = 0.0548, t(4) = 2.776
    assert half == pytest.approx(2.776 * 0.054772 / 5 ** 0.5, rel=1e-4)
    assert f"ECHO − CoPE (authors') ±{half:.3f} (5 pairs)" in text
    assert f"final evaluation: CoPE (authors') − GRPO ±{final_eval.half_width(table['cope_authors']['delta_grpo_t']):.3f}" in text


def test_no_final_evaluation_table_without_evaluations(tmp_path):
    results = [_run(tmp_path, arm, s, 0.5, None) for arm in ("grpo", "echo") for s in (0, 1)]
    summary = summarize(results, _meta())
    assert summary["final"] == {} and "Final evaluation" not in markdown(summary, _meta())


def test_the_committed_study4_records_restore_under_this_launcher(tmp_path, monkeypatch):
    """Every committed record of the smollm2 regime is restored by ``--report``: the jobs this launcher plans
    (tuning choice included) have exactly the overrides the records were made with (by the study's own commit). An
    arm whose tuning has not finished yet is left out of the report and named there; the others are reported."""
    records = REPO / "bench/results/study4/runs"
    made = sorted(p.parent.relative_to(records) for p in (records / "smollm2").glob("*/*/*/seed*/record.json"))
    if not made:
        pytest.skip("no study4 records in this checkout")
    arms = [a for a in study.SPEC["smollm2"].arms if (records / "smollm2/tune" / a).is_dir()]  # a tuned arm's runs
    out = tmp_path / "out"
    monkeypatch.setattr(study, "stop_on_sigterm", lambda: None)  # pytest keeps its own signal handlers
    rc = study.main(["--report", "--regimes", "smollm2", "--out", str(out), "--records", str(records),
                     "--results", str(tmp_path / "results")])
    expected = [p for p in made if p.parts[2] in arms]
    restored = [p for p in expected if (out / p / "restored_from").exists()]
    assert restored == expected and len(expected) >= 15  # study4's 6 tuning + 9 test runs at least
    text = (tmp_path / "results/study.md").read_text()
    untuned = [a for a in study.SPEC["smollm2"].arms if a not in arms]
    for arm in untuned:
        assert f"- {NAMES[arm]}: no finished tuning run yet, so the arm is not reported" in text
    assert rc == 1 or not untuned  # an arm left out is a report with a run missing


def test_an_incomplete_evaluation_is_named_not_counted(tmp_path):
    (tmp_path / "eval256").mkdir()
    (tmp_path / "eval256/summary.json").write_text(json.dumps({"tasks": 100, "complete": False, "success": 0.9}))
    assert final_eval.read(tmp_path) == {"reason": "evaluation incomplete: 100 of 256 tasks, see the run's eval.log"}
    (tmp_path / "eval8").mkdir()  # a complete smaller one is read
    (tmp_path / "eval8/summary.json").write_text(json.dumps({"tasks": 8, "complete": True, "success": 0.25}))
    assert final_eval.read(tmp_path) == {"tasks": 8, "success": 0.25, "replayed": False}
