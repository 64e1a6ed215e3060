"""The default demo, seed 4, keeps its action format (the demo's collapse; a regression test for that seed, not a proof that no
seed collapses: bench/results/demo_seeds/README.md has the 5-seed record).

Without the epoch's trust region (``module.max_approx_kl=null``, the default before it) seed 4 of ``make train``
(2 threads) collapsed at epoch 29: one epoch's steps moved the policy by an approximate KL of 0.60, 1.54 and 2.02
from its sampler, the end-of-turn probability after a move fell 0.87 -> 0.18 -> 0.07, and from epoch 30 on
96% of the rollouts' actions were invalid multi-move answers (``westnorthnorth...``). This runs the default through
the real entry point just past that point (32 epochs, the same seed and thread count) and checks the format is
intact: no epoch's rollouts all invalid, the held-out panel still stops after its moves and
does not answer with several, and it still solves mazes. About 5 minutes on 2 idle cores (the warm start is built
first, in the test's own cache), over 20 under load: it is marked `learning`, left out of CI's budget, and run with
`make test-learning`. On another machine the fp32 reduction order gives another trajectory, so CI would check a
different path anyway; the 5-seed record is bench/results/demo_seeds."""
from __future__ import annotations

import pytest

pytestmark = pytest.mark.learning  # not in CI: `make test-learning`

EPOCHS, SEED = 32, 4


def test_default_demo_does_not_collapse_into_multi_move_answers(train_script, read_metrics, tmp_path):
    run_dir = tmp_path / "run"
    proc = train_script([f"hydra.run.dir={run_dir}", f"seed={SEED}", "data.progress=false", f"trainer.max_epochs={EPOCHS}",
                         "callbacks.run_health.invalid_epochs=null"], tmp_path,  # a collapse fails the asserts, not the run
                        timeout=2400, env={"OMP_NUM_THREADS": "2", "MKL_NUM_THREADS": "2"})
    report = f"exit {proc.returncode}\n--- stdout ---\n{proc.stdout[-2000:]}\n--- stderr ---\n{proc.stderr[-4000:]}"
    assert proc.returncode == 0, report
    cols = read_metrics(run_dir / "csv" / "metrics.csv")
    assert len(cols["rollout/invalid_rate"]) == EPOCHS, report
    # the trust region is on by default (here it dropped 5 policy steps in epochs 26-27, where the run without it left the
    # rails; another machine's fp32 reduction order gives another trajectory, so whether it acts is not asserted)
    assert len(cols.get("train/kl_stopped", [])) == 4 * EPOCHS, "the trust region is off: module.max_approx_kl's default changed?"
    assert max(cols["rollout/invalid_rate"]) < 0.9, cols["rollout/invalid_rate"]
    assert max(cols["rollout/multi_action"]) < 0.2, cols["rollout/multi_action"]
    assert min(cols["stop/prob"]) > 0.5, cols["stop/prob"]
    # the held-out panel after the last epoch (and at every validation before it)
    assert min(cols["stop/prob_val"]) > 0.5, cols["stop/prob_val"]
    assert max(cols["val/multi_action"]) < 0.2, cols["val/multi_action"]
    assert max(cols["val/invalid_rate"]) < 0.9, cols["val/invalid_rate"]
    assert cols["val/success"][-1] > 0.0, cols["val/success"]
