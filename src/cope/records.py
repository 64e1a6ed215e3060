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

if TYPE_CHECKING:  # the batch contract lives on the training side; records only carry it
    from cope.train.batch import RolloutBatch


@dataclass
class EpochRecord:
    """One training epoch's experience.

    epoch: the (0-based) epoch it was collected for; episodes: in collection order (an episode's
    ``group`` is its GRPO group); minibatches: the collated training batches (``episode_index`` names
    their episodes), scored in place by the module before any update (see ``scored``); metrics:
    ``rollout/*``, ``adv/*``, ``env/*``, ``perf/*`` and ``counters/*`` of the epoch; counters: the
    cumulative counters after it."""

    epoch: int
    episodes: list[Episode]
    minibatches: list[RolloutBatch]
    metrics: dict[str, float]
    counters: dict[str, int]
    extra_batches: list[RolloutBatch] = field(default_factory=list)  # trained after the minibatches (CoPE's separate update)
    scored: bool = False  # set by the module once the minibatches carry old log-probs
    sampler_logprobs: bool = False  # the engine reports its own log-probs (``Step.sampler_logprobs``: a server engine)


@dataclass
class ValidationRecord:
    """One validation run's greedy held-out episodes (all chunks of the panel on this rank)."""

    epoch: int
    episodes: list[Episode] = field(default_factory=list)
    metrics: dict[str, float] = field(default_factory=dict)


def train_record(trainer) -> EpochRecord | None:
    """The newest training epoch's record of ``trainer``'s datamodule (None before the first one)."""
    return getattr(getattr(trainer, "datamodule", None), "train_record", None)


def val_record(trainer) -> ValidationRecord | None:
    """The newest validation's record of ``trainer``'s datamodule (None before the first one)."""
    return getattr(getattr(trainer, "datamodule", None), "val_record", None)


def counters(trainer) -> dict[str, int]:
    """The cumulative experience counters (episodes, env steps, tokens; summed over ranks, never reset)."""
    return dict(getattr(getattr(trainer, "datamodule", None), "counters", None) or {})
