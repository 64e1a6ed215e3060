"""module.max_approx_kl: once a minibatch measures the policy further than the limit from the one that sampled the
epoch, that policy step and the epoch's later ones are not taken; the next epoch starts afresh (its first step always
runs: its rollouts come from the policy as it is). CoPE's separate forecast steps are not policy-gradient steps and run."""
from __future__ import annotations

import pytest
import torch

from cope.run.config_check import ConfigError


def test_a_bad_limit_names_the_key(compose, tmp_path):
    from cope.run.train import train

    with pytest.raises((ConfigError, ValueError), match=r"module\.max_approx_kl"):
        train(compose(["module.max_approx_kl=0", "trainer.max_epochs=1", "validate_before_fit=false"], tmp_path))


@pytest.mark.long
def test_steps_past_the_limit_are_not_taken_and_every_epoch_starts_afresh(run_train, read_metrics, tmp_path):
    limit, steps_per_epoch = 1e-4, 4
    overrides = [f"module.max_approx_kl={limit}", "data.tasks_per_epoch=4", "data.minibatch_size=4", "trainer.max_epochs=3",
                 "validate_before_fit=false", "module.optimizer.lr=1e-2",
                 "model.warm_start_steps=150", "env.sizes=[5]", "env.min_distance=1"]  # a reward spread: the policy moves
    run_train(overrides, tmp_path / "on")
    cols = read_metrics(tmp_path / "on" / "csv" / "metrics.csv")
    kl, stopped = cols["policy/approx_kl"], cols["train/kl_stopped"]
    assert len(kl) == len(stopped) == 3 * steps_per_epoch
    expected, taken = [], 0
    for e in range(3):
        epoch_kl = kl[e * steps_per_epoch:(e + 1) * steps_per_epoch]
        assert epoch_kl[0] < limit  # an epoch's first step: the policy is the rollouts' (its KL is 0 up to rounding)
        first = next((i for i, v in enumerate(epoch_kl) if v > limit), steps_per_epoch)
        expected += [0.0] * first + [1.0] * (steps_per_epoch - first)
        taken += first
    assert stopped == expected, (kl, stopped)
    assert 0 < sum(expected) and 0.0 in expected[steps_per_epoch:], "the premise: the limit stopped steps and an epoch after it stepped"
    assert cols["train/kl_stopped_steps"][-1] == sum(expected)
    ckpt = torch.load(tmp_path / "on" / "checkpoints" / "last.ckpt", weights_only=False)
    assert ckpt["global_step"] == taken and ckpt["kl_stopped_steps"] == sum(expected)  # a stopped step is no optimizer step
    # CoPE's separate forecast steps (no importance ratio) still run after a trip: every one of them is an optimizer step
    run_train(["algo=cope", *overrides], tmp_path / "cope")
    cope = read_metrics(tmp_path / "cope" / "csv" / "metrics.csv")
    forecast_steps, policy_taken = len(cope["forecast/grad_norm"]), cope["train/kl_stopped"].count(0.0)
    assert forecast_steps > 0 and 1.0 in cope["train/kl_stopped"], cope["train/kl_stopped"]
    assert torch.load(tmp_path / "cope" / "checkpoints" / "last.ckpt", weights_only=False)["global_step"] == policy_taken + forecast_steps
