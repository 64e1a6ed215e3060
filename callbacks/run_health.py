"""Stop rules for a run that trains on nothing: a broken env or server, or no learning signal for many epochs.

A week of GPU time must not go to a run stepping on empty batches. Before each training epoch's update (the
epoch's experience is collected by then), this callback reads the epoch record and counts, over all ranks:

* ``health/aborted_frac``: the share of the epoch's episodes that were aborted (env crash, worker or server
  failure, timeout: :attr:`cope.episode.Episode.failed`). More than ``max_aborted_frac`` for ``aborted_epochs``
  epochs in a row stops the run. An episode its collector skipped on purpose (``EndReason.SKIPPED``: an SFT
  demonstration too long for the context, failed or not replayable) is no failure: it counts among the episodes only.
* ``health/signal_groups``: GRPO groups with a reward spread (the only groups whose policy gradient is not 0).
  None in ``zero_signal_epochs`` epochs in a row stops the run. Auxiliary objectives may still train then
  (ECHO on observations, CoPE forecasts from all-win groups): a cold start that is meant to wait longer sets a
  larger count, or null. A run with no objective on that reads the advantages (``Objective.reads_advantages``: the
  policy gradient; off in ``algo=sft`` and ``algo=echo_only``) never has a signal to lose: the rule is off there.
* ``health/invalid_rate``: the share of the epoch's steps with an env feedback turn whose action the env refused. A collapse of the action
  format (seen in a demo run: ``westwestwest...`` until the token cap, every action invalid, no reward spread ever again) is
  a regression: once an epoch was at or below ``healthy_invalid_rate`` (``health/format_learned``), the rate above
  ``max_invalid_rate`` for ``invalid_epochs`` epochs in a row stops the run. A cold start (a model that has not
  learned the format yet, e.g. SmolLM2 before its first readable answers) never triggers it.

The streaks are logged every epoch (``health/aborted_streak``, ``health/zero_signal_streak``) before a rule
triggers, and kept in checkpoints (Lightning's callback state), so a resume keeps counting. The stop is a
:class:`RunStalled` error naming the cause and the key that sets the rule; the last checkpoint stays as it was.
Every rank reaches the same decision: the counts are summed over ranks first, so every logged value is global
(shares of the summed counts, streaks of those shares) and is logged as such (:func:`cope.callbacks.pooled.log_global`).
The third rule, skipping an optimizer step whose gradient norm is not finite, lives in the module's step
(``module.max_nonfinite_steps``).
"""
from __future__ import annotations

import logging

import torch
from lightning.pytorch import Callback

from cope.callbacks.pooled import log_global
from cope.records import train_record

log = logging.getLogger(__name__)


class RunStalled(RuntimeError):
    """The run stopped because it would go on training on nothing (the message says why and how to change the rule)."""


def _check(key: str, value, low: float, high: float | None = None, integer: bool = False) -> None:
    bad = value is not None and (isinstance(value, bool) or (integer and not isinstance(value, int))
                                 or value < low or (high is not None and value > high))
    if bad:
        raise ValueError(f"callbacks.run_health.{key} must be null or {'an int' if integer else 'a number'} "
                         f">= {low}{f' and <= {high}' if high is not None else ''}, got {value!r}")


