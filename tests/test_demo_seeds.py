"""bench.demo_seeds rebuilds its report from the committed run records alone (a fresh checkout, no training):
the records restore into an empty output folder and give the per-seed table of bench/results/demo_seeds/README.md."""
from __future__ import annotations

from pathlib import Path

import pytest

from bench import demo_seeds

BENCH = Path(__file__).resolve().parents[1] / "bench"

# name: (overrides, seeds, collapsed, final held-out success), as the committed records give them
RECORDED = {
    "default": ([], [0, 1, 2, 3, 4], [False] * 5, [0.219, 0.375, 0.438, 0.406, 0.422]),
    "no_trust_region": (["module.max_approx_kl=null"], [0, 1, 2, 3, 4], [False] * 4 + [True], [0.266, 0.328, 0.328, 0.328, 0.0]),
    "share_prefix": (["data.share_prefix=true"], [0, 1, 2, 3, 4], [False] * 5, [0.375, 0.391, 0.156, 0.0, 0.219]),
    "lag1": (["data.max_lag=1"], [0, 1, 2, 3, 4], [False] * 4 + [True], [0.281, 0.094, 0.312, 0.375, 0.0]),
    "lag1_wkl": (["data.max_lag=1"], [0, 1, 2, 3, 4], [False] * 5, [0.078, 0.297, 0.312, 0.469, 0.453]),
    "lag2_wkl": (["data.max_lag=2"], [0, 1, 2, 3, 4], [False] * 5, [0.156, 0.359, 0.297, 0.344, 0.172]),
}


@pytest.mark.parametrize("name", sorted(RECORDED))
def test_report_from_the_committed_records(tmp_path, name):
    overrides, seeds, collapsed, finals = RECORDED[name]
    results = tmp_path / "results"
    results.mkdir()
    (results / "runs").symlink_to(BENCH / "results" / "demo_seeds" / "runs")
    rows = demo_seeds.main(["--report", "--name", name, "--seeds", *map(str, seeds), "--overrides", *overrides,
                            "--out", str(tmp_path / "out"), "--results", str(results)])
    assert [r["seed"] for r in rows] == seeds
    assert [r["collapsed"] for r in rows] == collapsed
    assert [round(r["final_success"], 3) for r in rows] == finals
    assert all(r["start_success"] == 0.03125 for r in rows)
    text = (results / f"{name}.md").read_text()
    assert f"collapsed: {sum(collapsed)} of {len(seeds)}" in text and (results / f"{name}.png").stat().st_size > 0
    assert text == (BENCH / "results" / "demo_seeds" / f"{name}.md").read_text()  # the committed report is this one
