"""What one epoch of experience produced: the typed records the DataModule publishes.

The DataModule is the only writer. Everything downstream reads them through its public accessors:
``datamodule.train_record`` (an :class:`EpochRecord`, set when the epoch's rollouts are collected,
before ``on_train_epoch_start``) and ``datamodule.val_record`` (a :class:`ValidationRecord`, complete
after the validation loop). The LightningModule scores ``EpochRecord.minibatches`` in place at the
start of the epoch (old/reference log-probs, then its scored transforms, e.g. EMPG); callbacks read
episodes, metrics and counters and never write.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from cope.episode import Episode
from cope.rollout.metrics import episode_tally

if TYPE_CHECKING:  # the batch contract lives on the training side; records only carry it
    from cope.batch import RolloutBatch


@dataclass
class EpochRecord:
    """One training epoch's experience.

    epoch: the (0-based) epoch it was collected for; episodes: in collection order (an episode's
    ``group`` is its GRPO group); minibatches: the collated training batches (``episode_index`` names
    their episodes), scored in place by the module before any update (see ``scored``); metrics:
    ``rollout/*``, ``env/*``, ``perf/*``, ``counters/*`` (and ``data/*``) of the epoch, this rank's own; counters: the
    cumulative counters after it; tally: the sums and counts of this rank behind the ``rollout/*`` and ``env/*``
    metrics (:func:`cope.train.collect.experience.epoch_tally`), which the module sums over ranks and logs as global
    values (:func:`cope.train.dist.log_rollout_metrics`; ``metrics`` keeps this rank's own values)."""

    epoch: int
    episodes: list[Episode]
    minibatches: list[RolloutBatch]
    metrics: dict[str, float]
    counters: dict[str, int]
    extra_batches: list[RolloutBatch] = field(default_factory=list)  # trained after the minibatches (CoPE's separate update)
    scored: bool = False  # set by the module once the minibatches carry old log-probs
    sampler_logprobs: bool = False  # the engine reports its own log-probs (``Step.sampler_logprobs``: a server engine)
    tally: dict[str, float] = field(default_factory=dict)  # empty: every metric is logged as this rank's own


@dataclass
class ValidationRecord:
    """One validation run's greedy held-out episodes (all chunks of the panel on this rank); metrics: their
    ``val/*`` (this rank's own)."""

    epoch: int
    episodes: list[Episode] = field(default_factory=list)
    metrics: dict[str, float] = field(default_factory=dict)

    @property
    def tally(self) -> dict[str, float]:
        """The sums and counts behind ``val/*`` (:func:`cope.rollout.metrics.episode_tally` of the episodes so
        far), which the module sums over ranks to log the panel's ``val/*`` (:func:`cope.train.dist.log_val_metrics`)."""
        return episode_tally(self.episodes)


def train_record(trainer) -> EpochRecord | None:
    """The newest training epoch's record of ``trainer``'s datamodule (None before the first one)."""
    return getattr(getattr(trainer, "datamodule", None), "train_record", None)


def val_record(trainer) -> ValidationRecord | None:
    """The newest validation's record of ``trainer``'s datamodule (None before the first one)."""
    return getattr(getattr(trainer, "datamodule", None), "val_record", None)


def counters(trainer) -> dict[str, int]:
    """The cumulative experience counters (episodes, env steps, tokens; summed over ranks, never reset)."""
    return dict(getattr(getattr(trainer, "datamodule", None), "counters", None) or {})
