"""The collector seam: how an epoch's episodes are gathered, one class per way of gathering them.

The DataModule asks its one collector for each epoch's episodes (:meth:`Collector.collect`) and never asks which
collector it has: the collector is chosen once, when the DataModule is built (``data.max_lag``:
:class:`~cope.train.collect.sync.SyncCollector` at 0, collect then train;
:class:`~cope.train.collect.lagged.LaggedCollector` at L >= 1, collected in a background thread while earlier
epochs train; or the factory passed as ``data.collector``). Everything after collection (advantages, minibatches,
counters, the :class:`~cope.records.EpochRecord`) is the same for every collector
(:class:`~cope.train.collect.epoch_builder.EpochBuilder`), in the main thread.

A collector gets what the DataModule lends it as a :class:`CollectorHost` (callables that read the trainer, which is
bound late), so it never reaches into the DataModule. Its factory is called once, as ``factory(host=host)``. A new
collector is a class with this protocol and such a factory; nothing in the DataModule changes (docs/CONTRACTS.md,
"Collectors").

Vocabulary: an episode's *sampled epoch* (:attr:`cope.episode.Episode.sampled_epoch`) is the epoch whose starting
weights sampled it; a *version* is the optimizer step count of the weights an engine serves
(``RolloutEngine.sync(version)``), as everywhere in :mod:`cope.rollout`.
"""
from __future__ import annotations

import contextlib
import random
from dataclasses import dataclass, field
from typing import Any, Callable, ContextManager, NamedTuple, Protocol

from cope.envs.base import Task
from cope.episode import Episode
from cope.rollout.engine import RolloutEngine, Sampling
from cope.rollout.loop import RolloutStats


class TaskStream(NamedTuple):
    """One epoch's training tasks on one rank: ``group_size`` copies of each task, their GRPO groups, and the random
    stream that drew them, which goes on to draw the rollout's sampling seed and then the minibatch order."""

    tasks: list[Task]
    groups: list[int]
    rng: random.Random


@dataclass
class Collected:
    """One epoch's episodes as a collector hands them over.

    Attributes:
        episodes: in collection order, each with its ``sampled_epoch`` set.
        groups: each episode's GRPO group (advantages are relative within it).
        stats: the rollout's :class:`~cope.rollout.loop.RolloutStats` (``sync_seconds`` includes the sync).
        rng: the epoch's task stream, which orders the minibatches next.
        seconds: the collection's wall time (``perf/rollout_seconds``).
        metrics: the collector's own metrics, added last to the epoch's (the lagged one's ``rollout/lag_mean``,
            ``rollout/lag_max``, ``rollout/discarded_episodes``, ``perf/rollout_wait_seconds``); the same keys every
            epoch and on every rank.
        trained: the indices (ascending) of the episodes that are trained; None: every one. The others count in the
            advantages (computed over every episode first) and the epoch's ``rollout/*`` metrics only; the record
            holds the trained ones (the branching collector's duplicate and J_max-capped leaves).
        nominal: the episodes the epoch would have trained had nothing been dropped, the same on every rank (the
            branching collector's full groups); None: ``len(episodes)``. The epoch then trains as many minibatches as
            ``nominal`` episodes would fill, whatever was dropped on this rank, so the ranks' optimizer steps meet
            under DDP (:func:`~cope.train.collect.experience.cut_minibatches`).
    """

    episodes: list[Episode]
    groups: list[int]
    stats: RolloutStats
    rng: random.Random
    seconds: float
    metrics: dict[str, float] = field(default_factory=dict)
    trained: list[int] | None = None
    nominal: int | None = None


@dataclass(frozen=True)
class CollectorHost:
    """What the DataModule lends its collector: the engine and sampling, and callables read when called (the trainer
    is bound late).

    Attributes:
        engine: the rollout engine (its ``overlaps``, ``sync``, ``hold``, ``release``, ``rollout(..., version=)`` for a
            collector that samples off the main thread).
        sampling: the training rollouts' :class:`~cope.rollout.engine.Sampling` (a collection sets its own seed).
        task_stream: ``task_stream(epoch)`` -> :class:`TaskStream` of that epoch on this rank (derived from the seed,
            the rank and the epoch: the same after a resume).
        rollout: ``rollout(tasks, groups, seed)`` -> (episodes, stats): a rollout in this thread under the weights as
            they are now (the engine synced to the trainer's step, with the training sampling and this seed; a
            progress bar; the stop after a SIGTERM).
        version: the optimizer step count of the weights now (0 without a trainer).
        max_epochs: the epochs the fit runs (None: unbounded or no trainer); nothing past them should be collected.
        world: the number of ranks (each collects its own episodes).
        stopping: True once the run received SIGTERM (a collection off the main thread stops after its turn).
        precision: ``precision()`` -> the context a rollout runs under in whichever thread samples (the training
            step's precision, :func:`cope.train.collect.sync.training_precision`); a null context by default.
        policy: ``policy()`` -> the policy bound at ``connect`` (tokenizer, chat scaffold), None before it.
        rank: ``rank()`` -> this process's global rank (0 without a trainer).
    """

    engine: RolloutEngine
    sampling: Sampling
    task_stream: Callable[[int], TaskStream]
    rollout: Callable[[list[Task], list[int], int], tuple[list[Episode], RolloutStats]]
    version: Callable[[], int]
    max_epochs: Callable[[], int | None]
    world: Callable[[], int]
    stopping: Callable[[], bool]
    precision: Callable[[], ContextManager] = contextlib.nullcontext
    policy: Callable[[], Any] = lambda: None
    rank: Callable[[], int] = lambda: 0


class Collector(Protocol):
    """Gathers each epoch's episodes for the DataModule.

    Attributes:
        off_policy: the policy that sampled an episode may not be the one that scores it at the start of its epoch;
            the minibatches then carry the sampler's log-probs (``behaviour_logprobs``) for the policy gradient's
            behaviour correction, and every action must have them.
    """

    off_policy: bool

    def collect(self, epoch: int) -> Collected:
        """Epoch ``epoch``'s episodes on this rank, in the main thread (called once per epoch, epochs ascending; a
        resumed fit starts at its first epoch). Raises Lightning's ``SIGTERMException`` when a SIGTERM stopped it."""
        ...

    def cancel(self) -> None:
        """Stops and drops whatever is in flight (the fit ends: teardown); the engine is closed after it."""
        ...

    def state_dict(self) -> dict:
        """What the collector keeps in the DataModule's checkpoint state, beside ``counters`` (the same on every
        rank: rank 0 writes it); keys must not clash with ``counters``."""
        ...

    def load_state_dict(self, state: dict) -> None:
        """Restores from the DataModule's whole checkpoint state (also one written by another collector, or by an
        older release: missing keys mean nothing was saved)."""
        ...


CollectorFactory = Callable[..., Collector]  # called once as factory(host=CollectorHost(...))
