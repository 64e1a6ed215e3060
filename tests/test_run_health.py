"""Runs that train on nothing stop, with the cause: every episode aborted, no reward spread for many epochs, and
optimizer steps whose gradient norm is not finite (one is skipped and counted, several in a row stop the run)."""
from __future__ import annotations

import pytest
import torch

from cope.callbacks.run_health import RunHealth, RunStalled

POISON = "+algo.objectives.poison._target_=poison.PoisonLoss"


def test_bad_rule_values_name_the_key():
    with pytest.raises(ValueError, match="callbacks.run_health.max_aborted_frac"):
        RunHealth(max_aborted_frac=1.5)
    with pytest.raises(ValueError, match="callbacks.run_health.zero_signal_epochs"):
        RunHealth(zero_signal_epochs=0)


@pytest.mark.long
def test_a_broken_env_stops_the_run(run_train, read_metrics, tmp_path):
    """Every reset raises (a worker-side env error): every episode aborts; two such epochs stop the run."""
    overrides = ["env=maze_chaos", "env.error_prob=1.0", "env.crash_prob=0", "env.hang_prob=0", "env.points=[reset]",
                 "data.env_runtime.workers=1", "callbacks.run_health.aborted_epochs=2", "trainer.max_epochs=5",
                 "validate_before_fit=false"]
    with pytest.raises(RunStalled, match=r"2 epochs in a row had more than 50% .*callbacks\.run_health\.aborted_epochs"):
        run_train(overrides, tmp_path)
    cols = read_metrics(tmp_path / "csv" / "metrics.csv")
    assert cols["health/aborted_frac"][:1] == [1.0] and cols["health/aborted_streak"][:1] == [1.0]  # logged before it stopped


@pytest.mark.long
def test_no_reward_spread_stops_the_run(run_train, tmp_path):
    """One episode per group: every group-relative advantage is 0, so the policy gradient is 0 in every epoch."""
    overrides = ["data.group_size=1", "data.minibatch_size=2", "callbacks.run_health.zero_signal_epochs=2",
                 "trainer.max_epochs=4", "validate_before_fit=false"]
    with pytest.raises(RunStalled, match=r"2 epochs in a row without one group whose rewards differ"):
        run_train(overrides, tmp_path)
    # and off means off
    run_train([*overrides[:-3], "callbacks.run_health.zero_signal_epochs=null", "trainer.max_epochs=3",
               "validate_before_fit=false"], tmp_path / "off")


@pytest.mark.long
def test_one_nonfinite_step_is_skipped_and_counted(run_train, read_metrics, tmp_path):
    from safetensors.torch import load_file

    run_train([POISON, "+algo.objectives.poison.bad_calls=[0]", "data.minibatch_size=4", "trainer.max_epochs=1",
               "validate_before_fit=false", "callbacks.adapter_export.every_n_epochs=1"], tmp_path)  # 2 steps: the first NaN
    cols = read_metrics(tmp_path / "csv" / "metrics.csv")
    assert cols["train/skipped_steps"] == [1.0, 1.0]
    assert not torch.isfinite(torch.tensor(cols["train/grad_norm"][0])) and torch.isfinite(torch.tensor(cols["train/grad_norm"][1]))
    adapter = load_file(tmp_path / "csv" / "adapter" / "adapter_model.safetensors")
    assert all(torch.isfinite(t).all() for t in adapter.values())  # no NaN reached the weights
    ckpt = torch.load(tmp_path / "checkpoints" / "last.ckpt", weights_only=False)
    assert ckpt["skipped_steps"] == 1 and ckpt["global_step"] == 1  # the skipped step is no optimizer step


@pytest.mark.long
def test_nonfinite_steps_in_a_row_stop_the_run(run_train, tmp_path):
    with pytest.raises(FloatingPointError, match=r"3 optimizer steps in a row .*module\.max_nonfinite_steps"):
        run_train([POISON, "data.minibatch_size=2", "trainer.max_epochs=1", "validate_before_fit=false"], tmp_path)
