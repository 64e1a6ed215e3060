"""An epoch's collected episodes -> its :class:`~cope.records.EpochRecord`, the same for every collector.

What the DataModule publishes as ``train_record`` is built here from a collector's
:class:`~cope.train.collect.collector.Collected`, in the main thread (the counters' and batch counts' reductions are
collectives), in a fixed order that is part of what makes a run reproducible:

1. advantages within each GRPO group (:func:`~cope.train.collect.experience.assign_advantages`), over every
   episode collected;
2. the trained ones (``Collected.trained``; all by default), which the record holds, and their minibatches, ordered
   by the epoch's task stream (as many as ``Collected.nominal`` episodes fill, where a collector dropped some), through
   the registered collate transforms and, with ``data.share_prefix``, packed per GRPO group last
   (:func:`~cope.train.packing.group_prefix.pack_groups`); with a collector that is ``off_policy`` each carries the
   sampler's log-probs;
3. the batch sources' extra batches, each source's count evened out over ranks;
4. the counters (:class:`~cope.train.collect.counters.RunCounters`) and the epoch's metrics: this rank's
   ``rollout/*``, ``env/*`` (of every episode collected), ``perf/*``, ``data/*``, the advantages',
   ``rollout/delivery_gap`` of a server engine, ``counters/*``, then the collector's own.
"""
from __future__ import annotations

import functools
from typing import Any

from cope.capabilities import can
from cope.episode import Episode
from cope.records import EpochRecord
from cope.train.collect.collector import Collected
from cope.train.collect.counters import Reduce, RunCounters
from cope.train.collect.experience import (
    BatchSource,
    CollateTransform,
    assign_advantages,
    cut_minibatches,
    epoch_metrics,
    epoch_tally,
    keep_trained,
    train_tokens,
)
from cope.train.packing.group_prefix import pack_groups


class EpochBuilder:
    """Turns each epoch's collected episodes into its record (see the module doc).

    Args:
        advantage_mode: ``grpo`` or ``drgrpo`` (:func:`cope.train.advantages.group_advantages`).
        minibatch_size: episodes per minibatch (one optimizer step).
        ppo_epochs: passes over the minibatches (the trained-token counter counts each).
        share_prefix: pack each minibatch's GRPO groups into prefix trees.
        engine: the rollout engine (its env-runtime events, ``delivery_gap``, ``reports_logprobs``).
        counters: the run's counters, advanced by every record built.
        reduce: ``reduce(values, op)`` over the ranks (:func:`~cope.train.collect.counters.reduce_over_ranks`).

    Attributes:
        collate_transforms: ``fn(minibatch, episodes) -> minibatch``, run on every minibatch in registration order.
        batch_sources: each gives extra batches trained after the minibatches.
    """

    def __init__(self, *, advantage_mode: str, minibatch_size: int, ppo_epochs: int, share_prefix: bool, engine: Any,
                 counters: RunCounters, reduce: Reduce):
        self.advantage_mode, self.minibatch_size, self.ppo_epochs = advantage_mode, minibatch_size, ppo_epochs
        self.share_prefix, self.engine, self.counters, self.reduce = share_prefix, engine, counters, reduce
        self.collate_transforms: list[CollateTransform] = []
        self.batch_sources: list[BatchSource] = []
        self._env_stats_seen = engine.env_stats()

    def build(self, epoch: int, got: Collected, *, pad_id: int, max_row_tokens: int | None,
              off_policy: bool) -> EpochRecord:
        """The record of epoch ``epoch`` from its collected episodes (not yet scored); advances the counters.
        ``max_row_tokens``: the longest packed row (the module's micro-batch budget); ``off_policy``: the collector's
        (:attr:`cope.train.collect.collector.Collector.off_policy`)."""
        eps, groups, stats = got.episodes, got.groups, got.stats
        adv_metrics = assign_advantages(eps, groups, self.advantage_mode)  # over every episode, dropped ones included
        train = eps if got.trained is None else keep_trained(eps, got.trained)
        count = None if got.nominal is None else -(-got.nominal // self.minibatch_size)  # the full epoch's steps
        transforms = self.collate_transforms
        if self.share_prefix:  # after every registered transform: it packs the rows they built
            transforms = [*transforms, functools.partial(pack_groups, max_row_tokens=max_row_tokens)]
        # a branched group's tree stays in one minibatch where the packing shares its prefixes (else episodes mix
        # across groups, as the flat collectors' always have)
        minibatches = cut_minibatches(train, self.minibatch_size, pad_id, got.rng, transforms, behaviour=off_policy,
                                      count=count, keep_groups=self.share_prefix and count is not None)
        extra = self._extra_batches(train)
        tokens = train_tokens(minibatches, pad_id, self.ppo_epochs) + train_tokens(extra, pad_id)
        # episodes: the env episodes the collection ran (stats), which a collector may turn into other training
        # episodes (RWML's world-model predictions, cope.algos.rwml) or filter (SFT's demonstrations that do not fit)
        self.counters.add(self.reduce, episodes=stats.episodes, env_steps=stats.env_steps,
                          generated_tokens=stats.generated_tokens, train_tokens=tokens)
        m = {**epoch_metrics(eps, stats, got.seconds, self._env_stats_delta(), minibatches if self.share_prefix else ()),
             **adv_metrics}
        delivery = getattr(self.engine, "delivery_gap", None)  # a server engine's check of its newest sync
        if delivery is not None:
            m["rollout/delivery_gap"] = float(delivery)
        m.update(self.counters.metrics())
        tally = epoch_tally(eps, groups, m)  # before the collector's metrics: they are this rank's own, not pooled
        m.update(got.metrics)
        return EpochRecord(epoch=epoch, episodes=train, minibatches=minibatches, extra_batches=extra, metrics=m,
                           counters=dict(self.counters), tally=tally,
                           sampler_logprobs=can(self.engine, "reports_logprobs") or off_policy)

    def _extra_batches(self, episodes: list[Episode]) -> list:
        """Every batch source's batches, each source's count evened out over ranks (the maximum, padded with empties)."""
        out = []
        for source in self.batch_sources:
            got = list(source.batches(episodes))
            n = int(self.reduce([len(got)], "max")[0])
            out += got + [source.empty() for _ in range(n - len(got))]
        return out

    def _env_stats_delta(self) -> dict[str, int]:
        """Env-runtime events (restarts, timeouts, ...) since the last call."""
        now = self.engine.env_stats()
        delta = {k: now[k] - self._env_stats_seen.get(k, 0) for k in now}
        self._env_stats_seen = now
        return delta
