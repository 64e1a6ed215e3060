"""The rollout-engine seam: "given tasks, groups and sampling settings, return episodes and stats".

The DataModule asks an engine for each epoch's episodes (and for the greedy validation episodes);
it never touches the model. An engine is bound to the policy once (:meth:`RolloutEngine.connect`,
after the policy is built) and told when the trained weights changed (:meth:`RolloutEngine.sync`,
with the policy version = the optimizer step count).

Overlapped rollouts (``data.max_lag >= 1``): an engine with ``overlaps = True`` serves several policy versions
at once, so a background collection can sample an older version while training moves on. The DataModule
``hold``s a synced version for each queued collection and ``release``s it when that collection is done; a
``rollout(..., version=v)`` samples from that version (None: the newest). ``rollout`` may run in two threads
at once (the collection and the main thread's validation): each concurrent call gets its own env slots
(its own env batch, made on first use and reused by later calls; ``close`` closes them all, ``env_stats``
sums them). Engines:

* :class:`HFEngine` (here): generation in this process with transformers (``CachedSamplingActor``
  over the training model itself, so ``sync`` has nothing to do; a held version is sampled from a snapshot of the
  adapter taken at its hold, the base weights shared: :mod:`cope.rollout.sampler_copy`, whose rollouts report their
  log-probs), env steps in this process or in env worker processes, episodes in waves of at most
  ``max_live_episodes``;
* :class:`cope.rollout.vllm.engine.VLLMEngine`, a vLLM server, plugs in behind the same protocol (only
  generation differs; the env runtime, :func:`cope.rollout.loop.run_episodes` and the records stay).

Settings are small typed records, each given to the class that uses it: :class:`Sampling` (per
call: training rollouts sample, validation is greedy) and :class:`EnvRuntime` (where env instances
live and their deadlines).
"""
from __future__ import annotations

import contextlib
import logging
import threading
from dataclasses import dataclass
from typing import Any, Callable, ContextManager, Iterator, Protocol

