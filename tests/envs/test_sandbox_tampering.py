"""Commands that try to steer the sandbox's pid 1, and hostile archives handed back to the host
(`cope.envs.terminal.sandbox`, `cope.envs.terminal.workdir`; found in a security review). Every attack inside ends with ``exit 7``:
the host must still see 7 and the real work dir, never what the attack wrote."""
from __future__ import annotations

import io
import json
import shutil
import subprocess
import sys
import tarfile
import tempfile
import textwrap
import time
from pathlib import Path

import pytest

from cope.envs.terminal.sandbox import Sandbox, unavailable_reason, unpassable
from cope.envs.terminal.sandbox_guard import DEBUGGERS, seccomp_filter
from cope.envs.terminal.workdir import Snapshot, add_files, check_archive, pack

_REASON = "bwrap not installed (Debian package: bubblewrap)" if shutil.which("bwrap") is None else unavailable_reason()
needs_sandbox = pytest.mark.skipif(_REASON is not None, reason=f"no sandbox here: {_REASON}")
_PY = shutil.which("python3", path="/usr/local/bin:/usr/bin:/bin")
needs_python = pytest.mark.skipif(_PY is None or not _PY.startswith("/usr/"), reason="python3 is not installed under /usr")
FORGED_REPORT = b"COPE-SANDBOX run 0 0 0\n"


