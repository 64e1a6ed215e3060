"""Env instances in a child process: the child's main loop and the parent's handle to it.

Used by the parallel env pool (:mod:`cope.envpool`: several workers, each holding the env instances
of some episode slots) and by :class:`cope.envs.remote.RemoteEnv` (one env in another Python, e.g.
a venv with conflicting dependencies). Stdlib only, like every env module.

Wire format: length-prefixed pickles. The parent sends ``(request_id, command, slot, argument)``;
the child answers each request, in order, with ``(request_id, ok, value)`` where ``value`` is the
result or, when the env raised, the exception's text and traceback (``ok=False``). An env raising is
an *env error* (the engine aborts that episode); a worker that dies or stops answering is a *worker
failure* (the pool kills and restarts it, see :mod:`cope.envpool`).

Commands: ``make`` (argument: a picklable env factory; creates the slot's instance lazily),
``reset`` (a Task), ``step`` (action text), ``describe`` (name, max_steps, instructions, task counts),
``call`` (``(method, args)``, e.g. ``example_actions``), ``close`` (one slot), ``exit``.

The child runs ``python -m cope.envs.worker``: its own stdout is redirected to stderr so that an env
that prints (game engines do) cannot corrupt the channel; a reader thread takes requests off the pipe
as they arrive (the parent never blocks on a busy child while the child blocks on a full reply pipe); it exits when the parent goes away (EOF on
stdin, and SIGKILL via ``PR_SET_PDEATHSIG`` on Linux). It starts a new session so the parent can kill
the whole process group, including grandchildren such as a JVM.
"""
from __future__ import annotations

import os
import pickle
import queue
import select
import signal
import struct
import subprocess
import sys
import threading
import time
import traceback
from typing import Any

_HEADER = struct.Struct("!Q")


class WorkerFailure(RuntimeError):
    """The worker process died, hung past its deadline, or broke the channel."""


class WorkerTimeout(WorkerFailure):
    pass


def _write(fd: int, obj: Any) -> None:
    data = pickle.dumps(obj, protocol=4)
    buf = memoryview(_HEADER.pack(len(data)) + data)
    while buf:
        n = os.write(fd, buf)
        buf = buf[n:]


def _read_exact(fd: int, n: int) -> bytes:
    chunks, got = [], 0
    while got < n:
        b = os.read(fd, n - got)
        if not b:
            raise EOFError("channel closed")
        chunks.append(b)
        got += len(b)
    return b"".join(chunks)


def _read(fd: int) -> Any:
    (n,) = _HEADER.unpack(_read_exact(fd, _HEADER.size))
    return pickle.loads(_read_exact(fd, n))


# -- child side ---------------------------------------------------------------------------------
def _die_with_parent() -> None:
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except Exception:  # not Linux: stdin EOF still ends the loop
        pass


def _handle(envs: dict, factories: dict, cmd: str, slot: int, arg: Any) -> Any:
    if cmd == "make":
        old = envs.pop(slot, None)
        if old is not None:
            old.close()
        factories[slot] = arg
        return None
    if cmd == "close":
        env = envs.pop(slot, None)
        if env is not None:
            env.close()
        return None
    env = envs.get(slot)
    if env is None:
        if slot not in factories:
            raise RuntimeError(f"slot {slot} has no env factory (send 'make' first)")
        env = envs[slot] = factories[slot]()
    if cmd == "reset":
        return env.reset(arg)
    if cmd == "step":
        return env.step(arg)
    if cmd == "describe":
        return {"name": env.name, "max_steps": env.max_steps, "instructions": env.instructions,
                "num_tasks": {s: env.num_tasks(s) for s in ("train", "test")},
                "has_example_actions": hasattr(env, "example_actions")}
    if cmd == "call":
        method, args = arg
        return getattr(env, method)(*args)
    raise ValueError(f"unknown worker command {cmd!r}")


