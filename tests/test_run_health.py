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


def test_the_guard_drops_a_zero_gradient_step_only_when_asked():
    from cope.train.step.guard import StepGuard

    off, on = StepGuard(3), StepGuard(3, skip_zero=True)
    assert off.allow(torch.tensor(0.0), 0) and off.zero_skipped == 0
    assert not on.allow(torch.tensor(0.0), 0) and on.allow(torch.tensor(1e-12), 1) and on.zero_skipped == 1
    assert not on.allow(torch.tensor(float("nan")), 2) and (on.skipped, on.in_a_row, on.zero_skipped) == (1, 1, 1)
    assert not on.allow(torch.tensor(0.0), 3) and on.in_a_row == 0  # a zero step is no non-finite one: the streak ends


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
    # a run with no objective that reads the advantages (ECHO alone) has no signal to lose: the rule does not apply
    run_train([*overrides[:-2], "algo=echo_only", "trainer.max_epochs=3", "validate_before_fit=false"], tmp_path / "echo")


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


# -- the collapse rule: a policy that answers well, then garbage ---------------------------------------------------
class _Answering:
    """A policy that answers an open move (``answer="move"``: the first admissible action) or a fixed text."""

    def __init__(self, tok, chat, answer: str):
        self.tok, self.chat, self.answer = tok, chat, answer

    def __call__(self, contexts, admissible, keys):
        texts = [a[0] if self.answer == "move" else self.answer for a in admissible]
        return [self.tok(t, add_special_tokens=False)["input_ids"] + [self.chat.stop_id] for t in texts]

    def fork(self):
        return self


def _epoch(epoch: int, answer: str):
    """A real epoch record: 4 maze episodes of a policy that answers ``answer`` (see :class:`_Answering`)."""
    from tiny_fixtures import maze_factory, tiny_chat, tiny_tokenizer

    from cope.envs.base import Task
    from cope.records import EpochRecord
    from cope.rollout.loop import run_episodes

    tok, chat = tiny_tokenizer(), tiny_chat()
    tasks = [Task("maze", "train", i) for i in range(4)]
    eps, _ = run_episodes([maze_factory() for _ in tasks], tasks, [0, 0, 1, 1], _Answering(tok, chat, answer), tok, chat,
                          1024, 8)
    return EpochRecord(epoch=epoch, episodes=eps, minibatches=[], metrics={}, counters={})


class _Trainer:
    def __init__(self):
        self.world_size, self.record = 1, None

    @property
    def datamodule(self):
        return self


class _Module:
    def __init__(self):
        self.logged = []

    def log_dict(self, d, **kw):
        self.logged.append(d)


def _feed(cb: RunHealth, answers: list[str]) -> _Module:
    trainer, module = _Trainer(), _Module()
    for epoch, answer in enumerate(answers):
        trainer.train_record = _epoch(epoch, answer)
        cb.on_train_epoch_start(trainer, module)
    return module


def test_collapsed_actions_stop_the_run_after_the_format_was_learned():
    from pathlib import Path

    from omegaconf import OmegaConf

    config = Path(__file__).resolve().parents[1] / "conf" / "config.yaml"
    assert RunHealth().invalid_epochs == 3 == OmegaConf.load(config).callbacks.run_health.invalid_epochs  # on
    cb = RunHealth()
    # an open move is always valid; "northnorth" (two moves in one answer) never is
    with pytest.raises(RunStalled, match=r"actions collapsed: 3 epochs in a row had more than 90% .* after epoch 0 .*"
                                         r"callbacks\.run_health\.invalid_epochs"):
        _feed(cb, ["move", "move", "northnorth", "northnorth", "northnorth", "move"])
    assert (cb.format_learned, cb.invalid_streak) == (0, 3)