def crafted_tar() -> bytes:
    """Three members; the third's size is -1536 (GNU base-256), which sends Python 3.11.7's tarfile from
    its data back to the second header, forever (CVE-2025-8194)."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.GNU_FORMAT) as tar:
        for name in ("./a", "./b", "./c"):
            info = tarfile.TarInfo(name)
            info.size = 3
            tar.addfile(info, io.BytesIO(b"abc"))
    return _patch(buf.getvalue(), 2048, 124, b"\xff" + (2 ** 88 - 1536).to_bytes(11, "big"))


def _patch(archive: bytes, header: int, field: int, value: bytes) -> bytes:
    """``archive`` with bytes of one header replaced and its checksum fixed."""
    b = bytearray(archive)
    b[header + field:header + field + len(value)] = value
    b[header + 148:header + 156] = b"        "
    b[header + 148:header + 156] = b"%06o\x00 " % sum(b[header:header + 512])
    return bytes(b)


@pytest.fixture(scope="module")
def sandbox() -> Sandbox:
    return Sandbox(timeout_s=3, grace_s=5, memory_mb=512, max_processes=32, work_size_mb=4, tmp_size_mb=2)


# ---- hostile archives (no sandbox needed) -----------------------------------------------------------------

@pytest.mark.long
def test_crafted_negative_size_tar_is_refused_at_once():
    data = crafted_tar()
    code = "import io, sys, tarfile; tarfile.open(fileobj=io.BytesIO(sys.stdin.buffer.read())).getmembers()"
    with pytest.raises(subprocess.TimeoutExpired):  # positive control: plain tarfile never returns on it
        subprocess.run([sys.executable, "-c", code], input=data, timeout=2, check=False)
    t0 = time.perf_counter()
    reason = check_archive(data)
    assert time.perf_counter() - t0 < 0.5 and reason == "header at byte 2048: a negative size (GNU base-256)"
    for read in (Snapshot, lambda s: add_files(s, {"x": "y"})):
        with pytest.raises(ValueError, match="negative size"):
            read(data)


def _tar(*members: tuple[str, bytes, bytes, str], fmt=tarfile.GNU_FORMAT) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=fmt) as tar:
        for name, kind, data, link in members:
            info = tarfile.TarInfo(name)
            info.type, info.size, info.linkname = kind, len(data), link
            tar.addfile(info, io.BytesIO(data) if data else None)
    return buf.getvalue()


_FILE = ("./a", tarfile.REGTYPE, b"abc", "")
_GOOD = _tar(_FILE, ("./b", tarfile.REGTYPE, b"", ""))


@pytest.mark.parametrize(("archive", "reason"), [
    (_GOOD[:100] + b"7777" + _GOOD[104:], "bad checksum"),  # mode changed, checksum not
    (_GOOD.replace(b"ustar  \x00", b"ustaX  \x00", 1), "not a GNU or ustar header"),
    (_tar(("./" + "x" * 120, tarfile.REGTYPE, b"x", ""), fmt=tarfile.PAX_FORMAT), "type 'x' is not allowed"),
    (_patch(_GOOD, 512 * 2, 124, b"-0000001000\x00"), "unreadable size"),  # tarfile reads "-1000" octal as -512
    (_patch(_GOOD, 0, 156, b"S"), "type 'S' is not allowed"),  # old GNU sparse: its own offsets
    (_tar(_FILE, ("./h", tarfile.LNKTYPE, b"", "/etc/passwd")), "absolute hard link target"),
    (_tar(("./h", tarfile.LNKTYPE, b"", "./a"), _FILE), "not an earlier regular file"),
    (_tar(_FILE, ("./h", tarfile.LNKTYPE, b"", "./h")), "not an earlier regular file"),  # itself: endless links
    (_tar(_FILE, ("./x/../../../etc/cron", tarfile.REGTYPE, b"x", "")), "with '..'"),
    (_tar(_FILE, _FILE), "a second member with this name"),
    (_patch(_tar(("./d", tarfile.DIRTYPE, b"", ""), _FILE), 0, 124, b"00000001000\x00"), "with 512 bytes of data"),
    (_patch(_tar(("./d/", tarfile.AREGTYPE, b"", ""), _FILE), 0, 124, b"00000001000\x00"), "with 512 bytes of data"),
    (_GOOD[:-1024 * 19 - 600], "cut off"), (_GOOD[:700], "cut off"), (b"", "cut off"),
    (bytes(1024), "no members"),
])
def test_hostile_archive_shapes_are_refused(archive, reason):
    got = check_archive(archive)
    assert got is not None and reason in got, got
    with pytest.raises(ValueError, match="not a valid work-dir archive"):
        Snapshot(archive)


def test_archive_caps_and_what_gnu_tar_writes(tmp_path):
    assert "over the limit: more than 3 members" in check_archive(pack({f"f{i}": "" for i in range(5)}), max_members=3)
    assert "over the limit" in check_archive(_GOOD, max_bytes=1000)
    work = tmp_path / "w"
    (work / ("d" * 90) / ("e" * 90)).mkdir(parents=True)
    (work / "f.txt").write_text("x\n")
    (work / "hard").hardlink_to(work / "f.txt")
    (work / "out").symlink_to("/etc/passwd")  # a symlink is text, never followed on the host
    (work / ("d" * 90) / ("e" * 90) / "long.txt").write_text("deep\n")
    made = subprocess.run(["tar", "-cf", "-", "-C", str(work), "."], capture_output=True, check=True).stdout
    assert check_archive(made) is None
    snap = Snapshot(made)
    assert snap.read("hard") == b"x\n" and snap.link("out") == "/etc/passwd"
    assert snap.text(f"{'d' * 90}/{'e' * 90}/long.txt") == "deep\n"  # GNU long names


def test_seccomp_program_shape():
    prog = seccomp_filter("x86_64")
    assert len(prog) % 8 == 0 and len(prog) // 8 == 11  # struct sock_filter is 8 bytes
    assert seccomp_filter("aarch64") != prog
    with pytest.raises(OSError, match="no seccomp filter for machine 'mips'"):
        seccomp_filter("mips")


def test_unpassable_commands():
    assert "NUL byte" in unpassable("echo a\x00b") and "not encodable" in unpassable("echo \ud800")
    assert "not encodable" in unpassable("echo \udcff")  # os.fsencode would pass it on as the byte 0xff
    assert unpassable("echo 'ü' \"$x\" \\n") is None
    with pytest.raises(ValueError, match="cannot run the command: it contains a NUL byte"):
        Sandbox().run("echo a\x00b", pack({}))


# ---- attacks from inside ----------------------------------------------------------------------------------

ATTACK = textwrap.dedent("""
    import ctypes, errno, os
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    def report(name, ret):
        print(name, "ok" if ret >= 0 else errno.errorcode[ctypes.get_errno()], flush=True)
    report("attach-1", libc.ptrace(16, 1, 0, 0))          # PTRACE_ATTACH pid 1: what gdb -p 1 does
    report("seize-1", libc.ptrace(0x4206, 1, 0, 0))       # PTRACE_SEIZE
    child = os.fork()
    if child == 0:
        os.execv("/bin/sleep", ["sleep", "5"])
    report("attach-child", libc.ptrace(16, child, 0, 0))  # allowed by the kernel's own rules: seccomp says no
    buf = ctypes.create_string_buffer(64)
    iov = (ctypes.c_void_p * 2)(ctypes.cast(buf, ctypes.c_void_p), 64)
    report("vm-read-1", libc.process_vm_readv(1, iov, 1, iov, 1, 0))
    report("vm-write-1", libc.process_vm_writev(1, iov, 1, iov, 1, 0))
    pidfd = libc.syscall(434, 1, 0)                       # pidfd_open (same number on x86_64 and aarch64)
    report("pidfd-open-1", pidfd)
    report("pidfd-getfd-1", libc.syscall(438, pidfd, 3, 0))
    with open("/proc/%d/stat" % os.getppid()) as f:  # the parent is the command's bash, its parent timeout
        supervisor = int(f.read().rsplit(")", 1)[1].split()[1])
    for path in ("/proc/1/mem", "/proc/1/fd/3", "/proc/%d/mem" % supervisor, "/proc/%d/mem" % os.getppid()):
        try:
            os.close(os.open(path, os.O_WRONLY))
            print(path, "ok")
        except OSError as e:
            print(path, errno.errorcode[e.errno])
    os.kill(child, 9)
