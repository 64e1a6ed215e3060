"""Serve an OpenEnv app with uvicorn, for as long as the process that started it lives (run as a module).

``python -m cope.envs.openenv.serve --app pkg.mod:create_app --factory --port 8000`` serves the ASGI app (an
OpenEnv ``create_app(...)`` result, or with ``--factory`` a function returning one) on 127.0.0.1. With
``--watch-stdin`` (what :class:`cope.envs.openenv.server.LocalServer` passes) the server exits as soon as its stdin
reaches end-of-file: the trainer closed the pipe, or died in any way (the kernel closes the pipe then), so no env
server outlives its trainer. By hand, leave it out and stop the server with Ctrl-C.

Where it differs from ``uvicorn pkg.mod:app``: nothing but the watchdog and one startup line on stdout
(``serving <url>``), which the parent does not need (it polls ``/health``).
"""
from __future__ import annotations

import argparse
import os
import sys
import threading


def _watch_stdin() -> None:
    try:
        while sys.stdin.buffer.read(1):
            pass
    except OSError:
        pass
    os._exit(0)  # the parent is gone: no graceful shutdown to wait for


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--app", required=True, help="module:attribute of the ASGI app (or of its factory)")
    p.add_argument("--factory", action="store_true", help="the attribute is a function returning the app")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--watch-stdin", action="store_true", help="exit when stdin closes (the parent died)")
    p.add_argument("--log-level", default="warning")
    args = p.parse_args(argv)
    import uvicorn

    if args.watch_stdin:
        threading.Thread(target=_watch_stdin, daemon=True, name="parent-watch").start()
    print(f"serving http://{args.host}:{args.port} ({args.app})", flush=True)
    uvicorn.run(args.app, host=args.host, port=args.port, factory=args.factory, log_level=args.log_level,
                access_log=False, ws_max_size=64 * 2**20)


if __name__ == "__main__":
    main()
