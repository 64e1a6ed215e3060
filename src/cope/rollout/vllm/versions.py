"""The policy versions one trainer rank has loaded on a vLLM server: names, folders, holds (thread-safe).

With overlapped rollouts (``data.max_lag >= 1``) a background collection samples an older policy version while
the trainer syncs newer ones and validates with the newest, so several versions are served at once. Each
version has its own served name (``cope-rank<r>-v<version>``: the prefix cache keys blocks by the adapter's
identity, so weights never change under a name) and its own folder (``adapter-rank<r>-v<version>``: vLLM may
evict an adapter from its LoRA cache and load it again later *from its path*, so a folder is never overwritten).
A version stays loaded while it is the newest or has a hold (a queued or running collection, or a running
``rollout`` call on it); when neither is true any more it is unloaded and its folder deleted. Without holds
(``data.max_lag=0``) this is the engine's original behaviour: each sync loads the new version and unloads the
previous one.

How many versions the server must hold (:func:`check_lag`, :func:`lora_cache_args`): with ``max_lag = L >= 1``
up to L+1 versions are loaded (L held, the newest) and requests of two run at once (a collection's and the
main thread's validation, plus each sync's delivery probe). vLLM batches requests of at most ``--max-loras``
adapters at once (a third waits until a slot frees), so ``max_loras=1`` would make validation and collection
wait for each other; ``--max-cpu-loras`` (vLLM's LRU of loaded adapters, default ``max_loras``; an unloaded
name stays in it until evicted) is raised to L+2 so that no served version is evicted and reloaded from
disk at every switch. An attached server is the operator's to start with such settings.

All bookkeeping runs under one re-entrant lock (:attr:`ServedVersions.lock`); the engine takes it around a
whole sync and around a restart, so a collection thread never sees a half-loaded or half-restored table.
"""
from __future__ import annotations

import contextlib
import logging
import shutil
import threading
from collections import Counter
from pathlib import Path
from typing import Any, Callable, Iterator

from cope.rollout.vllm.client import RequestError, ServerError
from cope.rollout.vllm.server import VLLMError

log = logging.getLogger(__name__)


def loras_problem(max_lag: int, max_loras: int) -> str | None:
    """Why ``data.engine.max_loras`` is too small for ``data.max_lag`` (None: it is not; see the module doc)."""
    if max_lag >= 1 and max_loras < 2:
        return (f"too small for data.max_lag={max_lag}: a collection samples an older policy version while validation "
                "uses the newest, and vLLM batches requests of at most max_loras adapters at once; set "
                "data.engine.max_loras >= 2")
    return None


def check_lag(max_lag: int, max_loras: int) -> None:
    """:func:`loras_problem` raised as ValueError naming the key; a negative lag is refused too."""
    if max_lag < 0:
        raise ValueError(f"data.max_lag must be >= 0, got {max_lag}")
    problem = loras_problem(max_lag, max_loras)
    if problem is not None:
        raise ValueError(f"data.engine.max_loras={max_loras} is {problem}")


def lora_cache_args(max_lag: int, max_loras: int, extra_args: list[str] | None) -> list[str]:
    """A managed server's extra arguments with ``--max-cpu-loras`` L+2 for ``max_lag = L >= 1`` (unless given)."""
    args = list(extra_args or [])
    if max_lag >= 1 and not any(a.startswith("--max-cpu-loras") for a in args):
        args += ["--max-cpu-loras", str(max(max_loras, max_lag + 2))]
    return args


