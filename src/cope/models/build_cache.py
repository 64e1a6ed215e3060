"""Build a cached folder once, even when several processes ask for it at the same time.

The tiny model's warm start and the GGUF conversion are minutes of work whose result is a folder keyed
by what went into it. Runs started side by side (a study's parallel jobs, DDP ranks, test workers) used to
build the same folder each, and all but the first failed at the final rename. Here the first process
takes an exclusive lock (``fcntl.flock`` on ``<folder>.lock`` beside it) and builds; the others wait on
the lock and then find the finished folder. The build itself writes into a temporary sibling that is
renamed into place, so a killed build never leaves a half-written folder that looks finished (the lock
dies with its process).
"""
from __future__ import annotations

import fcntl
import logging
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path

log = logging.getLogger(__name__)


def build_once(out: Path, build: Callable[[Path], None], ready: str = "config.json") -> bool:
    """Make sure ``out`` exists, calling ``build(tmp)`` at most once across processes; True if this call built it.

    ``build`` fills the folder it is given (a fresh temporary sibling of ``out``); ``ready`` is the file whose
    presence marks a finished folder."""
    out = Path(out)
    if (out / ready).is_file():
        return False
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.with_name(out.name + ".lock"), "w") as lock:
        t0 = time.perf_counter()
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.info("waiting for another process to finish building %s", out)
            fcntl.flock(lock, fcntl.LOCK_EX)
            log.info("waited %.0f s for %s", time.perf_counter() - t0, out)
        try:
            if (out / ready).is_file():  # built by the process we waited for
                return False
            tmp = out.with_name(f"{out.name}.tmp{os.getpid()}")
            shutil.rmtree(tmp, ignore_errors=True)
            try:
                build(tmp)
                if out.exists():  # a stale unfinished folder (no `ready` file): replace it
                    shutil.rmtree(out)
                tmp.rename(out)  # atomic on one file system
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
            return True
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
