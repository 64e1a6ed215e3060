"""The server guard (src/cope/rollout/vllm/guard.py) ends the server's whole process group however its parent ends.

A stand-in server (a shell with a forked child, both sleeping) is enough: the guard knows nothing about
vLLM. No vLLM venv needed, so these run everywhere, in seconds."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from cope.rollout.vllm.server import GUARD

FAKE_SERVER = ["sh", "-c", "sleep 300 & sleep 300"]  # a leader and a forked child in one group


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    # zombies still count for killpg(0): look for a live member
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                stat = open(f"/proc/{d}/stat").read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(stat[2]) == pgid and stat[0] != "Z":
                return True
    return False


def wait_gone(pgid: int, timeout: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not group_alive(pgid):
            return True
        time.sleep(0.1)
    return False


def start_parent() -> tuple[subprocess.Popen, int]:
    """A parent process (a stand-in trainer) that starts the guard and prints the server's pid."""
    code = textwrap.dedent(f"""
        import subprocess, sys, time
        g = subprocess.Popen([sys.executable, {str(GUARD)!r}, *{FAKE_SERVER!r}], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        print(g.stdout.readline().decode().strip(), flush=True)
        time.sleep(300)
    """)
    parent = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, start_new_session=True)
    pid = int(parent.stdout.readline())
    assert group_alive(pid)
    return parent, pid


@pytest.mark.parametrize("how", [signal.SIGKILL, signal.SIGTERM], ids=["SIGKILL", "SIGTERM"])
def test_server_group_ends_when_the_parent_dies(how):
    parent, pgid = start_parent()
    try:
        os.kill(parent.pid, how)  # SIGKILL runs no handler and no atexit: only the closed pipe tells the guard
        parent.wait(10)
        assert wait_gone(pgid), "the server's process group outlived its parent"
    finally:
        for group in (pgid, parent.pid):  # leave nothing behind if an assertion failed
            try:
                os.killpg(group, signal.SIGKILL)
            except ProcessLookupError:
                pass


def test_closing_the_pipe_stops_the_server_and_the_guard_exits():
    g = subprocess.Popen([sys.executable, str(GUARD), *FAKE_SERVER], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    pgid = int(g.stdout.readline())
    assert group_alive(pgid)
    g.stdin.close()
    assert g.wait(20) == 0
    assert wait_gone(pgid)


def test_server_exit_is_passed_on():
    g = subprocess.Popen([sys.executable, str(GUARD), "sh", "-c", "sleep 300 & exit 3"], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE)
    pgid = int(g.stdout.readline())
    assert g.wait(20) == 3  # the server died: the guard says so with its code, and its forked child is gone too
    assert wait_gone(pgid)
    g.stdin.close()