class ServedVersions:
    """The loaded versions of one rank's adapter.

    Args:
        workdir: run-local folder of the adapter folders.
        rank: the trainer's global rank (ranks sharing an attached server never share a name or a folder).
        post: ``post(path, body)`` to the current server (late-bound: the client changes at a restart).
    """

    def __init__(self, workdir: Path, rank: int, post: Callable[[str, dict], Any]):
        self.workdir, self.rank, self.post = Path(workdir).resolve(), int(rank), post
        self.lock = threading.RLock()
        self.folders: dict[int, Path] = {}  # loaded version -> its folder
        self.holds: Counter[int] = Counter()
        self.newest: int | None = None
        self.stale_unloads = 0  # unloads the server refused (it evicts adapters itself, least recent first)

    def name(self, version: int) -> str:
        """The served name of this rank's adapter at ``version``."""
        return f"cope-rank{self.rank}-v{int(version)}"

    def folder(self, version: int) -> Path:
        return self.workdir / f"adapter-rank{self.rank}-v{int(version)}"

    @property
    def loaded(self) -> list[int]:
        with self.lock:
            return sorted(self.folders)

    # -- loading and unloading ------------------------------------------------------------------
    def load(self, version: int, save: Callable[[Path], None]) -> None:
        """Write ``version``'s adapter to its own folder with ``save`` and load it under its own name."""
        with self.lock:
            folder = self.folder(version)
            if folder.exists():  # left by an earlier run in this workdir, or by a failed load: never reused
                shutil.rmtree(folder)
            folder.mkdir(parents=True)
            save(folder)
            try:
                self._post_load(version, folder)
            except BaseException:
                shutil.rmtree(folder, ignore_errors=True)
                raise
            self.folders[version] = folder

    def _post_load(self, version: int, folder: Path) -> None:
        try:
            self.post("/v1/load_lora_adapter", {"lora_name": self.name(version), "lora_path": str(folder)})
        except (ServerError, RuntimeError) as e:
            if "already" in str(e).lower():  # loaded before a restart of ours that the server survived
                return
            raise VLLMError(f"vLLM did not load the adapter from {folder}: {e}") from None

    def drop(self, version: int) -> None:
        """Unload ``version`` from the server and delete its folder (holds or not: the caller decides)."""
        with self.lock:
            folder = self.folders.pop(version, None)
            self.holds.pop(version, None)
            try:
                self.post("/v1/unload_lora_adapter", {"lora_name": self.name(version)})
            except (ServerError, RequestError, RuntimeError) as e:
                self.stale_unloads += 1
                log.warning("vLLM did not unload the adapter %s: %s", self.name(version), e)
            if folder is not None:
                shutil.rmtree(folder, ignore_errors=True)

    def reload(self) -> None:
        """Load every loaded version again, each from its own folder (after a server restart)."""
        with self.lock:
            for version, folder in sorted(self.folders.items()):
                self._post_load(version, folder)

    def make_newest(self, version: int) -> None:
        """``version`` (loaded) becomes the newest; the previous newest goes unless it is held."""
        with self.lock:
            if version not in self.folders:
                raise ValueError(f"policy version {version} is not loaded (loaded: {self.loaded})")
            previous, self.newest = self.newest, version
            if previous is not None and previous != version:
                self._drop_if_free(previous)

    def _drop_if_free(self, version: int) -> None:
        if version in self.folders and self.holds[version] <= 0 and version != self.newest:
            self.drop(version)

    # -- holds ----------------------------------------------------------------------------------
    def resolve(self, version: int | None) -> int:
        """``version``, or the newest for None; it must be loaded."""
        with self.lock:
            v = self.newest if version is None else int(version)
            if v is None or v not in self.folders:
                raise ValueError(f"policy version {version} is not loaded on the vLLM server (loaded: {self.loaded}; "
                                 f"newest: {self.newest}): only the newest and held versions are served")
            return v

    def hold(self, version: int) -> None:
        with self.lock:
            self.holds[self.resolve(version)] += 1

    def release(self, version: int) -> None:
        version = int(version)
        with self.lock:
            if self.holds[version] <= 0:
                self.holds.pop(version, None)
                raise ValueError(f"policy version {version} is not held (holds: {dict(+self.holds)})")
            self.holds[version] -= 1
            self._drop_if_free(version)

    @contextlib.contextmanager
    def using(self, version: int | None) -> Iterator[str]:
        """Hold ``version`` (None: the newest) for a rollout call; yields its served name."""
        with self.lock:
            v = self.resolve(version)
            self.holds[v] += 1
        try:
            yield self.name(v)
        finally:
            self.release(v)
