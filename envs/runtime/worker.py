"""Env instances in a child process: the child's main loop and the parent's handle to it.

Used by the parallel env pool (:mod:`cope.envs.runtime.pool`: several workers, each holding the env instances
of some episode slots) and by :class:`cope.envs.runtime.remote.RemoteEnv` (one env in another Python, e.g.
a venv with conflicting dependencies). Stdlib only, like every env module.

Wire format: length-prefixed pickles. The parent sends ``(request_id, command, slot, argument)``;
the child answers each request, in order, with ``(request_id, ok, value)`` where ``value`` is the
result or, when the env raised, the exception's text and traceback (``ok=False``). An env raising is
an *env error* (the engine aborts that episode); a worker that dies or stops answering is a *worker
failure* (the pool kills and restarts it, see :mod:`cope.envs.runtime.pool`).

Commands: ``make`` (argument: a picklable env factory; builds the slot's instance, closing an older
one), ``reset`` (a Task), ``step`` (action text), ``describe`` (name, max_steps, instructions, task
counts), ``call`` (``(method, args)``, e.g. ``example_actions``), ``close`` (one slot), ``exit`` (closes
every env first; the answer lists what raised while closing).

The parent treats everything that comes back as untrusted: a reply that is not a length-prefixed
pickle of ``(the expected request id, bool, value)``, a length over ``MAX_MESSAGE``, or a reply that
does not arrive whole before the deadline is a worker failure (:class:`WorkerFailure`, or
:class:`WorkerTimeout` for the deadline), as are a dead child and a closed channel. A handle that was
killed refuses to be used again (:class:`WorkerFailure`), so a stale handle can never write into a
closed pipe.

The child runs ``python -m cope.envs.runtime.worker``: its own stdout is redirected to stderr so that an env
that prints (game engines do) cannot corrupt the channel, and its stderr is a pipe to the parent, where an
:class:`cope.envs.runtime.output.OutputCap` passes the first ``max_output_bytes`` on to the parent's stderr
and only counts the rest (an env printing without end cannot flood the run's log); a reader thread takes
requests off the pipe as they arrive (the parent never blocks on a busy child while the child blocks on a
full reply pipe); it exits when the parent goes away (EOF on stdin, and SIGKILL via ``PR_SET_PDEATHSIG`` on Linux).
It starts a new session so the parent can kill the whole process group, including grandchildren such as a JVM.
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
from collections import deque
from typing import Any

from cope.envs.runtime.output import MAX_OUTPUT_BYTES, OutputCap

_HEADER = struct.Struct("!Q")
MAX_MESSAGE = 1 << 31  # bytes; a longer length prefix is garbage, not a reply to wait for
CHANNEL_FD_VAR = "COPE_ENV_WORKER_FD"  # in the child: the fd of its reply channel (fault injection writes there)


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


def _read_exact(fd: int, n: int, deadline: float | None = None) -> bytes:
    chunks, got = [], 0
    while got < n:
        if deadline is not None:
            r, _, _ = select.select([fd], [], [], max(0.0, deadline - time.monotonic()))
            if not r:
                raise TimeoutError(f"{got} of {n} bytes before the deadline")
        b = os.read(fd, min(n - got, 1 << 20))
        if not b:
            raise EOFError("channel closed")
        chunks.append(b)
        got += len(b)
    return b"".join(chunks)


def _read(fd: int, deadline: float | None = None) -> Any:
    (n,) = _HEADER.unpack(_read_exact(fd, _HEADER.size, deadline))
    if n > MAX_MESSAGE:
        raise ValueError(f"length prefix {n} > MAX_MESSAGE")
    return pickle.loads(_read_exact(fd, n, deadline))


# -- child side ---------------------------------------------------------------------------------
def _die_with_parent() -> None:
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except Exception:  # not Linux: stdin EOF still ends the loop
        pass


def _close_all(envs: dict) -> list[str]:
    """Close every env; the errors raised, as text (a failing close must not keep the others open)."""
    errors = []
    for slot, env in list(envs.items()):
        try:
            env.close()
        except Exception as e:  # noqa: BLE001 - reported to the parent in the answer to 'exit'
            errors.append(f"slot {slot}: {e!r}")
        del envs[slot]
    return errors


def _handle(envs: dict, cmd: str, slot: int, arg: Any) -> Any:
    if cmd in ("make", "close"):
        errors = _close_all({slot: envs.pop(slot)} if slot in envs else {})
        if errors:
            print(f"env worker: closing the old env raised: {errors}", file=sys.stderr)
        if cmd == "make":
            envs[slot] = arg()
        return None
    env = envs.get(slot)
    if env is None:
        raise RuntimeError(f"slot {slot} has no env (send 'make' first; a failed make leaves none)")
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
    os.environ[CHANNEL_FD_VAR] = str(out_fd)
    in_fd = sys.stdin.fileno()
    envs: dict[int, Any] = {}
    inbox: queue.Queue = queue.Queue()

    def drain() -> None:  # read requests as they come, so the parent never blocks writing to a busy child
        while True:
            try:
                inbox.put(_read(in_fd))
            except (EOFError, OSError):
                inbox.put(None)
                return
            except Exception:  # noqa: BLE001 - a request that does not unpickle: exit, the parent sees EOF
                traceback.print_exc()
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
                _write(out_fd, (rid, True, _close_all(envs)))
                break
            try:
                _write(out_fd, (rid, True, _handle(envs, cmd, slot, arg)))
            except Exception as e:  # noqa: BLE001 - every env error goes back to the parent
                _write(out_fd, (rid, False, f"{e!r}\n{traceback.format_exc()}"))
    finally:
        _close_all(envs)


# -- parent side --------------------------------------------------------------------------------
class WorkerProcess:
    """Parent-side handle of one worker child. Requests are answered in order; :meth:`send` queues,
    :meth:`recv` waits for the next answer up to a deadline. Not thread-safe. Once :meth:`kill` ran,
    every use raises :class:`WorkerFailure`. ``output`` is the cap on what the child (and everything it
    starts) prints: its stdout and stderr reach this process's stderr through it.

    Args:
        python: interpreter of the child (default: this one); another venv must have the project
            installed (``pip install --no-deps -e .``) so that ``cope.envs.runtime.worker`` imports there.
        env: extra environment variables for the child.
        max_output_bytes: what the child may print into this process's stderr in its life; the rest is counted.
    """

    def __init__(self, python: str | None = None, env: dict[str, str] | None = None,
                 max_output_bytes: int = MAX_OUTPUT_BYTES):
        self.python = python or sys.executable
        child_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        out_r, out_w = os.pipe()
        try:
            self.proc = subprocess.Popen(
                [self.python, "-m", "cope.envs.runtime.worker"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                stderr=out_w, env=child_env, start_new_session=True, bufsize=0,
            )
        except OSError as e:
            os.close(out_r)
            raise WorkerFailure(f"cannot start an env worker with python={self.python!r}: {e}") from e
        finally:
            os.close(out_w)
        self.output = OutputCap(max_output_bytes, label=f"env worker pid {self.proc.pid}")
        try:
            sink = os.dup(2)
        except OSError:  # this process has no stderr: the output goes nowhere, still drained and counted
            sink = os.open(os.devnull, os.O_WRONLY)
        self.output.drain(out_r, sink)
        self._next = 0
        self._expected: deque[int] = deque()  # ids of the requests not answered yet, in order
        self.killed = False

    @property
    def outstanding(self) -> int:
        return len(self._expected)

    @property
    def fileno(self) -> int:
        self._usable()
        return self.proc.stdout.fileno()

    def _usable(self) -> None:
        if self.killed:
            raise WorkerFailure(f"env worker pid {self.proc.pid} was killed; its handle must not be used again")

    def alive(self) -> bool:
        return not self.killed and self.proc.poll() is None

    def send(self, cmd: str, slot: int = 0, arg: Any = None) -> int:
        self._usable()
        rid = self._next
        self._next += 1
        try:
            _write(self.proc.stdin.fileno(), (rid, cmd, slot, arg))
        except (OSError, ValueError) as e:  # BrokenPipeError is an OSError; ValueError: a closed pipe object
            raise WorkerFailure(f"env worker pid {self.proc.pid} is gone ({e!r})") from e
        self._expected.append(rid)
        return rid

    def ready(self, timeout: float) -> bool:
        r, _, _ = select.select([self.fileno], [], [], max(0.0, timeout))
        return bool(r)

    def recv(self, timeout: float | None = None) -> tuple[int, bool, Any]:
        """The next answer; raises WorkerTimeout when it is not whole within ``timeout`` seconds, and
        WorkerFailure when the child died, closed the channel or sent anything but the expected reply."""
        self._usable()
        pid = self.proc.pid
        deadline = None if timeout is None else time.monotonic() + max(0.0, timeout)
        try:
            msg = _read(self.fileno, deadline)
        except TimeoutError as e:
            raise WorkerTimeout(f"env worker pid {pid} did not answer within {timeout:.1f}s ({e})") from e
        except (EOFError, OSError) as e:
            raise WorkerFailure(f"env worker pid {pid} died or closed its channel (exit code {self.proc.poll()}): {e!r}") from e
        except Exception as e:  # noqa: BLE001 - anything that does not unpickle is a garbled channel
            raise WorkerFailure(f"env worker pid {pid} sent a garbled reply: {e!r}") from e
        want = self._expected[0] if self._expected else None
        if not (isinstance(msg, tuple) and len(msg) == 3 and msg[0] == want and isinstance(msg[1], bool)):
            raise WorkerFailure(f"env worker pid {pid} sent a garbled reply (wanted the answer to request {want}): "
                                f"{repr(msg)[:200]}")
        self._expected.popleft()
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
        self.killed = True
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

    def close(self, timeout: float = 10.0) -> str | None:
        """Ask the child to close its envs and exit within ``timeout``, then kill what is left.

        Returns None on a clean exit, else what went wrong (dead already, an env's close raised or
        hung, a garbled answer, a non-zero exit code)."""
        problem = None
        if self.killed:
            return None
        if self.proc.poll() is not None:
            problem = f"env worker pid {self.proc.pid} had died (exit code {self.proc.returncode})"
        else:
            deadline = time.monotonic() + timeout
            try:
                self.send("exit")
                while self.outstanding:  # earlier answers first, then the one to 'exit'
                    _, _, value = self.recv(deadline - time.monotonic())
                if value:
                    problem = f"env worker pid {self.proc.pid}: closing its envs raised {value}"
                code = self.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
                if code and problem is None:
                    problem = f"env worker pid {self.proc.pid} exited with code {code} while closing"
            except (WorkerFailure, subprocess.TimeoutExpired) as e:
                problem = f"env worker pid {self.proc.pid} did not exit cleanly: {e}"
        self.kill()
        return problem


if __name__ == "__main__":
    main()
