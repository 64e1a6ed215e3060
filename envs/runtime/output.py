"""A bound on what envs print into the run's log: the first ``limit`` bytes pass, the rest is counted and dropped.

Env engines print (game interpreters, JVMs, C libraries, warnings), and a broken one prints without end:
TextWorld's interpreter fed ``\\help`` wrote 16 GB to stdout in 20 s, and with env workers 566 MB of run log
in 20 s was seen. :class:`OutputCap` drains pipes on daemon threads and forwards the first ``limit`` bytes
(over all of its pipes together) to a file descriptor, the process's stderr; past the limit it writes one
notice line and from then on only counts. Below the limit it drains as fast as anything writes; past it,
one read (1 MiB) per 20 ms: a writer that keeps on printing then waits on the full pipe (at most 50 MB/s
get through, to be dropped), so an endless printer costs the reader little CPU (a 5 s flood: 4 s of the
parent's CPU drained at full speed, 0.3 s so) and is ended by its step deadline, not by the cap.

Two users, one cap each:

* :class:`cope.envs.runtime.worker.WorkerProcess`: a worker's stdout and stderr are one pipe to its parent,
  drained there, so the count survives the worker (a flooding worker is usually killed for its deadline).
  :class:`cope.envs.runtime.pool.EnvWorkerPool` counts the workers that reach their cap (``env/output_capped``)
  and logs each once.
* :class:`cope.envs.runtime.batch.InProcessEnvs`: while it makes, resets or steps its envs, this process's
  fds 1 and 2 (and ``sys.stdout``/``sys.stderr``) point into a pipe of its cap (:meth:`OutputCap.redirect`),
  which catches C code, subprocesses and Python prints alike. Anything else this process writes to
  stdout/stderr meanwhile goes through the cap too, and a crash report written to fd 2 inside that window
  (faulthandler) is lost with the drain thread; env workers keep both apart.

Stdlib only, like every env module.
"""
from __future__ import annotations

import contextlib
import fcntl
import os
import sys
import threading
import time
from collections.abc import Iterator

MAX_OUTPUT_BYTES = 1 << 20  # per worker process (per InProcessEnvs): envs here print a few kB a run when healthy
_CHUNK = 1 << 20  # pipe size and read size (Linux's default pipe holds 64 kB)
_PAUSE_S = 0.02  # past the cap, one read per pause: at most 50 MB/s are drained and dropped


def _write_all(fd: int, data: bytes) -> None:
    try:
        while data:
            data = data[os.write(fd, data):]
    except OSError:  # the log went away: keep draining, the writers must not block
        pass


def _flush_std() -> None:
    for f in (sys.stdout, sys.stderr):
        try:
            if f is not None:
                f.flush()
        except (OSError, ValueError):
            pass


class OutputCap:
    """Forwards at most ``limit`` bytes of what its pipes carry, then one notice; counts the rest.

    Args:
        limit: bytes forwarded in all, over the cap's lifetime and all of its pipes.
        label: who printed (in the notice line).
    """

    def __init__(self, limit: int = MAX_OUTPUT_BYTES, label: str = "env output"):
        if limit < 0:
            raise ValueError(f"limit must be >= 0, got {limit}")
        self.limit, self.label = limit, label
        self.forwarded = 0  # bytes passed on
        self.dropped = 0  # bytes counted and dropped
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []

    @property
    def capped(self) -> bool:
        """Whether anything was dropped (the notice line was written)."""
        return self.dropped > 0

    def drain(self, fd: int, sink: int) -> threading.Thread:
        """Read ``fd`` until EOF on a daemon thread, forwarding within the cap to ``sink``. Both fds become
        the thread's: it closes them at EOF (after every writer, grandchildren included, closed theirs)."""
        with contextlib.suppress(OSError, AttributeError):  # Linux only; the default 64 kB works too
            fcntl.fcntl(fd, fcntl.F_SETPIPE_SZ, _CHUNK)
        self._threads = [t for t in self._threads if t.is_alive()]
        t = threading.Thread(target=self._run, args=(fd, sink), name=f"output-cap-{fd}", daemon=True)
        t.start()
        self._threads.append(t)
        return t

    def wait(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for every pipe to reach EOF; True when all did."""
        for t in self._threads:
            t.join(timeout)
        return not any(t.is_alive() for t in self._threads)

    def _run(self, fd: int, sink: int) -> None:
        try:
            while True:
                if self.dropped:  # past the cap: a writer that keeps on blocks on the full pipe, and burns less CPU
                    time.sleep(_PAUSE_S)
                try:
                    data = os.read(fd, _CHUNK)
                except OSError:
                    break
                if not data:
                    break
                with self._lock:
                    keep = data[: max(0, self.limit - self.forwarded)]
                    first_drop = len(keep) < len(data) and not self.dropped
                    self.forwarded += len(keep)
                    self.dropped += len(data) - len(keep)
                _write_all(sink, keep)
                if first_drop:
                    _write_all(sink, (f"\n[{self.label}: more than {self.limit} bytes of output; the rest is "
                                      "dropped and only counted]\n").encode())
        finally:
            os.close(fd)
            os.close(sink)

    @contextlib.contextmanager
    def redirect(self) -> Iterator[None]:
        """Points this process's fds 1 and 2 into a pipe drained by this cap (to the real stderr) while the
        block runs, and ``sys.stdout``/``sys.stderr`` at them, whatever objects they were (a capture, a
        notebook's): Python prints take the same bounded path as C code. Flushed on the way in and out."""
        _flush_std()
        try:
            saved = os.dup(1), os.dup(2)
        except OSError:  # no stdout/stderr to bound
            yield
            return
        r, w = os.pipe()
        thread = self.drain(r, os.dup(saved[1]))
        os.dup2(w, 1)
        os.dup2(w, 2)
        os.close(w)
        streams = sys.stdout, sys.stderr
        # never closed: a logging handler made in the block may keep one (it then writes to fds 1/2 unbounded)
        sys.stdout, sys.stderr = (open(fd, "w", buffering=1, encoding="utf-8", errors="backslashreplace",
                                       closefd=False) for fd in (1, 2))
        try:
            yield
        finally:
            _flush_std()
            sys.stdout, sys.stderr = streams
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            os.close(saved[0])
            os.close(saved[1])
            thread.join(0.05)  # EOF at once unless a process started in the block still holds the pipe
