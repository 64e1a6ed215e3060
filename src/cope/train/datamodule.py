"""The on-policy DataModule: every training epoch, fresh experience from a rollout engine.

``train_dataloader`` (reloaded every epoch: the trainer config sets
``reload_dataloaders_every_n_epochs=1``) samples ``tasks_per_epoch`` tasks, asks the rollout engine
(:mod:`cope.rollout.engine`) for ``group_size`` episodes per task, hands them to
:mod:`cope.train.experience` (advantages, minibatches, the registered collate transforms such as
CoPE's joint targets) and to the registered batch sources (CoPE's separate forecast batches, served after
the minibatches), and publishes the epoch as one :class:`~cope.records.EpochRecord` (``train_record``). It
never touches the LightningModule: the module scores the record's minibatches at the start of the
epoch (old/reference log-probs, then its scored transforms). Validation: the module calls
:meth:`RolloutDataModule.evaluate` per chunk of the fixed held-out panel; the episodes are gathered
in ``val_record``. Each DDP rank collects its own groups: the epoch's task stream (tasks, the
rollout's sampling seed, the minibatch order) is derived from ``(seed, rank, epoch)``
(:mod:`cope.train.seeding`), so it needs no state in checkpoints and a resumed run draws what the
uninterrupted one drew, on every rank. Counters are summed over ranks, never reset, and saved in
checkpoints.

Model-dependent things (tokenizer, chat scaffold, the policy the engine samples from) are bound
late through :meth:`connect`.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import time
from typing import Any, Callable

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities.exceptions import SIGTERMException
from torch.utils.data import DataLoader

from cope.envs.base import Env, Task, env_facts
from cope.episode import Episode
from cope.records import EpochRecord, ValidationRecord
from cope.rollout.engine import EnvRuntime, HFEngine, RolloutEngine, Sampling
from cope.rollout.metrics import episode_metrics
from cope.train.advantages import group_advantages
from cope.train.experience import (
    BatchSource,
    CollateTransform,
    assign_advantages,
    cut_minibatches,
    epoch_metrics,
    epoch_tally,
    train_tokens,
)
from cope.train.group_prefix import pack_groups
from cope.train.lagged_rollouts import LaggedRollouts, check_lag
from cope.train.seeding import derive_seed, stream
from cope.train.tree_batch import use_tree_attention

log = logging.getLogger(__name__)
COUNTERS = ("episodes", "env_steps", "generated_tokens", "train_tokens")


def _identity(x):
    return x


class RolloutDataModule(pl.LightningDataModule):
    """On-policy rollouts as a DataModule.

    Its own concerns (task sampling, batching, validation):
        env: factory of env instances (a Hydra ``_partial_``); one instance per concurrent episode.
        tasks_per_epoch: B, tasks sampled per rank per epoch.
        group_size: G, episodes per task (GRPO group).
        minibatch_size: episodes per optimizer step.
        ppo_epochs: passes over the epoch's minibatches (>1 makes the clipped ratio matter).
        share_prefix: the run's one shared-prefix switch. Each minibatch gets packed rows (``packed``) in which the
            episodes of one GRPO group forward their common prefix once (:mod:`cope.train.group_prefix`; rows that
            are trees already, CoPE's packed joint rows, are placed side by side), and the policy is switched to tree
            attention at ``connect`` (the one place that switches it). CoPE's separate forecast steps read the same
            key. The batch itself, the losses and the gradients stay those of the unshared minibatch. The longest
            packed row is the module's ``max_tokens_per_microbatch`` (a micro-batch is whole packed rows), bound at
            ``setup`` (``max_row_tokens``).
        advantage_mode: ``grpo`` (std-normalized) or ``drgrpo``.
        val_tasks: held-out tasks evaluated greedily at each validation (a fixed panel of the ``test``
            split: indices ``val_offset .. val_offset + val_tasks - 1``).
        val_offset: first index of that panel; a tuning panel disjoint from the reported one is another
            offset (e.g. 0 reported, 500 for tuning). The panel must fit in the split.
        val_batch_size: held-out episodes run together.
        seed: the run seed; each epoch's task stream is derived from it, the rank and the epoch.
        progress: show a progress bar while collecting rollouts.
        max_lag: L, rollouts that overlap training (:mod:`cope.train.lagged_rollouts`): epoch e trains on episodes
            sampled by the policy as it was at the start of epoch max(0, e - L), collected in a background thread
            while the epochs before it train; the minibatches carry the sampler's log-probs (``behaviour_logprobs``)
            for the policy gradient's behaviour correction. Needs an engine that can serve an older version while
            training goes on (``overlaps``: rollout=hf, a sampler copy of the adapter per version, or rollout=vllm)
            and sampling without top-p. 0: collect, then train (today).

    Handed to the rollout engine (typed records, each read by the class that uses it):
        sampling: :class:`cope.rollout.engine.Sampling` of training rollouts (``data.sampling.*``: temperature,
            top_p, max_action_tokens); validation is greedy with the same action cap.
        env_runtime: :class:`cope.rollout.engine.EnvRuntime` (``data.env_runtime.*``: where env instances live,
            deadlines, waves, overlap). ``max_live_episodes=None`` takes the env's ``max_instances``
            when it declares one.
        max_context: context budget in tokens; see the overflow policy in :mod:`cope.rollout.loop`.
        instructions: system prompt replacing the env's own (its rules and action format); None keeps it.
        engine: factory of the rollout engine (``data.engine``, the ``rollout`` config group), called with
            ``env``, ``runtime``, ``max_context`` and ``instructions`` (None: :class:`cope.rollout.engine.HFEngine`).
    """

    def __init__(
        self,
        env: Callable[[], Env],
        tasks_per_epoch: int = 8,
        group_size: int = 4,
        minibatch_size: int = 16,
        ppo_epochs: int = 1,
        share_prefix: bool = False,
        advantage_mode: str = "grpo",
        val_tasks: int = 64,
        val_batch_size: int = 64,
        val_offset: int = 0,
        seed: int = 0,
        progress: bool = True,
        sampling: Sampling | None = None,
        env_runtime: EnvRuntime | None = None,
        max_context: int = 2048,
        instructions: str | None = None,
        engine: Callable[..., RolloutEngine] | None = None,
        max_lag: int = 0,
    ):
        super().__init__()
        if max_lag < 0:
            raise ValueError(f"data.max_lag must be >= 0 (0: collect, then train), got {max_lag}")
        for name, v in dict(tasks_per_epoch=tasks_per_epoch, group_size=group_size, minibatch_size=minibatch_size,
                            ppo_epochs=ppo_epochs, max_context=max_context, val_batch_size=val_batch_size).items():
            if v < 1:
                raise ValueError(f"data.{name} must be >= 1, got {v}")
        if val_tasks < 0:
            raise ValueError(f"data.val_tasks must be >= 0, got {val_tasks}")
        if val_offset < 0:
            raise ValueError(f"data.val_offset must be >= 0, got {val_offset}")
        try:  # fail fast on a bad mode, naming the key (data.advantage_mode defaults to ${algo.advantage_mode})
            group_advantages(torch.zeros(1), torch.zeros(1, dtype=torch.long), mode=advantage_mode)
        except ValueError as e:
            raise ValueError(f"data.advantage_mode (algo.advantage_mode): {e}") from None
        self.tasks_per_epoch, self.group_size, self.minibatch_size = tasks_per_epoch, group_size, minibatch_size
        self.ppo_epochs, self.advantage_mode, self.share_prefix = ppo_epochs, advantage_mode, bool(share_prefix)
        self.max_row_tokens: int | None = None  # the module's micro-batch budget, bound at setup
        self.val_tasks, self.val_batch_size, self.seed, self.progress = val_tasks, val_batch_size, seed, progress
        self.val_offset = val_offset
        self.sampling = sampling or Sampling()
        self.val_sampling = Sampling(temperature=0.0, top_p=1.0, max_action_tokens=self.sampling.max_action_tokens)
        runtime = env_runtime or EnvRuntime()
        facts = env_facts(env)  # one instance built and closed, no episode and no engine started
        self.env_name, self.num_train_tasks, self.num_test_tasks = facts.name, facts.train_tasks, facts.test_tasks
        if runtime.max_live_episodes is None and facts.max_instances:
            runtime = dataclasses.replace(runtime, max_live_episodes=facts.max_instances)  # memory-heavy env: waves
            log.info("%s: at most %d live episodes at once (the env's max_instances; "
                     "data.env_runtime.max_live_episodes overrides)", facts.name, runtime.max_live_episodes)
        if val_offset and val_offset + val_tasks > self.num_test_tasks:
            raise ValueError(f"data.val_offset + data.val_tasks = {val_offset + val_tasks} exceeds the "
                             f"{self.num_test_tasks} test tasks of env {self.env_name!r}")
        self.engine: RolloutEngine = (engine or HFEngine)(env=env, runtime=runtime, max_context=max_context,
                                                           instructions=instructions)
        self.max_lag = int(max_lag)
        if self.max_lag:
            check_lag(self.max_lag, self.engine, self.sampling)
        self._lagged = LaggedRollouts(self.engine, self.max_lag, self.sampling, self._task_stream,
                                      lambda: bool(getattr(self.trainer, "received_sigterm", False))) if self.max_lag else None
        self.discarded_episodes = 0  # max_lag: episodes of collections dropped unused (a resume; summed over ranks)
        self.counters = {k: 0 for k in COUNTERS}
        self.train_record: EpochRecord | None = None  # the newest training epoch's experience
        self.val_record: ValidationRecord | None = None  # the newest validation's held-out episodes
        self.tokenizer = self.chat = None
        self._policy: Any = None  # bound by connect: its full_weights context wraps every rollout
        self.pad_id = 0
        self._collate_transforms: list[CollateTransform] = []
        self._batch_sources: list[BatchSource] = []
        self.rank = 0  # the trainer's global rank, set in setup
        self.epoch = 0  # the training epoch whose experience is collected (or was, last)
        self._rng = stream(seed, "tasks", 0, 0)  # re-derived for every epoch's collection
        self._served: tuple[tuple[int, int], DataLoader] | None = None  # (policy version, its epoch's loader)
        self._env_stats_seen = self.engine.env_stats()

    # -- wiring ---------------------------------------------------------------------------------
    def connect(self, policy: Any, rank: int = 0) -> None:
        """Bind the policy: its tokenizer and chat scaffold (collation, CoPE targets) and the engine's sampler;
        ``rank`` is the trainer's global rank (``trainer.global_rank``, known once the Trainer exists)."""
        self.tokenizer, self.chat, self.pad_id = policy.tokenizer, policy.chat, int(policy.tokenizer.pad_token_id)
        if self.share_prefix:  # the minibatches it serves carry prefix trees; every forward without one stays SDPA
            use_tree_attention(policy.model)
        self.engine.connect(policy, rank=rank)
        self._policy = policy

    def add_collate_transform(self, fn: CollateTransform) -> None:
        """``fn(minibatch, episodes) -> minibatch`` runs on every minibatch before scoring (e.g. CoPE targets)."""
        self._collate_transforms.append(fn)

    def add_batch_source(self, source: BatchSource) -> None:
        """``source.batches(episodes)`` gives extra batches trained after each epoch's minibatches (CoPE's separate
        forecast update); under DDP the counts are evened out with ``source.empty()``."""
        self._batch_sources.append(source)

    def setup(self, stage: str) -> None:
        if self.tokenizer is None:
            raise RuntimeError("RolloutDataModule.connect(policy) must be called before fitting")
        self.rank = self.trainer.global_rank if self.trainer is not None else 0
        if self.trainer is not None and self.trainer.lightning_module is not None:  # late binding: the module's budget
            self.max_row_tokens = self.trainer.lightning_module.max_tokens_per_microbatch

    def teardown(self, stage: str) -> None:
        if self._lagged is not None:
            dropped = self._lagged.cancel()
            if dropped:
                log.info("data.max_lag: %d queued collection(s) (epochs %s) dropped at teardown", len(dropped),
                         [c.epoch for c in dropped])
        self.engine.close()

    # -- rollouts -------------------------------------------------------------------------------
    def _rollout(self, tasks: list[Task], groups: list[int], sampling: Sampling, seed: int, desc: str):
        bar = None
        if self.progress and (self.trainer is None or self.trainer.is_global_zero):
            from tqdm.auto import tqdm

            bar = tqdm(total=len(tasks), desc=desc, leave=False, dynamic_ncols=True)
        try:
            t0 = time.perf_counter()
            if self.trainer is not None:
                self.engine.sync(self.trainer.global_step)
            synced = time.perf_counter() - t0
            with self._policy.full_weights() if self._policy is not None else contextlib.nullcontext():  # trainer=fsdp
                eps, stats = self.engine.rollout(tasks, groups, dataclasses.replace(sampling, seed=seed),
                                                 progress=lambda n: self._turn_done(n, bar))
            stats.sync_seconds += synced
            return eps, stats
        finally:
            if bar:
                bar.close()

    def _turn_done(self, finished: int, bar) -> None:
        """Called by the engine after every turn: the progress bar, and the stop after a SIGTERM. A rollout
        at 7B can take minutes, longer than a scheduler's grace period, so the run does not wait for it:
        the epoch is left unfinished (resume runs it again from its start, see :mod:`cope.run.preemption`)."""
        if bar is not None:
            bar.update(finished)
        if getattr(self.trainer, "received_sigterm", False):
            raise SIGTERMException

    def sample_tasks(self, epoch: int) -> tuple[list[Task], list[int]]:
        """The training tasks of ``epoch`` on this rank (``group_size`` copies each) and their groups; starts the
        epoch's task stream (this rank's, derived from the seed: the same after a resume), which then also gives
        the rollout's sampling seed and the minibatch order."""
        self._rng = stream(self.seed, "tasks", self.rank, epoch)
        tasks, groups = [], []
        for g in range(self.tasks_per_epoch):
            t = Task(self.env_name, "train", self._rng.randrange(self.num_train_tasks))
            tasks += [t] * self.group_size
            groups += [g] * self.group_size
        return tasks, groups

    def _reduce(self, values: list[float], op: str = "sum") -> list[float]:
        """``values`` reduced over DDP ranks (``sum`` or ``max``); as they are in one process."""
        if self.trainer is None or self.trainer.world_size == 1:
            return values
        t = torch.tensor(values, dtype=torch.float64, device=self.trainer.strategy.root_device)
        return self.trainer.strategy.reduce(t, reduce_op=op).tolist()

    def train_dataloader(self) -> DataLoader:
        # The epoch being started: Lightning's `processed` count (`current_epoch` still names the saved epoch while
        # a fit restarted from a checkpoint asks for its first data, before its loop advances). One batch of
        # experience per epoch: Lightning asks twice when a fit restarts (before and after it resets its loops);
        # a second collection would spend rollouts for nothing.
        epoch = self.trainer.fit_loop.epoch_progress.current.processed
        key = (id(self.trainer), epoch)
        if self._served is not None and self._served[0] == key:
            return self._served[1]
        self.train_record = self._lagged_epoch(epoch) if self.max_lag else self.collect_epoch(epoch)
        served = [mb for _ in range(self.ppo_epochs) for mb in self.train_record.minibatches] + self.train_record.extra_batches
        loader = DataLoader(served, batch_size=None, shuffle=False, collate_fn=_identity)
        self._served = (key, loader)
        return loader

    def collect_epoch(self, epoch: int = 0) -> EpochRecord:
        """Rollouts, advantages and minibatches of one epoch (not yet scored), sampled now; updates the counters."""
        t0 = time.perf_counter()
        tasks, groups = self.sample_tasks(epoch)
        eps, stats = self._rollout(tasks, groups, self.sampling, self._rng.randrange(2**31), "rollouts")
        for e in eps:
            e.policy_version = epoch
        return self._record(epoch, eps, groups, stats, self._rng, time.perf_counter() - t0)

    def _lagged_epoch(self, epoch: int) -> EpochRecord:
        """``max_lag``: the epoch's collection, queued ``max_lag`` epochs ago (:mod:`cope.train.lagged_rollouts`),
        made a record with the lag metrics."""
        t0 = time.perf_counter()
        max_epochs = getattr(self.trainer, "max_epochs", None)
        job, synced = self._lagged.take(epoch, self.trainer.global_step if self.trainer is not None else 0, max_epochs)
        waited = time.perf_counter() - t0 - synced  # training waited for the rollouts this long (0: fully overlapped)
        job.stats.sync_seconds += synced
        record = self._record(epoch, job.episodes, job.groups, job.stats, job.rng, job.seconds)
        record.metrics.update({**self._lagged.metrics(epoch, job), "rollout/discarded_episodes": float(self.discarded_episodes),
                               "perf/rollout_wait_seconds": waited})
        return record

    def _task_stream(self, epoch: int):
        tasks, groups = self.sample_tasks(epoch)
        return tasks, groups, self._rng

    def _record(self, epoch: int, eps: list[Episode], groups: list[int], stats, rng, t_roll: float) -> EpochRecord:
        """Advantages, minibatches (ordered by ``rng``, the epoch's task stream), extra batches, counters and metrics
        of one epoch's episodes, in the main thread (the counters' reductions are collectives)."""
        self.epoch = epoch
        adv_metrics = assign_advantages(eps, groups, self.advantage_mode)
        pack = functools.partial(pack_groups, max_row_tokens=self.max_row_tokens)
        transforms = [*self._collate_transforms, pack] if self.share_prefix else self._collate_transforms
        minibatches = cut_minibatches(eps, self.minibatch_size, self.pad_id, rng, transforms, behaviour=self.max_lag > 0)
        extra = self._extra_batches(eps)
        tokens = train_tokens(minibatches, self.pad_id, self.ppo_epochs) + train_tokens(extra, self.pad_id)
        inc = self._reduce([len(eps), stats.env_steps, stats.generated_tokens, tokens])
        for k, v in zip(COUNTERS, inc):
            self.counters[k] += int(v)
        m = {**epoch_metrics(eps, stats, t_roll, self._env_stats_delta(), minibatches if self.share_prefix else ()),
             **adv_metrics}
        delivery = getattr(self.engine, "delivery_gap", None)  # a server engine's check of its newest sync
        if delivery is not None:
            m["rollout/delivery_gap"] = float(delivery)
        m.update({f"counters/{k}": float(v) for k, v in self.counters.items()})
        return EpochRecord(epoch=epoch, episodes=eps, minibatches=minibatches, extra_batches=extra, metrics=m,
                           counters=dict(self.counters), tally=epoch_tally(eps, groups, m),
                           sampler_logprobs=bool(getattr(self.engine, "reports_logprobs", False)) or self.max_lag > 0)

    def _extra_batches(self, episodes: list[Episode]) -> list:
        """Every batch source's batches, each source's count evened out over ranks (the maximum, padded with empties)."""
        out = []
        for source in self._batch_sources:
            got = list(source.batches(episodes))
            n = int(self._reduce([len(got)], "max")[0])
            out += got + [source.empty() for _ in range(n - len(got))]
        return out

    def _env_stats_delta(self) -> dict[str, int]:
        """Env-runtime events (restarts, timeouts, ...) since the last call."""
        now = self.engine.env_stats()
        delta = {k: now[k] - self._env_stats_seen.get(k, 0) for k in now}
        self._env_stats_seen = now
        return delta

    # -- validation -----------------------------------------------------------------------------
    def val_dataloader(self) -> DataLoader:
        rank = self.trainer.global_rank if self.trainer is not None else 0
        world = self.trainer.world_size if self.trainer is not None else 1
        n = min(self.val_tasks, self.num_test_tasks)
        mine = list(range(self.val_offset, self.val_offset + n))[rank::world]  # each rank evaluates its shard of the fixed panel
        chunks = [mine[s: s + self.val_batch_size] for s in range(0, len(mine), self.val_batch_size)]
        return DataLoader(chunks, batch_size=None, shuffle=False, collate_fn=_identity)

    def evaluate(self, indices: list[int], first: bool = True) -> tuple[list[Episode], dict[str, float]]:
        """Greedy episodes on held-out tasks ``indices``; returns them with their ``val/*`` metrics and
        adds them to ``val_record`` (a new record when ``first``: the first chunk of a validation run)."""
        tasks = [Task(self.env_name, "test", i) for i in indices]
        epoch = self.trainer.current_epoch if self.trainer is not None else 0
        seed = derive_seed(self.seed, "validation", self.rank, epoch) % 2**31  # greedy; a server engine still takes one
        eps, _ = self._rollout(tasks, list(range(len(tasks))), self.val_sampling, seed, "validation")
        metrics = episode_metrics(eps, prefix="val")
        if first or self.val_record is None:
            self.val_record = ValidationRecord(epoch=epoch)
        self.val_record.episodes.extend(eps)
        self.val_record.metrics = episode_metrics(self.val_record.episodes, prefix="val")
        return eps, metrics

    # -- checkpointing --------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """The counters (summed over ranks: the same on every rank). No RNG state: the task streams are derived
        per (seed, rank, epoch); a checkpoint's, written by rank 0, would give every rank rank 0's stream. With
        ``max_lag``: the discarded-episode count and the episodes of the collections queued now, on all ranks (the
        same count on each), which a resume from this checkpoint discards and collects again."""
        state = {"counters": dict(self.counters)}
        if self._lagged is not None:
            world = self.trainer.world_size if self.trainer is not None else 1
            state["discarded_episodes"] = self.discarded_episodes
            state["in_flight_episodes"] = sum(len(c.tasks) for c in self._lagged.pending) * world
        return state

    def load_state_dict(self, state: dict) -> None:
        self.counters.update(state["counters"])  # an older checkpoint's "rng" (rank 0's stream) is ignored
        in_flight = int(state.get("in_flight_episodes", 0))
        self.discarded_episodes = int(state.get("discarded_episodes", 0)) + in_flight
        if in_flight:
            log.warning("data.max_lag: the checkpoint had %d episodes in flight (collected, not yet trained); they are "
                        "discarded (rollout/discarded_episodes) and their epochs collected again with the resumed weights",
                        in_flight)