""")


@needs_sandbox
@needs_python
def test_ptrace_and_memory_of_pid_1_and_timeout_are_denied(sandbox):
    res = sandbox.run("python3 attack.py; echo done; exit 7", pack({"attack.py": ATTACK, "keep.txt": "keep me\n"}))
    got = dict(line.rsplit(" ", 1) for line in res.output.splitlines() if " " in line)
    assert res.exit_code == 7 and "done" in res.output and res.rejected == "", res
    for name in ("attach-1", "seize-1", "attach-child", "vm-read-1", "vm-write-1", "pidfd-getfd-1"):
        assert got[name] == "EPERM", (name, res.output)  # the seccomp filter
    assert got["pidfd-open-1"] == "ok"  # positive control: the syscalls themselves work here
    for path in ("/proc/1/mem", "/proc/1/fd/3"):
        assert got[path] == "EACCES", (path, res.output)  # pid 1 is not dumpable
    assert [v for k, v in got.items() if k.endswith("/mem") and k != "/proc/1/mem"] == ["EACCES", "ok"]  # timeout's
    # is closed as pid 1's is; the command's own bash (positive control) is the attacker's to write
    assert Snapshot(res.state).text("keep.txt") == "keep me\n"


FORGE = textwrap.dedent("""
    import ctypes, os
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    fd = libc.syscall(438, libc.syscall(434, 1, 0), 3, 0)  # pidfd_getfd: pid 1's report channel, its offset
    print("forged" if fd >= 0 and os.write(fd, open("forged.bin", "rb").read()) else "refused")
""")


@needs_sandbox
@needs_python
def test_forged_report_through_pid_1s_channel(sandbox):
    # No debugger needed: a copy of pid 1's fd 3 (pidfd_getfd) shares its offset, so a report written
    # through it comes first; /proc/1/fd/3 and /proc/1/mem were open to the same uid as well.
    forged = FORGED_REPORT + pack({"keep.txt": "forged\n", "pwned": "yes"})
    state = pack({"forged.bin": forged, "forge.py": FORGE, "keep.txt": "keep me\n"})
    res = sandbox.run("python3 forge.py; cat forged.bin > /proc/1/fd/3; exec 9>/proc/1/mem; exit 7", state)
    assert res.exit_code == 7 and res.rejected == "" and "refused" in res.output, res
    assert res.output.count("Permission denied") == 2, res.output
    snap = Snapshot(res.state)
    assert snap.text("keep.txt") == "keep me\n" and not snap.exists("pwned")


@needs_sandbox
@pytest.mark.skipif(shutil.which("gdb") is None, reason="gdb is not installed on this host (nothing to hide)")
def test_gdb_attach_to_pid_1(sandbox):
    cmd = ("gdb -p 1 -batch -ex 'call (long)write(3, \"COPE-SANDBOX run 0 0 0\\n\", 23)' -ex detach 2>&1 | tail -n 3; "
           "exit 7")
    res = sandbox.run(cmd, pack({"keep.txt": "keep me\n"}))
    assert res.exit_code == 7 and res.rejected == "" and "Permission denied" in res.output, res
    assert "process 1" not in res.output  # before: "Attaching to process 1 ... [Inferior 1 (process 1) detached]"
    assert Snapshot(res.state).text("keep.txt") == "keep me\n"


@needs_sandbox
def test_debuggers_are_not_runnable_inside(sandbox):
    present = [p for d in ("/usr/bin", "/usr/sbin") for p in (f"{d}/{n}" for n in DEBUGGERS) if shutil.which(p)]
    if not present:
        pytest.skip(f"none of {DEBUGGERS} is installed on this host")
    res = sandbox.run("; ".join(f"[ -x {p} ] && echo RUNNABLE-{p}; {p} --version >/dev/null 2>&1 || echo gone"
                                for p in present), pack({}))
    assert "RUNNABLE" not in res.output and res.output.count("gone") == len(present), res.output


@needs_sandbox
def test_signals_to_pid_1_do_not_end_it(sandbox):
    cmd = "for s in INT QUIT TERM HUP USR1 USR2 ALRM PIPE; do kill -$s 1; done; kill -INT 0; echo unreachable"
    res = sandbox.run(cmd, pack({"keep.txt": "keep me\n"}))
    assert res.exit_code == 130 and res.rejected == "" and res.error == "", res  # the command's own SIGINT
    assert Snapshot(res.state).text("keep.txt") == "keep me\n"


# ---- a compromised sandbox: a stand-in bwrap writes whatever it likes ---------------------------------------

FAKE_BWRAP = """#!{python}
import os, sys
argv = sys.argv
fd = int(argv[argv.index("--json-status-fd") + 1]) if "--json-status-fd" in argv else None
if fd is not None and {started!r}:
    os.write(fd, b'{{ "child-pid": 12 }}\\n{{ "exit-code": {code} }}\\n')
