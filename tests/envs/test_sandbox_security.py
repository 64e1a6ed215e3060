"""Hostile commands against the bubblewrap sandbox (`cope.envs.terminal.sandbox`): each test asserts containment
itself (the host side is checked), not only that the command failed."""
from __future__ import annotations

import os
import shutil
import socket
import threading
import time
import uuid
from pathlib import Path

import pytest

from cope.envs.terminal.sandbox import SANDBOX_UID, Sandbox, _count_processes, unavailable_reason
from cope.envs.terminal.workdir import Snapshot, pack

_REASON = "bwrap not installed (Debian package: bubblewrap)" if shutil.which("bwrap") is None else unavailable_reason()
pytestmark = pytest.mark.skipif(_REASON is not None, reason=f"no sandbox here: {_REASON}")

REPO = Path(__file__).resolve().parents[2]
# A line that exists only in this file: it must never appear in a sandbox's output.
SECRET = "c0pe-sandbox-secret-" + "4f1d9a"
TIMEOUT = 2.0


@pytest.fixture(scope="module")
def sandbox() -> Sandbox:
    return Sandbox(timeout_s=TIMEOUT, grace_s=5, memory_mb=256, max_processes=32, work_size_mb=4, tmp_size_mb=2)


@pytest.fixture(scope="module")
def state() -> bytes:
    return pack({"keep.txt": "keep me\n"})


def _marked(pattern: str) -> list[int]:
    """Host pids whose command line contains ``pattern``."""
    found = []
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    if pattern.encode() in f.read():
                        found.append(int(pid))
            except OSError:
                pass
    return found


def test_no_network_reaches_a_host_listener(sandbox, state):
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as server:
        server.bind(("127.0.0.1", 0))
        server.listen(8)
        server.setblocking(False)
        port = server.getsockname()[1]
        cmd = (f"(exec 3<>/dev/tcp/127.0.0.1/{port} && echo REACHED-bash) ; "
               f"python3 -c \"import socket; socket.create_connection(('127.0.0.1', {port}), 1); print('REACHED-py')\"; "
               "cat /proc/net/dev")
        res = sandbox.run(cmd, state)
        with pytest.raises(BlockingIOError):  # nothing ever connected
            server.accept()
    assert "REACHED" not in res.output and "Connection refused" in res.output
    interfaces = [line.split(":")[0].strip() for line in res.output.splitlines() if ":" in line and "|" not in line]
    assert [i for i in interfaces if i in ("lo",) or i.startswith(("eth", "en", "wl", "docker", "veth"))] == ["lo"]


def test_host_files_are_invisible(sandbox, state, tmp_path):
    (tmp_path / "marker.txt").write_text(SECRET + "\n")
    paths = [REPO / "tests" / "envs" / "test_sandbox_security.py", REPO / "pyproject.toml", tmp_path / "marker.txt",
             Path.home(), Path("/root"), REPO]
    cmd = "; ".join(f"cat {p} 2>&1; ls -a {p} 2>&1" for p in paths)
    cmd += f"; grep -rs {SECRET[:12]} / --exclude-dir=usr --exclude-dir=proc --exclude-dir=sys; ls /proc"
    res = sandbox.run(cmd, state)
    assert SECRET not in res.output
    assert "cope-trainer" not in res.output  # pyproject.toml's project name
    assert res.output.count("No such file or directory") >= 2 * len(paths)
    pids = [w for w in res.output.split() if w.isdigit()]
    assert 0 < len(pids) < 10, pids  # only the sandbox's own processes are visible in /proc


