"""The on-policy DataModule: every training epoch collects fresh experience with the current policy.

``train_dataloader`` (reloaded every epoch: the trainer config sets
``reload_dataloaders_every_n_epochs=1``) samples ``tasks_per_epoch`` tasks, runs ``group_size``
episodes per task (same task inside a group) in lock-step, turns rewards into group-relative
advantages, cuts the episodes into minibatches, lets registered transforms add targets (CoPE),
asks the LightningModule to score every minibatch once before any update (old log-probs, entropy,
reference log-probs), lets scored transforms reshape advantages (EMPG), and serves the minibatches
``ppo_epochs`` times. Each DDP rank collects its own groups from a rank-distinct task stream;
counters are summed over ranks, never reset, and saved in checkpoints.

Model-dependent things (tokenizer, chat scaffold) are bound late through :meth:`connect`.
"""
from __future__ import annotations

import logging
import random
import time
from typing import Callable

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader

from cope.advantages import group_advantages
from cope.batch import collate
from cope.envs.base import Env, Task
from cope.envs.runtime.batch import STATS, InProcessEnvs
from cope.envs.runtime.pool import EnvWorkerPool
from cope.episode import Episode
from cope.generation import CachedSamplingActor
from cope.rollout import RolloutStats, run_episodes
from cope.rollout_metrics import episode_metrics

log = logging.getLogger(__name__)
COUNTERS = ("episodes", "env_steps", "generated_tokens", "train_tokens")
CollateTransform = Callable[[dict, list[Episode]], dict]
ScoredTransform = Callable[[list[dict], list[Episode]], None]


def _identity(x):
    return x


