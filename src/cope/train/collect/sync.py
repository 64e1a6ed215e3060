"""Collect, then train (``data.max_lag = 0``): each epoch's episodes sampled at its start, by the weights it trains.

The collector of :mod:`cope.train.collect.collector` that is no more than the loop before overlap existed: at the
start of epoch e, draw the epoch's tasks, then the rollout's seed from the same stream, run the rollout in the main
thread under the current weights, and hand the episodes over (sampled epoch e). Nothing runs in the background,
so nothing is in flight at a checkpoint and nothing is added to it; the sampler is the policy that scores, so the
minibatches carry no behaviour log-probs.

:func:`rollout_now` is that rollout under the live weights, which validation runs too.
"""
from __future__ import annotations

import contextlib
import time
from typing import Any

from lightning.pytorch.utilities.exceptions import SIGTERMException

from cope.envs.base import Task
from cope.episode import Episode
from cope.rollout.engine import RolloutEngine, Sampling
from cope.rollout.loop import RolloutStats
from cope.train.collect.collector import Collected, CollectorHost


def training_precision(trainer: Any):
    """The training step's precision context (bf16 autocast under ``trainer.precision=bf16-mixed``; nothing in fp32),
    entered by the scoring pass (:meth:`cope.train.module.AgentRLModule.precision_context`) and around every in-process
    rollout, in whichever thread samples: the sampler then computes what the scoring pass computes, so its log-probs
    and the scorer's differ by sampling alone, not by precision (the behaviour weights of ``data.max_lag``,
    ``rollout/logprob_gap``). Lightning applies it to ``training_step`` only, and autocast is per thread. A no-op
    without a trainer."""
    try:
        return trainer.precision_plugin.train_step_context() if trainer is not None else contextlib.nullcontext()
    except (AttributeError, RuntimeError):
        return contextlib.nullcontext()


def rollout_now(engine: RolloutEngine, tasks: list[Task], groups: list[int], sampling: Sampling, *, trainer: Any,
                policy: Any, progress: bool, desc: str) -> tuple[list[Episode], RolloutStats]:
    """A rollout in this thread under the weights as they are now: the engine synced to the trainer's step (its time
    added to ``stats.sync_seconds``), the policy's whole weights gathered around it (``trainer=fsdp``), a progress
    bar on global rank zero (``progress``, titled ``desc``), and the stop after a SIGTERM. ``trainer``, ``policy``:
    None when not bound yet (no sync, no gathering)."""
    bar = None
    if progress and (trainer is None or trainer.is_global_zero):
        from tqdm.auto import tqdm

        bar = tqdm(total=len(tasks), desc=desc, leave=False, dynamic_ncols=True)

    def turn_done(finished: int) -> None:
        # A rollout at 7B can take minutes, longer than a scheduler's grace period, so the run does not wait for it
        # after a SIGTERM: the epoch is left unfinished (resume runs it again from its start, cope.run.preemption).
        if bar is not None:
            bar.update(finished)
        if getattr(trainer, "received_sigterm", False):
            raise SIGTERMException

    try:
        t0 = time.perf_counter()
        if trainer is not None:
            engine.sync(trainer.global_step)
        synced = time.perf_counter() - t0
        with policy.full_weights() if policy is not None else contextlib.nullcontext(), training_precision(trainer):
            eps, stats = engine.rollout(tasks, groups, sampling, progress=turn_done)
        stats.sync_seconds += synced
        return eps, stats
    finally:
        if bar:
            bar.close()


class SyncCollector:
    """Each epoch's rollout in the main thread at its start (see the module doc).

    Args:
        host: what the DataModule lends (:class:`~cope.train.collect.collector.CollectorHost`); its ``rollout`` runs
            the engine under the live weights with the training sampling.
    """

    off_policy = False  # the weights that sample an epoch are the ones that score it

    def __init__(self, *, host: CollectorHost):
        self.host = host

    def collect(self, epoch: int) -> Collected:
        t0 = time.perf_counter()
        tasks, groups, rng = self.host.task_stream(epoch)
        episodes, stats = self.host.rollout(tasks, groups, rng.randrange(2**31))  # after the tasks, before the order
        for e in episodes:
            e.sampled_epoch = epoch
        return Collected(episodes, groups, stats, rng, time.perf_counter() - t0)

    def cancel(self) -> None:
        """Nothing runs between epochs, so there is nothing to stop."""

    def state_dict(self) -> dict:
        return {}  # nothing is in flight between epochs

    def load_state_dict(self, state: dict) -> None:
        """Nothing to restore (a lagged checkpoint's in-flight episodes were never trained and are not counted)."""