def test_writes_outside_the_work_dir_do_not_reach_the_host(sandbox, state, tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("original\n")
    escape = tmp_path / "escape.txt"
    passwd = Path("/etc/passwd").read_bytes()
    targets = [escape, victim, "/etc/passwd", "/usr/bin/cope-evil", "/root/cope-evil", "/cope-evil", REPO / "cope-evil"]
    cmd = "; ".join(f"echo pwned > {t} && echo WROTE-{i}" for i, t in enumerate(targets))
    res = sandbox.run(cmd + "; echo fine > /work/inside.txt; echo x > /tmp/t && echo TMP-OK", state)
    assert "WROTE" not in res.output and "TMP-OK" in res.output
    assert not escape.exists() and victim.read_text() == "original\n"
    assert Path("/etc/passwd").read_bytes() == passwd
    for p in ("/usr/bin/cope-evil", "/root/cope-evil", "/cope-evil", REPO / "cope-evil"):
        assert not os.path.exists(p)
    assert Snapshot(res.state).text("inside.txt") == "fine\n"  # the work dir itself is writable


@pytest.mark.long
def test_fork_bomb_is_bounded(sandbox, state):
    peak = [0]
    stop = threading.Event()

    def watch():
        while not stop.is_set():
            peak[0] = max(peak[0], _count_processes(sandbox.host_uid))
            time.sleep(0.02)

    watcher = threading.Thread(target=watch) if sandbox.host_uid is not None else None
    if watcher:
        watcher.start()
    t0 = time.perf_counter()
    try:
        res = sandbox.run(":(){ :|:& };:; sleep 1", state)  # let it spread, then the wrapper kills it
        loop = sandbox.run("while :; do (sleep 100 &) 2>/dev/null; done", state)  # forks until the time limit
    finally:
        stop.set()
        if watcher:
            watcher.join()
    assert time.perf_counter() - t0 < 2 * TIMEOUT + 5
    assert loop.timed_out and loop.state is not None
    assert "Resource temporarily unavailable" in res.output
    assert Snapshot(res.state).text("keep.txt") == "keep me\n"
    if sandbox.host_uid is not None:
        assert sandbox.max_processes // 2 < peak[0] <= sandbox.max_processes + 3, peak[0]  # the limit binds
        time.sleep(0.2)
        assert _count_processes(sandbox.host_uid) == 0  # and nothing is left afterwards


def test_disk_is_capped(sandbox, state):
    free = shutil.disk_usage("/tmp").free
    cmd = ("i=0; while head -c 500000 /dev/zero > f$i; do i=$((i+1)); done; head -c 9000000 /dev/zero > big; "
           "truncate -s 10G sparse; head -c 9000000 /dev/zero > /tmp/big; head -c 9000000 /dev/zero > /dev/shm/big; "
           "echo x > /new; df -k /work /tmp | tail -n 2")
    res = sandbox.run(cmd, state)
    assert not res.timed_out and "No space left on device" in res.output
    assert "Read-only file system" in res.output  # the root is not writable
    snap = Snapshot(res.state)
    assert snap.entries["sparse"].size <= sandbox.max_file_bytes  # RLIMIT_FSIZE stopped the 10 GB truncate
    total = sum(e.size for e in snap.entries.values() if e.kind == "file")
    assert 0 < total <= sandbox.work_size_mb << 20
    assert len(res.state) <= sandbox.max_file_bytes
    assert shutil.disk_usage("/tmp").free > free - (64 << 20)  # nothing landed on the host's disk


@pytest.mark.long
def test_sleep_forever_times_out(sandbox, state):
    t0 = time.perf_counter()
    res = sandbox.run("echo start > started.txt; trap '' TERM INT HUP; sleep 1000", state)
    took = time.perf_counter() - t0
    assert res.timed_out and res.exit_code is None
    assert TIMEOUT <= took < TIMEOUT + 3
    assert Snapshot(res.state).text("started.txt") == "start\n"  # work done before the limit is kept


def test_background_processes_do_not_survive(sandbox, state):
    mark = f"cope-mark-{uuid.uuid4().hex[:12]}"
    seen = []

    def run():
        seen.append(sandbox.run(f"(exec -a {mark}-probe sleep 60) & sleep 1", state))

    worker = threading.Thread(target=run)
    worker.start()
    deadline = time.time() + 1.0
    while time.time() < deadline and not _marked(f"{mark}-probe"):
        time.sleep(0.02)
    assert _marked(f"{mark}-probe"), "positive control: the host can see a running sandbox process"
    worker.join()
    cmd = (f"nohup bash -c 'exec -a {mark}-a sleep 1000' >/dev/null 2>&1 & "
           f"setsid bash -c 'exec -a {mark}-b sleep 1000' & "
           f"( ( exec -a {mark}-c sleep 1000 ) & ) ; disown -a; echo launched")
    res = sandbox.run(cmd, state)
    assert "launched" in res.output and res.exit_code == 0
    time.sleep(0.2)
    assert _marked(mark) == []


def test_no_privileges_inside(sandbox, state):
    attempts = ["echo 'x::0:0::/:/bin/sh' >> /etc/passwd", "mount -t tmpfs none /tmp", "chroot / true",
                "unshare -U true", "unshare -r true", "su -c id root </dev/null", "nsenter -t 1 -m true",
                "python3 -c 'import os; os.setuid(0)'", "hostname evil", "chown root keep.txt",
                "mknod dev c 1 3"]
    cmd = "grep -E '^(Cap|NoNewPrivs)' /proc/self/status; id -u; " + "; ".join(
        f"{a} 2>/dev/null && echo ESCALATED-{i} || echo blocked-{i}" for i, a in enumerate(attempts))
    res = sandbox.run(cmd + "; kill -9 1; echo alive", state)
    fields = dict(line.split(":\t") for line in res.output.splitlines() if ":\t" in line)
    for cap in ("CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb"):
        assert int(fields[cap], 16) == 0, (cap, fields[cap])
    assert fields["NoNewPrivs"] == "1"
    assert str(SANDBOX_UID) in res.output.split()
    assert "ESCALATED" not in res.output
    assert all(f"blocked-{i}" in res.output for i in range(len(attempts)))
    assert "alive" in res.output and res.state is not None  # pid 1 (the wrapper) survived `kill -9 1`


def test_killing_everything_inside_still_returns(sandbox, state):
    res = sandbox.run("kill -KILL -1; echo still-here; sleep 1000", state)
    assert "still-here" in res.output and not res.timed_out and res.seconds < TIMEOUT + 3
    assert Snapshot(res.state).text("keep.txt") == "keep me\n"


def test_memory_and_output_limits(sandbox, state):
    if shutil.which("python3", path="/usr/local/bin:/usr/bin:/bin") is None:
        pytest.skip("python3 is not installed under /usr")
    res = sandbox.run("python3 -c 'x = bytearray(1 << 30)' 2>&1 | tail -n 1", state)
    assert "MemoryError" in res.output
    res = sandbox.run("yes", state)
    assert len(res.output) <= sandbox.max_output_bytes and res.output_bytes <= sandbox.max_file_bytes
    assert res.seconds < TIMEOUT + 3
