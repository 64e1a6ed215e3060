"""bench/demo_seeds.py rebuilds its report from the committed run records alone (a fresh checkout, no training):
the records restore into an empty output folder and give the README's per-seed table."""
from __future__ import annotations

import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "bench"
sys.path.insert(0, str(BENCH))

import demo_seeds  # noqa: E402


def test_report_from_the_committed_records(tmp_path):
    results = tmp_path / "results"
    results.mkdir()
    (results / "runs").symlink_to(BENCH / "results" / "demo_seeds" / "runs")
    rows = demo_seeds.main(["--report", "--name", "default", "--out", str(tmp_path / "out"), "--results", str(results)])
    assert [r["seed"] for r in rows] == [0, 1, 2, 3, 4]
    assert [r["collapsed"] for r in rows] == [False, False, False, False, True]
    assert [round(r["final_success"], 3) for r in rows] == [0.266, 0.328, 0.328, 0.328, 0.0]
    assert all(r["start_success"] == 0.03125 for r in rows)
    text = (results / "default.md").read_text()
    assert "collapsed: 1 of 5" in text and (results / "default.png").stat().st_size > 0
    assert text == (BENCH / "results" / "demo_seeds" / "default.md").read_text()  # the committed report is this one
