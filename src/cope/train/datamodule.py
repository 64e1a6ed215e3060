"""The on-policy DataModule: every training epoch, fresh experience from its collector.

``train_dataloader`` (reloaded every epoch: the trainer config sets ``reload_dataloaders_every_n_epochs=1``) asks
the one collector chosen at construction for the epoch's episodes and serves the epoch's
:class:`~cope.records.EpochRecord` (``train_record``). It never touches the LightningModule: the module scores the
record's minibatches at the start of the epoch (old/reference log-probs, then its scored transforms). Where each
concern lives:

* how episodes are gathered: the collector (the seam, :mod:`cope.train.collect.collector`; collect then train,
  :mod:`~cope.train.collect.sync`; overlapped, :mod:`~cope.train.collect.lagged`), chosen once by
  :func:`choose_collector` and lent a :class:`~cope.train.collect.collector.CollectorHost`; never asked which it is;
* the epoch's tasks: :meth:`RolloutDataModule.sample_tasks`, this rank's stream derived from ``(seed, rank, epoch)``
  (:mod:`cope.train.seeding`): tasks, then the rollout's sampling seed, then the minibatch order, so it needs no
  state in checkpoints and a resumed run draws what the uninterrupted one drew, on every rank;
* episodes -> record (advantages, minibatches, collate transforms, batch sources, counters, metrics):
  :class:`~cope.train.collect.epoch_builder.EpochBuilder`, on plain functions of :mod:`cope.train.collect.experience`;
* the cross-rank counters, summed over ranks, never reset, checkpointed: :mod:`cope.train.collect.counters`;
* validation (the held-out panel's shards, its record): :mod:`cope.train.collect.validation`; the module calls
  :meth:`RolloutDataModule.evaluate` per chunk, the episodes are gathered in ``val_record``.

Model-dependent things (tokenizer, chat scaffold, the policy the engine samples from) are bound late through
:meth:`RolloutDataModule.connect`.
"""
from __future__ import annotations

import dataclasses
import functools
import logging
from typing import Any, Callable

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader

from cope.envs.base import SPLITS, Env, Task, env_facts
from cope.episode import Episode
from cope.records import EpochRecord, ValidationRecord
from cope.rollout.engine import EnvRuntime, HFEngine, RolloutEngine, Sampling
from cope.train.advantages import group_advantages
from cope.train.collect.branching.node_values import NODE_VALUE
from cope.train.collect.collector import Collector, CollectorFactory, CollectorHost, TaskStream
from cope.train.collect.counters import RunCounters, reduce_over_ranks
from cope.train.collect.epoch_builder import EpochBuilder
from cope.train.collect.experience import BatchSource, CollateTransform
from cope.train.collect.lagged import LaggedCollector
from cope.train.collect.sync import SyncCollector, rollout_now, training_precision
from cope.train.collect.validation import HeldOutPanel
from cope.train.packing.tree_batch import use_tree_attention
from cope.train.seeding import derive_seed, stream

log = logging.getLogger(__name__)


def _identity(x):
    return x


def choose_collector(max_lag: int, collector: CollectorFactory | None = None) -> CollectorFactory:
    """The run's collector factory, chosen once: ``collector`` (``data.collector``) when given, else by
    ``data.max_lag`` (0: :class:`SyncCollector`; L >= 1: :class:`LaggedCollector`, which refuses an engine that
    cannot overlap). A given collector whose class declares ``takes_max_lag`` (the branching collector) is passed
    ``max_lag`` (L >= 1); any other refuses L >= 1. Raises ValueError naming the key, before anything is built."""
    if max_lag < 0:
        raise ValueError(f"data.max_lag must be >= 0 (0: collect, then train), got {max_lag}")
    if collector is not None:
        if not max_lag:
            return collector
        cls = getattr(collector, "func", collector)
        if getattr(cls, "takes_max_lag", False):
            return functools.partial(collector, max_lag=int(max_lag))
        raise ValueError(f"data.max_lag={max_lag}: data.collector ({getattr(cls, '__qualname__', cls)}) collects on its "
                         "own schedule and takes no lag (only the branching collector does): set data.max_lag=0")
    return functools.partial(LaggedCollector, max_lag=int(max_lag)) if max_lag else SyncCollector


