"""Rollouts that overlap training (``data.max_lag = L >= 1``): a background thread collects later epochs' episodes.

The collector of :mod:`cope.train.collect.collector` for ``L >= 1`` (:class:`LaggedCollector`; the schedule and its
thread: :class:`LaggedRollouts`). The schedule is fixed: **epoch e trains on episodes sampled by the policy as it was
at the start of epoch max(0, e - L)** (their *sampled epoch*; the engine serves those weights as the *version* named
by the optimizer step count at their sync). At the start of epoch e the collector syncs the engine to the current
weights, queues the collection of epoch e + L under that version, and takes epoch e's collection (queued at the
start of epoch e - L), waiting for it if it is still running. So:

* **the lag is bounded by construction**: a collection is only ever queued under the newest weights, and only L
  epochs ahead; nothing is sampled by a policy more than L epochs old;
* **admission is paced, never dropped**: collection runs ahead of training by at most L epochs and then waits (the
  queue is full); a slow, long episode is waited for, never discarded, so the batch is not biased toward short ones;
* **GRPO groups stay within one version**: a collection is one engine call under one version, and every group lives
  inside one collection;
* **the first L epochs** of a fresh run are sampled by the weights of epoch 0 (lag e < L), as is every collection
  queued before the first update.

Only the collection itself runs in the thread (by default the engine call ``RolloutEngine.rollout(..., version=v)``
on its own env slots; a collector that gathers otherwise passes its own ``run``, as the branching collector grows its
trees there): task sampling happens when a collection is queued, advantages, minibatches, the counters' all-reduces
and the :class:`~cope.records.EpochRecord` in the main thread when it is taken, so no collective ever runs off the
main thread. The engine keeps every queued collection's version served (``hold``/``release``): the vLLM server as an
adapter per version, the in-process engine as a sampler copy of the adapter per version (the base weights shared,
:mod:`cope.rollout.sampler_copy`); an engine that cannot (``overlaps`` False) is refused.

Resume: collections are not checkpointed. A checkpoint written at the end of epoch e has the collections of epochs
e+1 .. e+L queued or running; a resumed run discards them, counts them (``rollout/discarded_episodes``, cumulative,
summed over ranks) and collects those epochs again under its first version, then goes on with the schedule. No
episode is trained twice and none is trained without being counted; a resumed lagged run is not bit-identical to
the uninterrupted one (its first L epochs after the resume have a smaller lag). The checkpoint carries
``in_flight_episodes`` (what a resume from it discards) and ``discarded_episodes`` (the running total). Lag 0 never
starts the thread (:class:`~cope.train.collect.sync.SyncCollector`).
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import queue
import random
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, ContextManager

from cope.envs.base import Task
from cope.train.collect.collector import Collected, CollectorHost

log = logging.getLogger(__name__)
THREAD = "cope-lagged-rollouts"  # the collector thread's name


def lag_problem(max_lag: int, engine: Any, top_p: float) -> tuple[str, str] | None:
    """What ``data.max_lag >= 1`` needs, as (key, message) when it is missing (None: it fits): an engine (instance or
    class) that overlaps, i.e. serves an older version while the weights change (its lagged rollouts must report their
    log-probs: collation refuses an action without them); and no top-p (the sampler's log-probs would be renormalized
    over the nucleus, biased against the trainer's)."""
    name = getattr(engine, "__name__", type(engine).__name__)
    if not getattr(engine, "overlaps", False):
        return "data.max_lag", (f"needs a rollout engine that samples from an older policy version while training "
                                f"changes the weights (overlaps = True); {name} cannot. Use rollout=hf (a sampler copy of "
                                "the adapter per version) or rollout=vllm (an adapter per version), or data.max_lag=0")
    if top_p < 1:
        return "data.sampling.top_p", (f"with data.max_lag={max_lag}: the sampler's log-probs are renormalized over "
                                       "the nucleus, so the behaviour weight pi_prox/pi_behav would be biased; sample with "
                                       "top_p=1 (temperature is exact), or data.max_lag=0")
    return None


def check_lag(max_lag: int, engine: Any, sampling: Any) -> None:
    """:func:`lag_problem` of a built engine and sampling, raised as ValueError naming the key."""
    problem = lag_problem(max_lag, engine, sampling.top_p)
    if problem is None and hasattr(engine, "check_lag"):
        engine.check_lag(max_lag)  # what the engine itself needs (vLLM: LoRA slots); raises naming its key
    if problem is not None:
        raise ValueError(f"{problem[0]}={max_lag if problem[0] == 'data.max_lag' else sampling.top_p}: {problem[1]}")


class Cancelled(Exception):
    """A queued or running collection was cancelled (teardown, SIGTERM, an error elsewhere)."""


@dataclass
class Collection:
    """One epoch's rollouts, queued under one policy version.

    epoch: the epoch that trains on it; sampled_epoch: the epoch whose starting weights sample it; version: the
    engine's version of those weights (the optimizer step count at the sync); tasks, groups, rng, seed: the epoch's
    task stream (:meth:`cope.train.datamodule.RolloutDataModule.sample_tasks`), whose ``rng`` goes on to order the
    minibatches; result (the :class:`~cope.train.collect.collector.Collected` its run returned), seconds: set when it
    finished (``error`` when it failed)."""

    epoch: int
    sampled_epoch: int
    version: int
    tasks: list[Task]
    groups: list[int]
    rng: random.Random
    seed: int
    result: Collected | None = None
    seconds: float = 0.0
    error: BaseException | None = None
    done: threading.Event = field(default_factory=threading.Event)


class LaggedRollouts:
    """The schedule and its background thread: a FIFO of :class:`Collection` run one after another.

    Args:
        engine: the rollout engine (``overlaps``: ``sync``, ``hold``, ``release``, ``rollout(..., version=)``).
        max_lag: L >= 1.
        sampling: the training rollouts' :class:`cope.rollout.engine.Sampling` (each collection gets its own seed).
        task_stream: ``task_stream(epoch)`` -> (tasks, groups, rng): the epoch's task stream, whose ``rng`` draws the
            rollout seed next and then orders the minibatches (the DataModule's, derived from seed, rank, epoch).
        stopping: True once the run received SIGTERM: a running collection stops after its current turn.
        precision: the context the collection runs under, entered in the thread (autocast is per thread).
        run: ``run(job, check)`` -> the :class:`~cope.train.collect.collector.Collected` of a queued collection, in the
            thread, sampling the job's ``version`` with its ``seed``; ``check()`` raises :class:`Cancelled` once the
            collection must stop (call it between turns). None: the engine's ``rollout`` (:meth:`rollout`).
    """

    def __init__(self, engine: Any, max_lag: int, sampling: Any,
                 task_stream: Callable[[int], tuple[list[Task], list[int], random.Random]], stopping: Callable[[], bool],
                 precision: Callable[[], ContextManager] = contextlib.nullcontext,
                 run: Callable[[Collection, Callable[[], None]], Collected] | None = None):
        self.engine, self.max_lag, self.sampling = engine, int(max_lag), sampling
        self._task_stream, self._stopping, self._precision = task_stream, stopping, precision
        self._run_job = run or self.rollout
        self._queue: queue.Queue[Collection | None] = queue.Queue()
        self._jobs: dict[int, Collection] = {}  # by epoch: queued, running or finished, not yet taken
        self._cancel = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def pending(self) -> list[Collection]:
        """Collections not yet taken (queued, running or finished), by epoch."""
        return [self._jobs[e] for e in sorted(self._jobs)]

    def take(self, epoch: int, version: int, max_epochs: int | None = None) -> tuple[Collection, float]:
        """Epoch ``epoch``'s collection and the seconds spent syncing: the engine synced to the weights as they are now
        (``version``: the optimizer step count), the collections of epochs ``epoch .. epoch + max_lag`` (none past
        ``max_epochs``) queued under them where not queued yet (all of them on a process's first epoch), then this
        epoch's waited for. Its episodes carry their ``sampled_epoch``; a failed collection's error is raised here
        (SIGTERM as Lightning's ``SIGTERMException``)."""
        t0 = time.perf_counter()
        self.engine.sync(version)
        synced = time.perf_counter() - t0
        last = epoch + self.max_lag
        if max_epochs is not None and max_epochs >= 0:  # nothing is collected for epochs the fit will not run
            last = min(last, max_epochs - 1)
        for k in range(epoch, last + 1):
            if k not in self._jobs:
                tasks, groups, rng = self._task_stream(k)
                self.engine.hold(version)
                self._submit(Collection(epoch=k, sampled_epoch=epoch, version=version, tasks=tasks, groups=groups,
                                        rng=rng, seed=rng.randrange(2**31)))
        job = self._jobs.pop(epoch)
        try:
            while not job.done.wait(timeout=1.0):
                if self._thread is None or not self._thread.is_alive():
                    raise RuntimeError(f"the rollout thread ended before epoch {epoch}'s collection finished")
            if isinstance(job.error, Cancelled) and self._stopping():
                from lightning.pytorch.utilities.exceptions import SIGTERMException

                raise SIGTERMException
            if job.error is not None:
                raise job.error
        finally:
            self.engine.release(job.version)
        for e in job.result.episodes:
            e.sampled_epoch = job.sampled_epoch
        return job, synced

    @staticmethod
    def metrics(epoch: int, job: Collection) -> dict[str, float]:
        """``rollout/lag_mean`` and ``rollout/lag_max`` (epochs between the sampling weights and the training epoch)."""
        lags = [epoch - e.sampled_epoch for e in job.result.episodes]
        return {"rollout/lag_mean": sum(lags) / max(len(lags), 1), "rollout/lag_max": float(max(lags, default=0))}

    def _submit(self, job: Collection) -> None:
        if self._thread is None or not self._thread.is_alive():
            self._cancel.clear()
            self._thread = threading.Thread(target=self._loop, name=THREAD, daemon=True)
            self._thread.start()
        self._jobs[job.epoch] = job
        self._queue.put(job)

    def rollout(self, job: Collection, check: Callable[[], None]) -> Collected:
        """The default run: the engine call of a queued collection (on the engine's env slots of this thread), the
        version it was queued under, the stop checked after every turn."""
        episodes, stats = self.engine.rollout(job.tasks, job.groups, dataclasses.replace(self.sampling, seed=job.seed),
                                              progress=lambda finished: check(), version=job.version)
        return Collected(episodes, job.groups, stats, job.rng, 0.0)

    def _run(self, job: Collection) -> Collected:
        """A queued collection's run (in the thread), stopped on a cancel or a SIGTERM."""
        def check() -> None:
            if self._cancel.is_set() or self._stopping():
                raise Cancelled

        check()
        with self._precision():  # autocast is per thread: entered here, in the collector's thread
            return self._run_job(job, check)

    def _loop(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            t0 = time.perf_counter()
            try:
                job.result = self._run(job)
            except BaseException as e:  # noqa: B036 - handed to the main thread by take()
                job.error = e
                if not isinstance(e, Cancelled):
                    log.error("lagged collection of epoch %d (sampled epoch %d, version %d) failed: %r", job.epoch,
                              job.sampled_epoch, job.version, e)
            job.seconds = time.perf_counter() - t0
            job.done.set()

    def cancel(self) -> list[Collection]:
        """Stop the thread (a running collection ends after its current turn), release every pending collection's
        version and return the collections that were dropped."""
        dropped = self.pending
        self._cancel.set()
        self._queue.put(None)
        if self._thread is not None:
            self._thread.join()
        self._thread = None
        self._queue = queue.Queue()
        for job in dropped:
            self.engine.release(job.version)
        self._jobs.clear()
        return dropped


class LaggedCollector:
    """``data.max_lag = L >= 1`` as a collector: :class:`LaggedRollouts` driven once per epoch, its lag metrics, and
    the episodes a resume discards.

    Args:
        host: what the DataModule lends (:class:`~cope.train.collect.collector.CollectorHost`): the engine, which must
            overlap (:func:`check_lag`, raised here naming the key), the sampling, the task stream.
        max_lag: L >= 1.
        run: how a queued collection is gathered in the thread (:class:`LaggedRollouts`'s ``run``; None: the engine's
            rollout). The branching collector passes its tree growth here.
    """

    off_policy = True  # an episode sampled L epochs ago is scored by today's weights: the behaviour correction

    def __init__(self, *, host: CollectorHost, max_lag: int,
                 run: Callable[[Collection, Callable[[], None]], Collected] | None = None):
        check_lag(max_lag, host.engine, host.sampling)
        self.host = host
        self.rollouts = LaggedRollouts(host.engine, max_lag, host.sampling, host.task_stream, host.stopping,
                                       host.precision, run)
        self.discarded_episodes = 0  # of collections dropped unused by a resume; summed over ranks

    def collect(self, epoch: int) -> Collected:
        """The epoch's collection, queued ``max_lag`` epochs ago, with ``rollout/lag_mean``, ``rollout/lag_max``,
        ``rollout/discarded_episodes`` and ``perf/rollout_wait_seconds`` added to its run's own metrics."""
        t0 = time.perf_counter()
        job, synced = self.rollouts.take(epoch, self.host.version(), self.host.max_epochs())
        waited = time.perf_counter() - t0 - synced  # training waited for the rollouts this long (0: fully overlapped)
        got = job.result
        got.stats.sync_seconds += synced
        metrics = {**got.metrics, **self.rollouts.metrics(epoch, job),
                   "rollout/discarded_episodes": float(self.discarded_episodes), "perf/rollout_wait_seconds": waited}
        return dataclasses.replace(got, rng=job.rng, seconds=job.seconds, metrics=metrics)

    def cancel(self) -> None:
        dropped = self.rollouts.cancel()
        if dropped:
            log.info("data.max_lag: %d queued collection(s) (epochs %s) dropped at teardown", len(dropped),
                     [c.epoch for c in dropped])

    def state_dict(self) -> dict:
        """The discarded-episode count and the episodes of the collections queued now, on all ranks (the same count on
        each), which a resume from this checkpoint discards and collects again."""
        in_flight = sum(len(c.tasks) for c in self.rollouts.pending) * self.host.world()
        return {"discarded_episodes": self.discarded_episodes, "in_flight_episodes": in_flight}

    def load_state_dict(self, state: dict) -> None:
        in_flight = int(state.get("in_flight_episodes", 0))
        self.discarded_episodes = int(state.get("discarded_episodes", 0)) + in_flight
        if in_flight:
            log.warning("data.max_lag: the checkpoint had %d episodes in flight (collected, not yet trained); they are "
                        "discarded (rollout/discarded_episodes) and their epochs collected again with the resumed weights",
                        in_flight)
