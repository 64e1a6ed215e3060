"""Scoring and training under the same numerics: with ``trainer.precision=bf16-mixed`` Lightning autocasts
``training_step`` only, and the scoring pass (old and reference log-probs, at the epoch's start) ran outside it,
in fp32: the first PPO ratio of every epoch was then not 1 (bf16 noise read as a policy change, clipped as one).
The module now scores under the precision plugin's training context too (CPU bf16 autocast here)."""
from __future__ import annotations

import pytest


@pytest.mark.long
@pytest.mark.parametrize("share", [[], ["data.share_prefix=true"]], ids=["rows", "groups_shared"])
def test_bf16_mixed_first_step_has_ratio_one(run_train, read_metrics, tmp_path, share):
    """Also with each group's prefix shared (tree attention in bf16, in the scoring pass and the step alike)."""
    run_train(["trainer.precision=bf16-mixed", "trainer.max_epochs=2", "validate_before_fit=false",
               "data.minibatch_size=8", "data.tasks_per_epoch=2", "data.group_size=4", *share], tmp_path)  # one step per epoch
    cols = read_metrics(tmp_path / "csv" / "metrics.csv")
    assert len(cols["policy/ratio_mean"]) == 2
    assert cols["policy/ratio_mean"] == [1.0, 1.0]  # every epoch's first (here: only) step
    assert cols["policy/clip_frac"] == [0.0, 0.0] and cols["policy/approx_kl"] == [0.0, 0.0]
    if share:
        assert all(f > 0 for f in cols["data/shared_fraction"])  # the groups really were packed