class RolloutDataModule(pl.LightningDataModule):
    """On-policy rollouts as a DataModule.

    Its own concerns (task sampling, batching, validation):
        env: factory of env instances (a Hydra ``_partial_``); one instance per concurrent episode.
        tasks_per_epoch: B, tasks sampled per rank per epoch.
        group_size: G, episodes per task (GRPO group).
        minibatch_size: episodes per optimizer step.
        ppo_epochs: passes over the epoch's minibatches (>1 makes the clipped ratio matter).
        share_prefix: the run's one shared-prefix switch. Each minibatch gets packed rows (``packed``) in which the
            episodes of one GRPO group forward their common prefix once (:mod:`cope.train.packing.group_prefix`; rows
            that are trees already, CoPE's packed joint rows, are placed side by side), and the policy is switched to
            tree attention at ``connect`` (the one place that switches it). CoPE's separate forecast steps read the
            same key. The batch itself, the losses and the gradients stay those of the unshared minibatch. The
            longest packed row is the module's ``max_tokens_per_microbatch`` (a micro-batch is whole packed rows),
            bound at ``setup`` (``max_row_tokens``).
        advantage_mode: ``grpo`` (std-normalized), ``drgrpo``, or ``node_value`` (per step, from a branched group's
            tree: :mod:`cope.train.collect.branching.node_values`).
        val_tasks, val_offset, val_batch_size: the held-out panel, test tasks ``val_offset .. val_offset + val_tasks
            - 1`` evaluated greedily at each validation, ``val_batch_size`` episodes run together
            (:class:`~cope.train.collect.validation.HeldOutPanel`).
        seed: the run seed; each epoch's task stream is derived from it, the rank and the epoch.
        progress: show a progress bar while collecting rollouts.
        max_lag: L >= 1: epoch e trains on episodes sampled by the policy at the start of epoch max(0, e - L),
            collected while earlier epochs train (:mod:`cope.train.collect.lagged`); 0: collect, then train.
        collector: a collector factory (:mod:`cope.train.collect.collector`, a Hydra ``_partial_`` called once as
            ``collector(host=...)``) in place of the one ``max_lag`` chooses (which must then be 0).
        train_split: the split the training tasks are drawn from (``train``; ``test`` trains on the held-out tasks,
            as ECHO's verifier-free run does, ``algo=echo_only``: the panel is then among the training tasks).

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
        collector: CollectorFactory | None = None,
        train_split: str = "train",
    ):
        super().__init__()
        make_collector = choose_collector(max_lag, collector)
        for name, v in dict(tasks_per_epoch=tasks_per_epoch, group_size=group_size, minibatch_size=minibatch_size,
                            ppo_epochs=ppo_epochs, max_context=max_context, val_batch_size=val_batch_size).items():
            if v < 1:
                raise ValueError(f"data.{name} must be >= 1, got {v}")
        try:  # fail fast on a bad mode, naming the key (data.advantage_mode defaults to ${algo.advantage_mode})
            if advantage_mode != NODE_VALUE:  # node_value: per step from a branched group's tree
                group_advantages(torch.zeros(1), torch.zeros(1, dtype=torch.long), mode=advantage_mode)
        except ValueError as e:
            raise ValueError(f"data.advantage_mode (algo.advantage_mode): {e} (or {NODE_VALUE!r} with a branching "
                             "collector)") from None
        self.tasks_per_epoch, self.group_size, self.minibatch_size = tasks_per_epoch, group_size, minibatch_size
        self.ppo_epochs, self.advantage_mode, self.share_prefix = ppo_epochs, advantage_mode, bool(share_prefix)
        self.max_row_tokens: int | None = None  # the module's micro-batch budget, bound at setup
        self.seed, self.progress = seed, progress
        self.sampling = sampling or Sampling()
        self.val_sampling = Sampling(temperature=0.0, top_p=1.0, max_action_tokens=self.sampling.max_action_tokens)
        runtime = env_runtime or EnvRuntime()
        facts = env_facts(env)  # one instance built and closed, no episode and no engine started
        self.env_name, self.num_test_tasks = facts.name, facts.test_tasks
        if train_split not in SPLITS:
            raise ValueError(f"data.train_split must be one of {SPLITS}, got {train_split!r}")
        self.train_split = train_split
        self.num_train_tasks = facts.train_tasks if train_split == "train" else facts.test_tasks
        if runtime.max_live_episodes is None and facts.max_instances:
            runtime = dataclasses.replace(runtime, max_live_episodes=facts.max_instances)  # memory-heavy env: waves
            log.info("%s: at most %d live episodes at once (the env's max_instances; "
                     "data.env_runtime.max_live_episodes overrides)", facts.name, runtime.max_live_episodes)
        self.panel = HeldOutPanel(self.env_name, self.num_test_tasks, val_tasks, val_offset, val_batch_size)
        self.engine: RolloutEngine = (engine or HFEngine)(env=env, runtime=runtime, max_context=max_context,
                                                           instructions=instructions)
        self.collector: Collector = make_collector(host=CollectorHost(
            engine=self.engine, sampling=self.sampling, task_stream=self.sample_tasks,
            rollout=lambda tasks, groups, seed: self._rollout(tasks, groups, self.sampling, seed, "rollouts"),
            version=lambda: self.trainer.global_step if self.trainer is not None else 0,
            max_epochs=lambda: getattr(self.trainer, "max_epochs", None), world=self._world,
            stopping=lambda: bool(getattr(self.trainer, "received_sigterm", False)),
            precision=lambda: training_precision(self.trainer), policy=lambda: self._policy, rank=lambda: self.rank))
        self.counters = RunCounters()  # reads as a dict of the totals
        self.builder = EpochBuilder(advantage_mode=advantage_mode, minibatch_size=minibatch_size, ppo_epochs=ppo_epochs,
                                    share_prefix=self.share_prefix, engine=self.engine, counters=self.counters,
                                    reduce=lambda values, op="sum": reduce_over_ranks(self.trainer, values, op))
        self.train_record: EpochRecord | None = None  # the newest training epoch's experience
        self.tokenizer = self.chat = None
        self._policy: Any = None  # bound by connect: its full_weights context wraps every rollout
        self.pad_id = 0
        self.rank = 0  # the trainer's global rank, set in setup
        self.epoch = 0  # the training epoch whose experience is collected (or was, last)
        self._served: tuple[tuple[int, int], DataLoader] | None = None  # ((trainer, epoch), its loader)

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
        self.builder.collate_transforms.append(fn)

    def add_batch_source(self, source: BatchSource) -> None:
        """``source.batches(episodes)`` gives extra batches trained after each epoch's minibatches (CoPE's separate
        forecast update); under DDP the counts are evened out with ``source.empty()``."""
        self.builder.batch_sources.append(source)

    def setup(self, stage: str) -> None:
        if self.tokenizer is None:
            raise RuntimeError("RolloutDataModule.connect(policy) must be called before fitting")
        self.rank = self.trainer.global_rank if self.trainer is not None else 0
        if self.trainer is not None and self.trainer.lightning_module is not None:  # late binding: the module's budget
            self.max_row_tokens = self.trainer.lightning_module.max_tokens_per_microbatch

    def teardown(self, stage: str) -> None:
        self.collector.cancel()
        self.engine.close()

    def _world(self) -> int:
        return self.trainer.world_size if self.trainer is not None else 1

    # -- rollouts -------------------------------------------------------------------------------
    def _rollout(self, tasks: list[Task], groups: list[int], sampling: Sampling, seed: int, desc: str):
        """A rollout in the main thread under the weights as they are now (:func:`~cope.train.collect.sync.rollout_now`)."""
        return rollout_now(self.engine, tasks, groups, dataclasses.replace(sampling, seed=seed), trainer=self.trainer,
                           policy=self._policy, progress=self.progress, desc=desc)

    def sample_tasks(self, epoch: int) -> TaskStream:
        """The training tasks of ``epoch`` on this rank (``group_size`` copies each), their groups, and the epoch's
        task stream that drew them (this rank's, derived from the seed: the same after a resume), which then also
        gives the rollout's sampling seed and the minibatch order."""
        rng = stream(self.seed, "tasks", self.rank, epoch)
        tasks, groups = [], []
        for g in range(self.tasks_per_epoch):
            t = Task(self.env_name, self.train_split, rng.randrange(self.num_train_tasks))
            tasks += [t] * self.group_size
            groups += [g] * self.group_size
        return TaskStream(tasks, groups, rng)

    def train_dataloader(self) -> DataLoader:
        # The epoch being started: Lightning's `processed` count (`current_epoch` still names the saved epoch while
        # a fit restarted from a checkpoint asks for its first data, before its loop advances). One batch of
        # experience per epoch: Lightning asks twice when a fit restarts (before and after it resets its loops);
        # a second collection would spend rollouts for nothing.
        epoch = self.trainer.fit_loop.epoch_progress.current.processed
        key = (id(self.trainer), epoch)
        if self._served is not None and self._served[0] == key:
            return self._served[1]
        self.train_record = self.collect_epoch(epoch)
        served = [mb for _ in range(self.ppo_epochs) for mb in self.train_record.minibatches] + self.train_record.extra_batches
        loader = DataLoader(served, batch_size=None, shuffle=False, collate_fn=_identity)
        self._served = (key, loader)
        return loader

    def collect_epoch(self, epoch: int = 0) -> EpochRecord:
        """Epoch ``epoch``'s episodes from the collector, made its record (not yet scored); advances the counters."""
        got = self.collector.collect(epoch)
        self.epoch = epoch  # read by collate transforms while they run (CoPE's anchor stream of this epoch)
        return self.builder.build(epoch, got, pad_id=self.pad_id, max_row_tokens=self.max_row_tokens,
                                  off_policy=self.collector.off_policy)

    # -- validation -----------------------------------------------------------------------------
    @property
    def val_record(self) -> ValidationRecord | None:
        """The newest validation's held-out episodes (None before the first)."""
        return self.panel.record

    def val_dataloader(self) -> DataLoader:
        rank = self.trainer.global_rank if self.trainer is not None else 0
        chunks = self.panel.chunks(rank, self._world())
        return DataLoader(chunks, batch_size=None, shuffle=False, collate_fn=_identity)

    def evaluate(self, indices: list[int], first: bool = True) -> tuple[list[Episode], dict[str, float]]:
        """Greedy episodes on held-out tasks ``indices``; returns them with their ``val/*`` metrics and
        adds them to ``val_record`` (a new record when ``first``: the first chunk of a validation run)."""
        epoch = self.trainer.current_epoch if self.trainer is not None else 0
        seed = derive_seed(self.seed, "validation", self.rank, epoch) % 2**31  # greedy; a server engine still takes one
        return self.panel.evaluate(indices, epoch, first,
                                   lambda tasks, groups: self._rollout(tasks, groups, self.val_sampling, seed, "validation"))

    # -- checkpointing --------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """The counters (summed over ranks: the same on every rank) and the collector's state (the lagged one's
        discarded and in-flight episodes). No RNG state: the task streams are derived per (seed, rank, epoch); a
        checkpoint's, written by rank 0, would give every rank rank 0's stream."""
        return {"counters": self.counters.state_dict(), **self.collector.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.counters.load_state_dict(state["counters"])  # an older checkpoint's "rng" (rank 0's stream) is ignored
        self.collector.load_state_dict(state)
