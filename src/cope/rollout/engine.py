"""The rollout-engine seam: "given tasks, groups and sampling settings, return episodes and stats".

The DataModule asks an engine for each epoch's episodes (and for the greedy validation episodes);
it never touches the model. An engine is bound to the policy once (:meth:`RolloutEngine.connect`,
after the policy is built) and told when the trained weights changed (:meth:`RolloutEngine.sync`,
with the policy version = the optimizer step count). Engines:

* :class:`HFEngine` (here): generation in this process with transformers (``CachedSamplingActor``
  over the training model itself, so ``sync`` has nothing to do), env steps in this process or in
  env worker processes, episodes in waves of at most ``max_live_episodes``;
* a vLLM server engine plugs in behind the same protocol (only generation differs; the env runtime,
  :func:`cope.rollout.loop.run_episodes` and the records stay).

Settings are small typed records, each given to the class that uses it: :class:`Sampling` (per
call: training rollouts sample, validation is greedy) and :class:`EnvRuntime` (where env instances
live and their deadlines).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable, Protocol

from cope.envs.base import Env, Task
from cope.envs.runtime.batch import STATS, EnvBatch, InProcessEnvs
from cope.envs.runtime.pool import EnvWorkerPool
from cope.episode import Episode
from cope.rollout.loop import RolloutStats, run_episodes

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Sampling:
    """How actions are sampled in one rollout call.

    temperature: 0 is greedy; top_p: nucleus mass in (0, 1]; max_action_tokens: per-action cap;
    seed: the sampling stream of this call (None: greedy needs none)."""

    temperature: float = 1.0
    top_p: float = 1.0
    max_action_tokens: int = 16
    seed: int | None = None

    def __post_init__(self):
        for key, bad, rule in (("temperature", self.temperature < 0, ">= 0"), ("top_p", not 0 < self.top_p <= 1, "in (0, 1]"),
                               ("max_action_tokens", self.max_action_tokens < 1, ">= 1")):
            if bad:
                raise ValueError(f"data.sampling.{key} must be {rule}, got {getattr(self, key)}")


@dataclass(frozen=True)
class EnvRuntime:
    """Where the env instances of the episode slots live.

    workers: 0 steps them in this process, one after another; N > 0 in N worker processes
    (:mod:`cope.envs.runtime.pool`: parallel steps, deadlines, restarts, replay); step_timeout_s /
    reset_timeout_s: deadlines (workers only); python: interpreter of the workers (None: this one);
    max_live_episodes: run a call's episodes in waves of at most this many (None: all at once);
    chunks: 2 overlaps generation with env steps (gains only with workers)."""

    workers: int = 0
    step_timeout_s: float = 60.0
    reset_timeout_s: float = 300.0
    python: str | None = None
    max_live_episodes: int | None = None
    chunks: int = 1

    def __post_init__(self):
        if self.workers < 0:
            raise ValueError(f"data.env_runtime.workers must be >= 0, got {self.workers}")
        for key in ("step_timeout_s", "reset_timeout_s"):
            if getattr(self, key) <= 0:
                raise ValueError(f"data.env_runtime.{key} must be > 0, got {getattr(self, key)}")
        if self.max_live_episodes is not None and self.max_live_episodes < 1:  # 0 is not "unlimited": that is null
            raise ValueError(f"data.env_runtime.max_live_episodes must be null (all at once) or >= 1, got {self.max_live_episodes}")
        if self.chunks < 1:
            raise ValueError(f"data.env_runtime.chunks must be >= 1, got {self.chunks}")


class RolloutEngine(Protocol):
    """What the DataModule needs from a rollout engine. Optional class attribute ``reports_logprobs``
    (default False): every sampled action carries the sampler's own log-probs (``Step.sampler_logprobs``)."""

    def connect(self, policy: Any, rank: int = 0) -> None:
        """Bind the policy (model, tokenizer, chat scaffold) the episodes are sampled from; ``rank`` is the
        trainer's global rank (a server engine names what it keeps on a shared server by it)."""

    def sync(self, version: int) -> None:
        """The trained weights are now at ``version`` (optimizer steps): make the next rollouts use them."""

    def rollout(self, tasks: list[Task], groups: list[int], sampling: Sampling,
                progress: Callable[[int], None] | None = None) -> tuple[list[Episode], RolloutStats]:
        """One episode per task, in input order (``groups[i]``: the group of episode ``i``)."""

    def env_stats(self) -> dict[str, int]:
        """Cumulative env-runtime events (restarts, timeouts, ...; :data:`cope.envs.runtime.batch.STATS`)."""

    def close(self) -> None:
        """Release env instances and worker processes; the engine may be used again afterwards. A server
        engine may keep its server up (validation then fit must not reload the model; it ends with the process)."""