def test_a_cold_start_does_not_trigger_it_and_the_streak_resets():
    cb = RunHealth(invalid_epochs=3)
    module = _feed(cb, ["jump", "jump", "jump", "jump", "move", "northnorth", "northnorth", "move", "northnorth"])
    rates = [d["health/invalid_rate"] for d in module.logged]
    assert rates == [1.0] * 4 + [0.0, 1.0, 1.0, 0.0, 1.0]  # four garbage epochs before the format: not a collapse
    assert [d["health/format_learned"] for d in module.logged] == [0.0] * 4 + [1.0] * 5
    assert [d["health/invalid_streak"] for d in module.logged] == [0, 0, 0, 0, 0, 1, 2, 0, 1]
    # kept in checkpoints: a resumed run goes on counting
    again = RunHealth(invalid_epochs=3)
    again.load_state_dict(cb.state_dict())
    assert (again.format_learned, again.invalid_streak) == (4, 1)
    with pytest.raises(RunStalled, match="actions collapsed"):
        _feed(again, ["northnorth", "northnorth"])
    with pytest.raises(ValueError, match="callbacks.run_health.healthy_invalid_rate"):
        RunHealth(max_invalid_rate=0.5, healthy_invalid_rate=0.6)


@pytest.mark.long
def test_a_zero_gradient_step_moves_nothing_with_skip_zero_grad_steps(run_train, read_metrics, tmp_path):
    """One real step, then steps whose gradient is exactly 0: AdamW still moves the weights on them (its momentum),
    unless ``module.skip_zero_grad_steps`` drops them; the dropped steps are counted, checkpointed (a resume goes on
    counting), and no step."""
    from safetensors.torch import load_file

    base = ["data.group_size=1", "data.tasks_per_epoch=4", "data.minibatch_size=1", "trainer.max_epochs=1",
            "validate_before_fit=false", "module.max_approx_kl=null", "callbacks.run_health.zero_signal_epochs=null",
            "callbacks.adapter_export.every_n_epochs=1", "+algo.objectives.pulse._target_=poison.PulseLoss",
            "+algo.objectives.pulse.good_calls=[0]"]
    run_train([*base, "module.skip_zero_grad_steps=true"], tmp_path / "on")
    run_train(base, tmp_path / "off")
    on = read_metrics(tmp_path / "on" / "csv" / "metrics.csv")
    norms = on["train/grad_norm"]
    assert len(norms) == 4 and norms[0] > 0 and norms[1:] == [0.0, 0.0, 0.0], norms  # the premise: one pulse, then none
    assert on["train/zero_grad_steps"] == [0.0, 1.0, 2.0, 3.0] and on["train/skipped_steps"] == [0.0] * 4
    ckpt = torch.load(tmp_path / "on" / "checkpoints" / "last.ckpt", weights_only=False)
    assert ckpt["global_step"] == 1 and ckpt["zero_grad_steps"] == 3  # only the pulse was an optimizer step
    off_ckpt = torch.load(tmp_path / "off" / "checkpoints" / "last.ckpt", weights_only=False)
    assert off_ckpt["global_step"] == 4 and "train/zero_grad_steps" not in read_metrics(tmp_path / "off" / "csv" / "metrics.csv")
    a = load_file(tmp_path / "on" / "csv" / "adapter" / "adapter_model.safetensors")
    b = load_file(tmp_path / "off" / "csv" / "adapter" / "adapter_model.safetensors")
    # off: the three zero-gradient steps moved the weights on (AdamW's first moment); on: they stayed the pulse's
    assert max(float((a[k] - b[k]).abs().max()) for k in a) > 1e-4
    # resumed for a second epoch (the pulse objective is rebuilt: one real step again, then three without signal), the
    # count goes on from the checkpoint's
    run_train([*base[:3], "trainer.max_epochs=2", *base[4:], "module.skip_zero_grad_steps=true", "ckpt_path=last"],
              tmp_path / "on")
    resumed = read_metrics(tmp_path / "on" / "csv" / "metrics.csv")["train/zero_grad_steps"]
    assert resumed == [0.0, 1.0, 2.0, 3.0, 3.0, 4.0, 5.0, 6.0], resumed
    ckpt = torch.load(tmp_path / "on" / "checkpoints" / "last.ckpt", weights_only=False)
    assert ckpt["global_step"] == 2 and ckpt["zero_grad_steps"] == 6