sys.stderr.buffer.write(bytes.fromhex({payload!r}))
"""

@pytest.fixture
def fake_dir():
    """A folder the sandbox's host uid (when running as root: an unprivileged one) can read."""
    path = Path(tempfile.mkdtemp(prefix="cope-fake-bwrap-"))
    path.chmod(0o755)
    yield path
    shutil.rmtree(path)


def _fake_bwrap(folder: Path, started: bool, code: int, payload: bytes) -> Path:
    if _PY is None:
        pytest.skip("the stand-in bwrap needs python3 under /usr")
    fake = folder / f"fake-bwrap-{code}-{len(payload)}"
    fake.write_text(FAKE_BWRAP.format(python=_PY, started=started, code=code, payload=payload.hex()))
    fake.chmod(0o755)
    return fake


PROBE = """
import json, sys, time
from cope.envs.terminal.sandbox import Sandbox
from cope.envs.terminal.env import TerminalEnv
from cope.envs.base import Task
env = TerminalEnv(timeout_s=3)
env.reset(Task("terminal", "train", 0))
before = env._state
env.sandbox.bwrap = sys.argv[1]
t0 = time.perf_counter()
out = env.step("echo hi > new.txt")
took = time.perf_counter() - t0
env.sandbox.bwrap = "bwrap"
after = env.step("ls")
print(json.dumps({"valid": out.valid, "harness": out.harness, "info": out.info, "took": took,
                  "kept": env._state == before, "after_valid": after.valid}))
"""


@needs_sandbox
@pytest.mark.parametrize(("started", "code", "payload", "expect"), [
    (True, 0, FORGED_REPORT + crafted_tar(), "archive is malformed: header at byte 2048: a negative size"),
    (True, 7, FORGED_REPORT + pack({"pwned": "yes"}), "does not match the exit status 7"),
    (True, 0, b"garbage", "does not match the exit status 0"),
])
def test_compromised_sandbox_is_an_invalid_step_not_a_hang(fake_dir, started, code, payload, expect):
    fake = _fake_bwrap(fake_dir, started, code, payload)
    try:
        done = subprocess.run([sys.executable, "-c", PROBE, str(fake)], capture_output=True, text=True,
                              timeout=60, check=False)
    except subprocess.TimeoutExpired:
        pytest.fail("TerminalEnv.step did not return within 60 s on what a compromised sandbox sent back")
    assert done.returncode == 0, done.stderr[-2000:]
    got = json.loads(done.stdout.splitlines()[-1])
    assert not got["valid"] and expect in got["info"]["sandbox_rejected"] and expect in got["harness"], got
    assert got["kept"] and got["after_valid"] and got["took"] < 5, got  # state unchanged; the episode goes on


@needs_sandbox
def test_bwrap_that_never_starts_is_a_host_error(fake_dir):
    fake = _fake_bwrap(fake_dir, False, 0, b"bwrap: No permissions to create new namespace")
    res = Sandbox(timeout_s=3, bwrap=str(fake)).run("true", pack({}))
    assert res.error == "bwrap: No permissions to create new namespace" and res.rejected == "" and res.state is None