from cope.envs.base import Env, Task
from cope.envs.runtime.batch import STATS, EnvBatch, InProcessEnvs
from cope.envs.runtime.pool import EnvWorkerPool
from cope.episode import Episode
from cope.rollout.loop import RolloutStats, Sampled, run_episodes

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

    overlaps: bool  # serves older policy versions while the weights train on (data.max_lag >= 1 needs it)
    # more capabilities, read by cope.capabilities.can (False when a class does not declare one): samples_in_process
    # (the training model's own weights, in this process), serves_adapters (a server, each version a LoRA adapter)

    def check_lag(self, max_lag: int) -> None:
        """Refuse ``data.max_lag`` (ValueError naming the key to change) when this engine cannot serve that many
        versions at once; called at config time, before :meth:`connect`."""

    def connect(self, policy: Any, rank: int = 0) -> None:
        """Bind the policy (model, tokenizer, chat scaffold) the episodes are sampled from; ``rank`` is the
        trainer's global rank (a server engine names what it keeps on a shared server by it)."""

    def sync(self, version: int) -> None:
        """The trained weights are now at ``version`` (optimizer steps): make it the newest served version. The
        previous newest stays served while it is held."""

    def hold(self, version: int) -> None:
        """Keep the loaded ``version`` served for a queued collection (a count; raises if it is not loaded)."""

    def release(self, version: int) -> None:
        """Drop one hold of ``version``; with none left and a newer version synced, it is no longer served."""

    def rollout(self, tasks: list[Task], groups: list[int], sampling: Sampling,
                progress: Callable[[int], None] | None = None, version: int | None = None) -> tuple[list[Episode], RolloutStats]:
        """One episode per task, in input order (``groups[i]``: the group of episode ``i``), sampled from policy
        ``version`` (None: the newest; else a loaded one)."""

    def env_stats(self) -> dict[str, int]:
        """Cumulative env-runtime events (restarts, timeouts, ...; :data:`cope.envs.runtime.batch.STATS`)."""

    # Optional (class attribute ``lends_actor = True``): ``actor(sampling, seed, version=None, logprobs=False)``, a
    # context manager yielding an actor of cope.rollout.loop.run_episodes on that version for a block of calls (the
    # branching collector's waves; an older held version with data.max_lag >= 1).
    # Optional (class attribute ``completes = True``): plain completions of token contexts, no env (RWML's
    # world-model predictions, cope.algos.rwml). Engines without it are refused by algo=rwml.
    def complete(self, contexts: list[list[int]], sampling: Sampling, n: int = 1,
                 batch_size: int | None = None) -> list[list[Sampled | BaseException]]:
        """``n`` continuations of each context (token ids in, sampled ids out, each ending with a stop id when one
        was sampled), from the newest version: ``out[i]`` holds those of ``contexts[i]``; an item is an exception
        where generation failed for it (a server's request). ``batch_size``: rows sampled at once (None: all)."""

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

    overlaps = True  # a held version is sampled from its own snapshot (cope.rollout.sampler_copy), the newest from the model
    samples_in_process = True  # the training model's own weights (full fine-tuning and trainer=fsdp need it)
    serves_adapters = False
    completes = True  # plain completions of token contexts (complete): RWML's world-model predictions
    lends_actor = True  # a sampling actor on a version for a block of calls (actor): the branching collector's waves

    def __init__(self, env: Callable[[], Env], runtime: EnvRuntime, max_context: int, instructions: str | None = None):
        if max_context < 1:
            raise ValueError(f"data.max_context must be >= 1, got {max_context}")
        self.env_factory, self.runtime, self.max_context, self.instructions = env, runtime, max_context, instructions
        self.policy = None
        self.version: int | None = None  # of the newest sync
        self._copies: dict[int, Any] = {}  # held versions: a sampler copy of the model at each (data.max_lag >= 1)
        self._holds: dict[int, int] = {}
        self._batches: list[EnvBatch] = []  # every env batch made (one per concurrent rollout call)
        self._free: list[EnvBatch] = []  # those no call uses now
        self._lock = threading.Lock()
        self._stats_before = dict.fromkeys(STATS, 0)  # of env batches closed earlier

    def check_lag(self, max_lag: int) -> None:
        """Any lag: each held version is a snapshot of the adapter (the base shared), refused with full fine-tuning or
        sharding at config time (:data:`cope.run.config_rules.RULES`)."""

    def connect(self, policy: Any, rank: int = 0) -> None:
        self.policy = policy

    def sync(self, version: int) -> None:
        """Nothing to load: the newest version is the training model itself (the version is only recorded)."""
        self.version = version

    def hold(self, version: int) -> None:
        """Keep ``version`` for a queued collection: on its first hold (right after its sync, before any update) a
        sampler copy of the model is taken (:func:`cope.rollout.sampler_copy.snapshot`: the trainable tensors copied,
        the base shared), from which ``rollout(..., version=version)`` samples while the model trains on."""
        from cope.rollout.sampler_copy import snapshot

        with self._lock:
            if version not in self._copies:
                if version != self.version:
                    raise ValueError(f"the in-process engine can hold only its current version ({self.version}) or one "
                                     f"it holds, not version {version}")
                self._copies[version] = snapshot(self.policy.model)
            self._holds[version] = self._holds.get(version, 0) + 1

    def release(self, version: int) -> None:
        """Drop one hold of ``version``; its sampler copy goes with the last."""
        with self._lock:
            if not self._holds.get(version):
                raise ValueError(f"version {version} is not held")
            self._holds[version] -= 1
            if not self._holds[version]:
                del self._holds[version], self._copies[version]

    def _new_batch(self) -> EnvBatch:
        rt = self.runtime
        return (EnvWorkerPool(self.env_factory, rt.workers, rt.step_timeout_s, rt.reset_timeout_s, rt.python)
                if rt.workers > 0 else InProcessEnvs(self.env_factory))

    def env_batch(self) -> EnvBatch:
        """The env instances of the episode slots (in this process or in worker processes), made on first use (the
        first of them when concurrent rollout calls made several)."""
        with self._lock:
            if not self._batches:
                self._batches.append(self._new_batch())
                self._free.append(self._batches[0])
            return self._batches[0]

    @contextlib.contextmanager
    def slots(self) -> Iterator[EnvBatch]:
        """An env batch no other rollout call uses now (a free one, else a new one) for the length of one call."""
        with self._lock:
            envs = self._free.pop(0) if self._free else None
        if envs is None:
            envs = self._new_batch()
            with self._lock:
                self._batches.append(envs)
        try:
            yield envs
        finally:
            with self._lock:
                self._free.append(envs)

    def rollout(self, tasks: list[Task], groups: list[int], sampling: Sampling,
                progress: Callable[[int], None] | None = None, version: int | None = None) -> tuple[list[Episode], RolloutStats]:
        wave = self.runtime.max_live_episodes or len(tasks)
        eps, stats = [], RolloutStats()
        # a held version's rollouts carry their behaviour log-probs; the DataModule enters the whole weights
        with self._sampler(sampling, sampling.seed, version, False, whole=False) as actor, self.slots() as envs:
            for s in range(0, len(tasks), wave):  # each wave reuses env slots 0..wave-1
                e, st = run_episodes(envs, tasks[s: s + wave], groups[s: s + wave], actor, self.policy.tokenizer,
                                     self.policy.chat, self.max_context, sampling.max_action_tokens, progress=progress,
                                     chunks=self.runtime.chunks, instructions=self.instructions)
                eps += e
                stats.add(st)
        return eps, stats

    def actor(self, sampling: Sampling, seed: int | None, version: int | None = None,
              logprobs: bool = False) -> ContextManager[Any]:
        """A ``CachedSamplingActor`` for a block of calls (the branching collector's waves): on the training model as
        it is now (``version`` None or the newest: under its whole weights, in eval mode for the block) or on a held
        version's sampler copy (``version``: overlapped rollouts, whose actions then always carry their log-probs).
        ``seed`` seeds its stream (temperature 0: none); ``logprobs``: report the sampled tokens' log-probs."""
        return self._sampler(sampling, seed, version, logprobs, whole=True)

    @contextlib.contextmanager
    def _sampler(self, sampling: Sampling, seed: int | None, version: int | None, logprobs: bool,
                 whole: bool) -> Iterator[Any]:
        from cope.rollout.hf_actor import CachedSamplingActor  # torch-side; the engine module itself stays light

        if self.policy is None:
            raise RuntimeError("HFEngine.connect(policy) must be called before sampling")
        with self._lock:
            copy = self._copies.get(version) if version is not None else None
        if version is not None and copy is None and version != self.version:
            raise ValueError(f"version {version} is neither held nor the current one ({self.version})")
        model = copy if copy is not None else self.policy.model
        was_training = model.training
        model.eval()
        try:
            with self.policy.full_weights() if whole and copy is None else contextlib.nullcontext():
                yield CachedSamplingActor(model, self.policy.pad_id, self.policy.chat.stop_ids,
                                          sampling.max_action_tokens, sampling.temperature, sampling.top_p,
                                          seed=seed if sampling.temperature > 0 else None,
                                          logprobs=logprobs or copy is not None)
        finally:
            model.train(was_training)

    def complete(self, contexts: list[list[int]], sampling: Sampling, n: int = 1,
                 batch_size: int | None = None) -> list[list[Sampled]]:
        """``n`` continuations of each context from the training model as it is now (the newest version), token-in /
        token-out (:meth:`RolloutEngine.complete`): each row a fresh ``CachedSamplingActor`` call of at most
        ``sampling.max_action_tokens`` ids, ``batch_size`` rows at once (the ``n`` copies of a context are rows of
        their own; None: all rows at once), seeded from ``sampling.seed`` (one generator for the whole call, so the
        same contexts and seed give the same samples). Under the policy's whole weights (``trainer=fsdp``); the caller
        enters the training precision. No log-probs (the scoring pass computes them)."""
        from cope.rollout.hf_actor import CachedSamplingActor

        if self.policy is None:
            raise RuntimeError("HFEngine.connect(policy) must be called before complete")
        if n < 1 or (batch_size is not None and batch_size < 1):
            raise ValueError(f"HFEngine.complete: n and batch_size must be >= 1, got n={n}, batch_size={batch_size}")
        rows = [list(c) for c in contexts for _ in range(n)]
        if any(not r for r in rows):
            raise ValueError("HFEngine.complete: every context needs at least one token")
        model, chat = self.policy.model, self.policy.chat
        actor = CachedSamplingActor(model, self.policy.pad_id, chat.stop_ids, sampling.max_action_tokens,
                                    sampling.temperature, sampling.top_p,
                                    seed=sampling.seed if sampling.temperature > 0 else None)
        was_training = model.training
        model.eval()
        out: list[list[int]] = []
        step = batch_size or max(len(rows), 1)
        try:
            with self.policy.full_weights():
                for s in range(0, len(rows), step):
                    actor.reset()  # each batch its own cache; the generator goes on
                    out += actor(rows[s: s + step], keys=list(range(len(rows[s: s + step]))))
        finally:
            model.train(was_training)
        return [[Sampled(ids) for ids in out[i * n: (i + 1) * n]] for i in range(len(contexts))]

    def env_stats(self) -> dict[str, int]:
        """Summed over every env batch, open or closed."""
        with self._lock:
            batches = list(self._batches)
        return {k: self._stats_before[k] + sum(b.stats.get(k, 0) for b in batches) for k in STATS}

    def close(self) -> None:
        """Close every env batch (call it when no rollout runs)."""
        with self._lock:
            batches, self._batches, self._free = self._batches, [], []
            for b in batches:
                for k in STATS:
                    self._stats_before[k] += b.stats.get(k, 0)
        for b in batches:
            b.close()