class RunHealth(Callback):
    """Stops a run whose epochs are mostly aborted episodes, that has no learning signal for long, or whose actions
    collapsed.

    Args:
        max_aborted_frac: an epoch with more than this share of aborted episodes counts as broken.
        aborted_epochs: that many broken epochs in a row stop the run (null: never).
        zero_signal_epochs: that many epochs in a row without one group with a reward spread stop the run (null: never).
        max_invalid_rate: an epoch with more than this share of invalid steps counts as collapsed ...
        invalid_epochs: ... and that many collapsed epochs in a row stop the run (null: never) ...
        healthy_invalid_rate: ... once an epoch had at most this share (the format was learned; <= max_invalid_rate).
    """

    def __init__(self, max_aborted_frac: float = 0.5, aborted_epochs: int | None = 3, zero_signal_epochs: int | None = 20,
                 max_invalid_rate: float = 0.9, invalid_epochs: int | None = 3, healthy_invalid_rate: float = 0.5):
        _check("max_aborted_frac", max_aborted_frac, 0.0, 1.0)
        _check("aborted_epochs", aborted_epochs, 1, integer=True)
        _check("zero_signal_epochs", zero_signal_epochs, 1, integer=True)
        _check("max_invalid_rate", max_invalid_rate, 0.0, 1.0)
        _check("invalid_epochs", invalid_epochs, 1, integer=True)
        _check("healthy_invalid_rate", healthy_invalid_rate, 0.0, max_invalid_rate)
        self.max_aborted_frac, self.aborted_epochs, self.zero_signal_epochs = max_aborted_frac, aborted_epochs, zero_signal_epochs
        self.max_invalid_rate, self.invalid_epochs, self.healthy_invalid_rate = max_invalid_rate, invalid_epochs, healthy_invalid_rate
        self.aborted_streak = self.zero_signal_streak = self.invalid_streak = 0
        self.format_learned: int | None = None  # the first epoch whose invalid-action rate was at or below healthy_invalid_rate
        self._seen_epoch: int | None = None

    def _totals(self, trainer, record) -> tuple[float, ...]:
        """(aborted episodes, episodes, groups with a reward spread, invalid steps, steps), summed over ranks."""
        groups: dict[int, set[float]] = {}
        for e in record.episodes:
            if not e.aborted:
                groups.setdefault(e.group, set()).add(float(e.reward))
        # the steps with an env feedback turn in the transcript (obs_start >= 0; a last step whose feedback did not fit
        # the context is left out too): a collector's own one-step episodes (RWML's world-model predictions, always
        # valid, no feedback) would otherwise count as a learned format
        steps = [s for e in record.episodes if not e.aborted for s in e.steps if s.obs_start >= 0]
        local = torch.tensor([sum(e.failed for e in record.episodes), len(record.episodes),
                              sum(len(r) > 1 for r in groups.values()), sum(not s.valid for s in steps), len(steps)],
                             dtype=torch.float64)
        if getattr(trainer, "world_size", 1) > 1:
            local = trainer.strategy.reduce(local.to(trainer.strategy.root_device), reduce_op="sum").cpu()
        return tuple(float(v) for v in local.tolist())

    def on_train_epoch_start(self, trainer, pl_module) -> None:
        record = train_record(trainer)
        if record is None or record.epoch == self._seen_epoch:
            return
        self._seen_epoch = record.epoch
        aborted, episodes, signal, invalid, steps = self._totals(trainer, record)
        frac = aborted / max(episodes, 1.0)
        self.aborted_streak = self.aborted_streak + 1 if frac > self.max_aborted_frac else 0
        objectives = getattr(pl_module, "objectives", None)  # None: not this project's module, the rule stays on
        learns_from_rewards = objectives is None or any(o.reads_advantages and o.ever_on for o in objectives)
        self.zero_signal_streak = self.zero_signal_streak + 1 if signal == 0 and learns_from_rewards else 0
        rate = invalid / steps if steps else 0.0
        if self.format_learned is None and steps and rate <= self.healthy_invalid_rate:
            self.format_learned = record.epoch
        self.invalid_streak = self.invalid_streak + 1 if self.format_learned is not None and rate > self.max_invalid_rate else 0
        log_global(pl_module, {"health/aborted_frac": frac, "health/signal_groups": signal,
                               "health/aborted_streak": float(self.aborted_streak),
                               "health/zero_signal_streak": float(self.zero_signal_streak),
                               "health/invalid_rate": rate, "health/invalid_streak": float(self.invalid_streak),
                               "health/format_learned": float(self.format_learned is not None)})
        if self.aborted_epochs is not None and self.aborted_streak >= self.aborted_epochs:
            self._stop(f"{self.aborted_streak} epochs in a row had more than {self.max_aborted_frac:.0%} of their episodes "
                       f"aborted (this epoch {int(aborted)} of {int(episodes)}): the env, its workers or the rollout server "
                       "keep failing (see the env/* metrics and the log above). Set callbacks.run_health.aborted_epochs "
                       "(null: never stop) or callbacks.run_health.max_aborted_frac to change the rule")
        if self.zero_signal_epochs is not None and self.zero_signal_streak >= self.zero_signal_epochs:
            self._stop(f"{self.zero_signal_streak} epochs in a row without one group whose rewards differ: the policy "
                       "gradient is 0 (every episode fails, or every one succeeds). Set callbacks.run_health.zero_signal_epochs "
                       "(null: never stop) to wait longer, e.g. for auxiliary objectives in a cold start")
        if self.invalid_epochs is not None and self.invalid_streak >= self.invalid_epochs:
            self._stop(f"the actions collapsed: {self.invalid_streak} epochs in a row had more than {self.max_invalid_rate:.0%} of "
                       f"their steps invalid (this epoch {rate:.3f}, {int(invalid)} of {int(steps)} steps), after epoch "
                       f"{self.format_learned} had at most {self.healthy_invalid_rate:.0%}. See rollout/multi_action, "
                       "rollout/action_cap and stop/prob (README: the demo's collapse). Set "
                       "callbacks.run_health.invalid_epochs (null: never stop), callbacks.run_health.max_invalid_rate or "
                       "callbacks.run_health.healthy_invalid_rate to change the rule")

    @staticmethod
    def _stop(message: str) -> None:
        log.error("stopping the run: %s", message)
        raise RunStalled(message)

    def state_dict(self) -> dict:
        return {"aborted_streak": self.aborted_streak, "zero_signal_streak": self.zero_signal_streak,
                "invalid_streak": self.invalid_streak, "format_learned": self.format_learned}

    def load_state_dict(self, state_dict: dict) -> None:
        self.aborted_streak = int(state_dict.get("aborted_streak", 0))
        self.zero_signal_streak = int(state_dict.get("zero_signal_streak", 0))
        self.invalid_streak = int(state_dict.get("invalid_streak", 0))
        learned = state_dict.get("format_learned")
        self.format_learned = None if learned is None else int(learned)