def main() -> None:
    _die_with_parent()
    os.environ["COPE_ENV_WORKER"] = "1"
    out_fd = os.dup(1)
    os.dup2(2, 1)  # prints from env code go to stderr, never into the channel
    in_fd = sys.stdin.fileno()
    envs: dict[int, Any] = {}
    factories: dict[int, Any] = {}
    inbox: queue.Queue = queue.Queue()

    def drain() -> None:  # read requests as they come, so the parent never blocks writing to a busy child
        while True:
            try:
                inbox.put(_read(in_fd))
            except (EOFError, OSError):
                inbox.put(None)
                return

    threading.Thread(target=drain, daemon=True).start()
    try:
        while True:
            msg = inbox.get()
            if msg is None:
                break
            rid, cmd, slot, arg = msg
            if cmd == "exit":
                _write(out_fd, (rid, True, None))
                break
            try:
                _write(out_fd, (rid, True, _handle(envs, factories, cmd, slot, arg)))
            except Exception as e:  # noqa: BLE001 - every env error goes back to the parent
                _write(out_fd, (rid, False, f"{e!r}\n{traceback.format_exc()}"))
    finally:
        for env in envs.values():
            try:
                env.close()
            except Exception:  # noqa: BLE001
                pass


# -- parent side --------------------------------------------------------------------------------
class WorkerProcess:
    """Parent-side handle of one worker child. Requests are answered in order; :meth:`send` queues,
    :meth:`recv` waits for the next answer up to a deadline. Not thread-safe.

    Args:
        python: interpreter of the child (default: this one); another venv must have the project
            installed (``pip install --no-deps -e .``) so that ``cope.envs.worker`` imports there.
        env: extra environment variables for the child.
    """

    def __init__(self, python: str | None = None, env: dict[str, str] | None = None):
        self.python = python or sys.executable
        child_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        try:
            self.proc = subprocess.Popen(
                [self.python, "-m", "cope.envs.worker"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                env=child_env, start_new_session=True, bufsize=0,
            )
        except OSError as e:
            raise WorkerFailure(f"cannot start an env worker with python={self.python!r}: {e}") from e
        self._next = 0
        self.outstanding = 0

    @property
    def fileno(self) -> int:
        return self.proc.stdout.fileno()

    def alive(self) -> bool:
        return self.proc.poll() is None

    def send(self, cmd: str, slot: int = 0, arg: Any = None) -> int:
        rid = self._next
        self._next += 1
        try:
            _write(self.proc.stdin.fileno(), (rid, cmd, slot, arg))
        except (BrokenPipeError, OSError) as e:
            raise WorkerFailure(f"env worker pid {self.proc.pid} is gone ({e!r})") from e
        self.outstanding += 1
        return rid

    def ready(self, timeout: float) -> bool:
        r, _, _ = select.select([self.fileno], [], [], max(0.0, timeout))
        return bool(r)

    def recv(self, timeout: float | None = None) -> tuple[int, bool, Any]:
        """The next answer; raises WorkerTimeout past ``timeout`` seconds, WorkerFailure on death."""
        if timeout is not None and not self.ready(timeout):
            raise WorkerTimeout(f"env worker pid {self.proc.pid} did not answer within {timeout:.1f}s")
        try:
            msg = _read(self.fileno)
        except (EOFError, OSError, pickle.UnpicklingError) as e:
            code = self.proc.poll()
            raise WorkerFailure(f"env worker pid {self.proc.pid} died (exit code {code}): {e!r}") from e
        self.outstanding -= 1
        return msg

    def call(self, cmd: str, slot: int = 0, arg: Any = None, timeout: float | None = None) -> Any:
        """Send one request and wait for its answer; env errors are raised as RuntimeError."""
        self.send(cmd, slot, arg)
        _, ok, value = self.recv(timeout)
        if not ok:
            raise RuntimeError(value)
        return value

    def kill(self) -> None:
        """Kill the child and everything it started (its process group), then reap it."""
        try:  # also when the child has exited: grandchildren (a JVM) may still hold its group
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            if self.proc.poll() is None:
                self.proc.kill()
        for f in (self.proc.stdin, self.proc.stdout):
            try:
                f.close()
            except OSError:
                pass
        self.proc.wait()

    def close(self, timeout: float = 10.0) -> None:
        """Ask the child to close its envs and exit; kill it if it does not within ``timeout``."""
        if self.proc.poll() is None:
            try:
                self.send("exit")
                deadline = time.monotonic() + timeout
                while self.proc.poll() is None and time.monotonic() < deadline:
                    if self.ready(0.05):
                        try:
                            _read(self.fileno)
                        except (EOFError, OSError):
                            break
                self.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except (WorkerFailure, subprocess.TimeoutExpired, OSError):
                pass
        self.kill()


if __name__ == "__main__":
    main()