class HFEngine:
    """In-process generation with transformers over the training model (see the module doc).

    Args:
        env: factory of env instances (one per concurrent episode).
        runtime: where the env instances live.
        max_context: context budget in tokens (see the overflow policy in :mod:`cope.rollout.loop`).
        instructions: system prompt replacing the env's own (None keeps it).
    """

    def __init__(self, env: Callable[[], Env], runtime: EnvRuntime, max_context: int, instructions: str | None = None):
        if max_context < 1:
            raise ValueError(f"data.max_context must be >= 1, got {max_context}")
        self.env_factory, self.runtime, self.max_context, self.instructions = env, runtime, max_context, instructions
        self.policy = None
        self._envs: EnvBatch | None = None
        self._stats_before = dict.fromkeys(STATS, 0)  # of env batches closed earlier

    def connect(self, policy: Any, rank: int = 0) -> None:
        self.policy = policy

    def sync(self, version: int) -> None:
        """Nothing to do: generation runs on the training model itself."""

    def env_batch(self):
        """The env instances of the episode slots (in this process or in worker processes), made on first use."""
        if self._envs is None:
            rt = self.runtime
            self._envs = (EnvWorkerPool(self.env_factory, rt.workers, rt.step_timeout_s, rt.reset_timeout_s, rt.python)
                          if rt.workers > 0 else InProcessEnvs(self.env_factory))
        return self._envs

    def rollout(self, tasks: list[Task], groups: list[int], sampling: Sampling,
                progress: Callable[[int], None] | None = None) -> tuple[list[Episode], RolloutStats]:
        from cope.rollout.hf_actor import CachedSamplingActor  # torch-side; the engine module itself stays light

        if self.policy is None:
            raise RuntimeError("HFEngine.connect(policy) must be called before rollout")
        model, chat = self.policy.model, self.policy.chat
        actor = CachedSamplingActor(model, self.policy.pad_id, chat.stop_ids, sampling.max_action_tokens,
                                    sampling.temperature, sampling.top_p,
                                    seed=sampling.seed if sampling.temperature > 0 else None)
        was_training = model.training
        model.eval()
        wave = self.runtime.max_live_episodes or len(tasks)
        eps, stats = [], RolloutStats()
        try:
            for s in range(0, len(tasks), wave):  # each wave reuses env slots 0..wave-1
                e, st = run_episodes(self.env_batch(), tasks[s: s + wave], groups[s: s + wave], actor,
                                     self.policy.tokenizer, chat, self.max_context, sampling.max_action_tokens,
                                     progress=progress, chunks=self.runtime.chunks, instructions=self.instructions)
                eps += e
                stats.add(st)
        finally:
            model.train(was_training)
        return eps, stats

    def env_stats(self) -> dict[str, int]:
        now = dict(self._envs.stats) if self._envs is not None else dict.fromkeys(STATS, 0)
        return {k: self._stats_before[k] + now.get(k, 0) for k in STATS}

    def close(self) -> None:
        if self._envs is not None:
            self._stats_before = self.env_stats()
            self._envs.close()
            self._envs = None