class RolloutDataModule(pl.LightningDataModule):
    """On-policy rollouts as a DataModule.

    Args:
        env: factory of env instances (a Hydra ``_partial_``); one instance per concurrent episode.
        tasks_per_epoch: B, tasks sampled per rank per epoch.
        group_size: G, episodes per task (GRPO group).
        minibatch_size: episodes per optimizer step.
        ppo_epochs: passes over the epoch's minibatches (>1 makes the clipped ratio matter).
        max_context: context budget in tokens; see the overflow policy in :mod:`cope.rollout`.
        max_action_tokens: per-action token cap.
        temperature: sampling temperature for training rollouts (validation is greedy).
        top_p: nucleus mass for training rollouts.
        advantage_mode: ``grpo`` (std-normalized) or ``drgrpo``.
        val_tasks: held-out tasks evaluated greedily at each validation (a fixed panel: indices 0..n-1).
        val_batch_size: held-out episodes run together.
        seed: task-sampling seed (combined with the rank).
        progress: show a progress bar while collecting rollouts.
        env_workers: 0 steps the env instances in this process, one after another; N > 0 runs them in
            N worker processes (:mod:`cope.envs.runtime.pool`: parallel steps, deadlines, restarts).
        env_step_timeout_s / env_reset_timeout_s: deadlines of one step / reset (workers only).
        env_python: interpreter of the env workers (default: this one).
        max_live_episodes: at most this many episodes run at once (env instances, generation batch);
            the epoch's episodes run in waves. None: all at once.
        rollout_chunks: 2 overlaps generation with env steps (needs env_workers > 0 to gain anything).
        instructions: system prompt replacing the env's own (its rules and action format); None keeps it.
    """

    def __init__(
        self,
        env: Callable[[], Env],
        tasks_per_epoch: int = 8,
        group_size: int = 4,
        minibatch_size: int = 16,
        ppo_epochs: int = 1,
        max_context: int = 2048,
        max_action_tokens: int = 16,
        temperature: float = 1.0,
        top_p: float = 1.0,
        advantage_mode: str = "grpo",
        val_tasks: int = 64,
        val_batch_size: int = 64,
        seed: int = 0,
        progress: bool = True,
        env_workers: int = 0,
        env_step_timeout_s: float = 60.0,
        env_reset_timeout_s: float = 300.0,
        env_python: str | None = None,
        max_live_episodes: int | None = None,
        rollout_chunks: int = 1,
        instructions: str | None = None,
    ):
        super().__init__()
        for name, v in dict(tasks_per_epoch=tasks_per_epoch, group_size=group_size, minibatch_size=minibatch_size,
                            ppo_epochs=ppo_epochs, max_context=max_context, max_action_tokens=max_action_tokens,
                            val_batch_size=val_batch_size, rollout_chunks=rollout_chunks).items():
            if v < 1:
                raise ValueError(f"data.{name} must be >= 1, got {v}")
        if max_live_episodes is not None and max_live_episodes < 1:  # 0 is not "unlimited": that is null
            raise ValueError(f"data.max_live_episodes must be null (all at once) or >= 1, got {max_live_episodes}")
        if val_tasks < 0 or temperature < 0 or not 0 < top_p <= 1:
            raise ValueError("data.val_tasks and data.temperature must be >= 0 and data.top_p in (0, 1]")
        self.env_factory = env
        self.tasks_per_epoch, self.group_size, self.minibatch_size = tasks_per_epoch, group_size, minibatch_size
        self.ppo_epochs, self.max_context, self.max_action_tokens = ppo_epochs, max_context, max_action_tokens
        self.temperature, self.top_p, self.advantage_mode = temperature, top_p, advantage_mode
        self.val_tasks, self.val_batch_size, self.seed, self.progress = val_tasks, val_batch_size, seed, progress
        try:  # fail fast on a bad mode, naming the key (data.advantage_mode defaults to ${algo.advantage_mode})
            group_advantages(torch.zeros(1), torch.zeros(1, dtype=torch.long), mode=advantage_mode)
        except ValueError as e:
            raise ValueError(f"data.advantage_mode (algo.advantage_mode): {e}") from None
        self.counters = {k: 0 for k in COUNTERS}
        self.last_episodes: list[Episode] = []
        self.last_val_episodes: list[Episode] = []
        self.last_rollout_metrics: dict[str, float] = {}
        self._collate_transforms: list[CollateTransform] = []
        self._scored_transforms: list[ScoredTransform] = []
        self._rng = random.Random(seed)
        self._served: tuple[tuple[int, int], DataLoader] | None = None  # (policy version, its epoch's loader)
        if env_workers < 0:
            raise ValueError(f"data.env_workers must be >= 0, got {env_workers}")
        if env_step_timeout_s <= 0 or env_reset_timeout_s <= 0:
            raise ValueError("data.env_step_timeout_s and data.env_reset_timeout_s must be > 0")
        self.env_workers, self.env_python = env_workers, env_python
        self.env_step_timeout_s, self.env_reset_timeout_s = env_step_timeout_s, env_reset_timeout_s
        self.max_live_episodes, self.rollout_chunks = max_live_episodes, rollout_chunks
        self.instructions = instructions
        self._envs = None  # InProcessEnvs or EnvWorkerPool, made on first use
        self._env_stats_seen = dict.fromkeys(STATS, 0)
        self.tokenizer = self.chat = None
        self.pad_id = 0
        probe = env()
        self.env_name = probe.name
        self.num_train_tasks, self.num_test_tasks = probe.num_tasks("train"), probe.num_tasks("test")
        if max_live_episodes is None and getattr(probe, "max_instances", None):
            self.max_live_episodes = int(probe.max_instances)  # memory-heavy env: run the episodes in waves
            log.info("%s: at most %d live episodes at once (the env's max_instances; data.max_live_episodes overrides)",
                     probe.name, self.max_live_episodes)
        probe.close()

    # -- wiring ---------------------------------------------------------------------------------
    def connect(self, tokenizer, chat) -> None:
        self.tokenizer, self.chat, self.pad_id = tokenizer, chat, int(tokenizer.pad_token_id)

    def add_collate_transform(self, fn: CollateTransform) -> None:
        self._collate_transforms.append(fn)

    def add_scored_transform(self, fn: ScoredTransform) -> None:
        self._scored_transforms.append(fn)

    def setup(self, stage: str) -> None:
        if self.tokenizer is None:
            raise RuntimeError("RolloutDataModule.connect(tokenizer, chat) must be called before fitting")
        rank = self.trainer.global_rank if self.trainer is not None else 0
        self._rng = random.Random(self.seed * 1_000_003 + rank)  # rank-distinct task streams

    def env_batch(self):
        """The env instances of the episode slots (in this process or in worker processes)."""
        if self._envs is None:
            if self.env_workers > 0:
                self._envs = EnvWorkerPool(self.env_factory, self.env_workers, self.env_step_timeout_s,
                                           self.env_reset_timeout_s, self.env_python)
            else:
                self._envs = InProcessEnvs(self.env_factory)
            self._env_stats_seen = dict.fromkeys(STATS, 0)
        return self._envs

    def teardown(self, stage: str) -> None:
        if self._envs is not None:
            self._envs.close()
            self._envs = None

    # -- rollouts -------------------------------------------------------------------------------
    def run(self, model, tasks: list[Task], groups: list[int], temperature: float, desc: str) -> tuple[list[Episode], dict]:
        show = self.progress and (self.trainer is None or self.trainer.is_global_zero)
        bar = None
        if show:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(tasks), desc=desc, leave=False, dynamic_ncols=True)
        sample_seed = self._rng.randrange(2**31)
        actor = CachedSamplingActor(model, self.pad_id, self.chat.stop_id, self.max_action_tokens, temperature, self.top_p,
                                    seed=sample_seed if temperature > 0 else None)
        was_training = model.training
        model.eval()
        wave = self.max_live_episodes or len(tasks)
        eps, stats = [], RolloutStats()
        try:
            for s in range(0, len(tasks), wave):  # each wave reuses env slots 0..wave-1
                e, st = run_episodes(self.env_batch(), tasks[s: s + wave], groups[s: s + wave], actor, self.tokenizer,
                                     self.chat, self.max_context, self.max_action_tokens,
                                     progress=bar.update if bar else None, chunks=self.rollout_chunks,
                                     instructions=self.instructions)
                eps += e
                stats.add(st)
        finally:
            model.train(was_training)
            if bar:
                bar.close()
        return eps, stats

    def _sample_tasks(self) -> tuple[list[Task], list[int]]:
        tasks, groups = [], []
        for g in range(self.tasks_per_epoch):
            t = Task(self.env_name, "train", self._rng.randrange(self.num_train_tasks))
            tasks += [t] * self.group_size
            groups += [g] * self.group_size
        return tasks, groups

    def _reduce_sum(self, values: list[float]) -> list[float]:
        if self.trainer is None or self.trainer.world_size == 1:
            return values
        t = torch.tensor(values, dtype=torch.float64, device=self.trainer.strategy.root_device)
        return self.trainer.strategy.reduce(t, reduce_op="sum").tolist()

    def train_dataloader(self) -> DataLoader:
        # One batch of experience per policy version: Lightning asks twice when a fit restarts from a
        # checkpoint (before and after it resets its loops), with no optimizer step in between; a
        # second collection would spend rollouts and shift the task stream against an uninterrupted run.
        version = (id(self.trainer), self.trainer.global_step)
        if self._served is not None and self._served[0] == version:
            return self._served[1]
        loader = self._collect_epoch()
        self._served = (version, loader)
        return loader

    def _collect_epoch(self) -> DataLoader:
        module = self.trainer.lightning_module
        t0 = time.perf_counter()
        tasks, groups = self._sample_tasks()
        eps, stats = self.run(module.policy.model, tasks, groups, self.temperature, "rollouts")
        t_roll = time.perf_counter() - t0
        adv, adv_metrics = group_advantages(
            torch.tensor([e.reward for e in eps]), torch.tensor(groups), mode=self.advantage_mode,
            valid=torch.tensor([not e.aborted for e in eps]),
        )
        for e, a in zip(eps, adv.tolist()):
            e.advantage = a
        order = list(range(len(eps)))
        self._rng.shuffle(order)
        minibatches = []
        for s in range(0, len(order), self.minibatch_size):
            idx = order[s: s + self.minibatch_size]
            mb = collate([eps[i] for i in idx], self.pad_id, indices=idx)
            for fn in self._collate_transforms:
                mb = fn(mb, eps)
            minibatches.append(mb)
        module.score_minibatches(minibatches)
        for fn in self._scored_transforms:
            fn(minibatches, eps)
        train_tokens = sum(int(mb["input_ids"].ne(self.pad_id).sum()) for mb in minibatches) * self.ppo_epochs
        inc = self._reduce_sum([len(eps), stats.env_steps, stats.generated_tokens, train_tokens])
        for k, v in zip(COUNTERS, inc):
            self.counters[k] += int(v)
        self.last_episodes = eps
        m = episode_metrics(eps, prefix="rollout")
        m.update(adv_metrics)
        env_stats = self._env_stats_delta()
        m.update({
            "env/errors": float(stats.env_errors),
            "env/aborted_episodes": float(sum(e.aborted for e in eps)),
            "env/groups_shrunk": float(len({e.group for e in eps if e.aborted})),
            **{f"env/{k}": float(v) for k, v in env_stats.items()},
            "perf/rollout_seconds": t_roll,
            "perf/tokens_per_s": stats.generated_tokens / max(stats.gen_seconds, 1e-9),
            "perf/env_seconds": stats.env_seconds,
        })
        m.update({f"counters/{k}": float(v) for k, v in self.counters.items()})
        self.last_rollout_metrics = m
        served = [mb for _ in range(self.ppo_epochs) for mb in minibatches]
        return DataLoader(served, batch_size=None, shuffle=False, collate_fn=_identity)

    def _env_stats_delta(self) -> dict[str, int]:
        """Worker-pool events (restarts, timeouts, ...) since the last call."""
        now = dict(self._envs.stats) if self._envs is not None else dict.fromkeys(STATS, 0)
        delta = {k: now[k] - self._env_stats_seen.get(k, 0) for k in STATS}
        self._env_stats_seen = now
        return delta

    # -- validation -----------------------------------------------------------------------------
    def val_dataloader(self) -> DataLoader:
        rank = self.trainer.global_rank if self.trainer is not None else 0
        world = self.trainer.world_size if self.trainer is not None else 1
        n = min(self.val_tasks, self.num_test_tasks)
        mine = list(range(n))[rank::world]  # each rank evaluates its shard of the fixed panel
        chunks = [mine[s: s + self.val_batch_size] for s in range(0, len(mine), self.val_batch_size)]
        return DataLoader(chunks, batch_size=None, shuffle=False, collate_fn=_identity)

    def evaluate(self, model, indices: list[int]) -> tuple[list[Episode], dict[str, float]]:
        """Greedy episodes on held-out tasks ``indices``; returns the episodes and ``val/*`` metrics."""
        tasks = [Task(self.env_name, "test", i) for i in indices]
        eps, _ = self.run(model, tasks, list(range(len(tasks))), 0.0, "validation")
        return eps, episode_metrics(eps, prefix="val")

    # -- checkpointing --------------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {"counters": dict(self.counters), "rng": self._rng.getstate()}

    def load_state_dict(self, state: dict) -> None:
        self.counters.update(state["counters"])
        self._rng.setstate(_as_tuple(state["rng"]))


def _as_tuple(x):
    return tuple(_as_tuple(v) for v in x) if isinstance(x, (list, tuple)) else x
