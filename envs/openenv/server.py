"""The OpenEnv server of ``env=openenv``: one the trainer starts and stops (:class:`LocalServer`), or one that already
runs at a URL (:func:`check_reachable`). Stdlib only.

A local server is :mod:`cope.envs.openenv.serve` in a child process of its own session, on a free port of 127.0.0.1,
its output in a log file; it is polled on ``/health`` until it answers, exits (the error quotes the log) or its
deadline passes. It is stopped at interpreter exit (``atexit``) and, since it watches its stdin pipe, whenever this
process dies. One server per process and app, shared by every env instance of the process (:func:`local_server`):
env instances are made per episode and must not each start one. A server found dead when an instance resets is
started again on a new port (``restarts``): its episodes in flight were aborted by their failed steps, new ones
connect to the new server. With env worker processes (``data.env_runtime.workers``), each worker runs its own.
"""
from __future__ import annotations

import atexit
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

log = logging.getLogger(__name__)


def _opener(url: str):
    local = any(h in url for h in ("://127.0.0.1", "://localhost", "://[::1]"))
    return urllib.request.build_opener(urllib.request.ProxyHandler({})) if local else urllib.request.build_opener()


def get_json(url: str, timeout_s: float) -> dict:
    """``GET url`` as JSON (local URLs bypass proxies)."""
    with _opener(url).open(url, timeout=timeout_s) as r:
        return json.loads(r.read().decode("utf-8"))


def check_reachable(url: str, timeout_s: float, key: str = "env.url") -> None:
    """A ConnectionError naming ``key`` unless ``url`` answers ``/health``."""
    try:
        get_json(f"{url.rstrip('/')}/health", timeout_s)
    except (OSError, urllib.error.URLError, ValueError) as e:
        raise ConnectionError(f"the OpenEnv server at {url} does not answer /health ({e}): start it first, or leave "
                              f"{key} null to have the trainer start the env's app (env.app)") from e


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class LocalServer:
    """An OpenEnv app served by a child process this process starts, restarts and stops.

    Args:
        app: ``module:attribute`` of the ASGI app (or of its factory with ``factory``).
        factory: the attribute is a function returning the app.
        python: interpreter of the server (None: this one).
        startup_timeout_s: deadline of a start (imports, app construction).
        log_path: the server's output (None: a file in the temp folder).
    """

    def __init__(self, app: str, factory: bool = False, python: str | None = None, startup_timeout_s: float = 60.0,
                 log_path: str | None = None):
        self.app, self.factory, self.python = app, bool(factory), python or sys.executable
        self.startup_timeout_s = startup_timeout_s
        self.log_path = Path(log_path or Path(tempfile.gettempdir()) / f"cope-openenv-{os.getpid()}-{id(self):x}.log")
        self.url: str | None = None
        self.restarts = 0
        self._proc: subprocess.Popen | None = None
        self._lock = threading.Lock()
        atexit.register(self.stop)

    def alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def ensure(self) -> str:
        """The URL of a running server: started now if it never was or has died (counted in ``restarts``)."""
        with self._lock:
            if not self.alive():
                if self._proc is not None:
                    self.restarts += 1
                    log.warning("the OpenEnv server of %s died (exit code %s): restarting it (log %s)", self.app,
                                self._proc.returncode, self.log_path)
                self._start()
            return self.url

    def _start(self) -> None:
        port = free_port()
        cmd = [self.python, "-m", "cope.envs.openenv.serve", "--app", self.app, "--port", str(port), "--watch-stdin"]
        cmd += ["--factory"] if self.factory else []
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as logf:
            logf.write(f"\n=== cope: starting {self.app} on port {port} ===\n".encode())
            logf.flush()
            self._proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=logf, stderr=logf, start_new_session=True)
        self.url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + self.startup_timeout_s
        while True:
            try:
                get_json(f"{self.url}/health", 2.0)
                return
            except (OSError, urllib.error.URLError, ValueError):
                pass
            if self._proc.poll() is not None or time.monotonic() > deadline:
                tail = " | ".join(self.log_path.read_text(errors="replace").splitlines()[-8:])
                code = self._proc.poll()
                self.stop()
                why = f"exit code {code}" if code is not None else f"no /health within {self.startup_timeout_s:g} s"
                raise RuntimeError(f"the OpenEnv server {self.app} did not start ({why}; log {self.log_path}): {tail}")
            time.sleep(0.2)

    def kill(self) -> None:
        """SIGKILL the server now, as a crash would (fault-injection tests)."""
        if self.alive():
            os.killpg(self._proc.pid, signal.SIGKILL)
            self._proc.wait()

    def stop(self) -> None:
        """End the server (idempotent; also at interpreter exit)."""
        proc, self._proc = self._proc, None
        if proc is None:
            return
        try:
            proc.stdin.close()  # its watchdog exits on end-of-file
        except OSError:
            pass
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            proc.wait()


_SERVERS: dict[tuple, LocalServer] = {}
_SERVERS_LOCK = threading.Lock()


def local_server(app: str, factory: bool, python: str | None, startup_timeout_s: float) -> LocalServer:
    """This process's server of ``app`` (one per process and spec), running."""
    key = (app, bool(factory), python)
    with _SERVERS_LOCK:
        if key not in _SERVERS:
            _SERVERS[key] = LocalServer(app, factory, python, startup_timeout_s)
        server = _SERVERS[key]
    server.ensure()
    return server
