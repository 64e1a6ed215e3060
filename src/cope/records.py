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

from cope.episode import Episode
from cope.rollout import RolloutStats


@dataclass
class EpochRecord:
    """One training epoch's experience.

    epoch: the (0-based) epoch it was collected for; version: the policy version it was sampled
    from (optimizer steps); episodes: in collection order (``groups[i]`` the group of episode i);
    minibatches: the collated training batches (``indices`` name their episodes), filled with
    old log-probs by the module before any update; metrics: ``rollout/*``, ``adv/*``, ``env/*``,
    ``perf/*`` and ``counters/*`` of the epoch; counters: the cumulative counters after it."""

    epoch: int
    version: int
    episodes: list[Episode]
    groups: list[int]
    minibatches: list[dict]
    stats: RolloutStats
    metrics: dict[str, float]
    counters: dict[str, int]
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
