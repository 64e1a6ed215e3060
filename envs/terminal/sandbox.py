"""A bubblewrap sandbox that runs one untrusted shell command against a saved work dir.

Every command gets a fresh ``bwrap`` with its own user, pid, ipc, uts, cgroup and network namespaces
(no network: only the sandbox's own loopback), no capabilities, ``no_new_privs``, a new session, no
further user namespaces, and a root that holds only: ``/usr`` (read-only; ``/bin``, ``/lib``... as the
distro has them), ``/etc/alternatives`` and ``/etc/ld.so.cache`` (read-only), a synthetic
``/etc/passwd``, ``/etc/group`` and ``/etc/nsswitch.conf``, a fresh ``/proc`` and ``/dev``, and
size-capped tmpfs mounts on ``/work`` (the task's files), ``/tmp`` and ``/dev/shm``. The rest of the
root is read-only, so nothing else can be written, and the home folder, the repository, ``/opt``,
``/var``, ``/run`` and the rest of ``/etc`` do not exist inside.

**Persistence.** A tmpfs dies with its sandbox, so the work dir travels as a tar archive (the *state*,
bytes held by the caller): the sandbox's pid 1, a fixed bash script (:data:`_WRAPPER`), unpacks the
state into ``/work``, runs the command with a timer that kills it, kills every other process of the
namespace (background children included), then packs ``/work`` again. The host never unpacks an
archive onto its disk, and checks it (:func:`~cope.envs.terminal.workdir.check_archive`) before anything reads it.

**Nothing inside can steer pid 1.** A seccomp filter (:mod:`cope.envs.terminal.sandbox_guard`, bwrap ``--seccomp``)
makes ``ptrace``, ``process_vm_readv``/``writev`` and ``pidfd_getfd`` fail with ``EPERM``; pid 1 runs
from an execute-only copy of bash, which the kernel makes non-dumpable, so the command (same uid, no
capabilities) cannot open ``/proc/1/mem`` or ``/proc/1/fd/*`` either (that is how a command could
write its own report without any debugger); debuggers (:data:`DEBUGGERS`) are covered with
``/dev/null``. The exit status comes from bwrap itself (``--json-status-fd``, written outside the
sandbox) and must match the report line; a report or archive that fails these checks is refused
(:attr:`SandboxResult.rejected`), never trusted.

**Limits** (per command): wall time (``timeout`` inside; the host kills the whole sandbox at
``timeout_s + grace_s``), address space (``RLIMIT_AS``), processes (``RLIMIT_NPROC``), file size
(``RLIMIT_FSIZE``), open files, no core dumps, and the tmpfs sizes. ``RLIMIT_NPROC`` does not bind a
process whose host uid is root, so when the host runs as root the sandbox runs under a dedicated
unprivileged host uid (default: one picked per instance from 200000-299999); as a normal user it runs
under that user, with the process limit raised by the user's current process count (the kernel counts
the user's processes outside the sandbox too).

Channels: stdin is the state (a memfd), stdout the command's stdout+stderr (a memfd, so a chatty
command only fills a capped file), stderr the wrapper's report line followed by the new state (or
bwrap's own error message), ``--json-status-fd`` bwrap's status (the sandbox started; pid 1's exit code).
"""
from __future__ import annotations

import itertools
import json
import os
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass
from functools import lru_cache

from cope.envs.terminal.sandbox_guard import EXEC_ONLY, hidden_debuggers, program_bytes, seccomp_filter
from cope.envs.terminal.workdir import LIMIT_REASONS, MAX_MEMBERS, check_archive, pack

REPORT = b"COPE-SANDBOX "
SANDBOX_UID = 1000  # the uid/gid the command sees (name "agent")
AUTO_UID_RANGE = (200_000, 300_000)  # host uids for sandboxes when the host runs as root
_uid_counter = itertools.count()
_PATH = "/usr/local/bin:/usr/bin:/bin"
_ETC = {
    "passwd": f"agent:x:{SANDBOX_UID}:{SANDBOX_UID}:agent:/work:/bin/bash\nnobody:x:65534:65534::/:/bin/false\n",
    "group": f"agent:x:{SANDBOX_UID}:\nnogroup:x:65534:\n",
    "nsswitch.conf": "passwd: files\ngroup: files\nhosts: files\n",
    "hosts": "127.0.0.1 localhost sandbox\n",
}
_ENV = {
    "PATH": _PATH, "HOME": "/work", "USER": "agent", "LOGNAME": "agent", "SHELL": "/bin/bash", "TERM": "dumb",
    "LANG": "C.UTF-8", "TMPDIR": "/tmp", "PAGER": "cat", "GIT_PAGER": "cat", "GIT_CONFIG_NOSYSTEM": "1",
    "GIT_AUTHOR_NAME": "agent", "GIT_AUTHOR_EMAIL": "agent@sandbox", "GIT_COMMITTER_NAME": "agent",
    "GIT_COMMITTER_EMAIL": "agent@sandbox", "PYTHONDONTWRITEBYTECODE": "1",
}
_INIT = "/.cope/bash"
# pid 1 of the sandbox: $1 = time limit (s), $2 = the command. fd 3 = the report channel (bwrap's stderr).
# As pid 1 it gets only the signals it has handlers for, from inside the namespace: bash's own SIGINT handler
# (while it waits) would end it, so INT/QUIT get a no-op trap (children start with the default). It and
# `timeout` (the command's parent) run from execute-only copies, so the command cannot rewrite either.
_WRAPPER = r"""
exec 3>&2 2>/dev/null
trap : INT QUIT
umask 022
cd /work || exit 1
tar -xpf - -C /work || { printf 'COPE-SANDBOX setup 1 0 0\n' >&3; exit 1; }
exec </dev/null
msg=$(bash -n -c "$2" 2>&1 3>&-)
if [ $? -ne 0 ]; then
  printf '%s\n' "$msg"
  rc=2
  printf 'COPE-SANDBOX syntax 2 0 0\n' >&3
else
  t0=$EPOCHREALTIME
  /.cope/timeout -s KILL "$1" bash -c "$2" 2>&1 3>&-
  rc=$?
  t1=$EPOCHREALTIME
  kill -KILL -1
  printf 'COPE-SANDBOX run %s %s %s\n' "$rc" "$t0" "$t1" >&3
fi
chmod u+rwx /work
tar -cf - -C /work . >&3
exit "$rc"
"""


@dataclass(frozen=True)
class SandboxResult:
    """What one command did. ``state`` is the new work dir (tar bytes), None when it could not be saved
    (host-side kill, archive over the limits or refused, sandbox failure): the caller keeps the previous state."""

    output: str  # the command's stdout+stderr (first ``max_output_bytes`` bytes, UTF-8 with replacement)
    output_bytes: int  # total bytes the command wrote to stdout/stderr
    exit_code: int | None  # None when it timed out or never ran, or its report was refused
    timed_out: bool
    syntax_error: bool  # bash could not parse the command: nothing ran
    state: bytes | None
    seconds: float  # host wall time of the whole sandbox (setup, command, packing)
    error: str = ""  # sandbox failure (bwrap's message) or why the archive was not kept; "" when all worked
    rejected: str = ""  # why the report or archive was refused as forged (exit_code, state: None); "" if not


@lru_cache(maxsize=1)
def unavailable_reason(bwrap: str = "bwrap") -> str | None:
    """None when sandboxes can run here, else why not (bwrap or prlimit missing, no user namespaces)."""
    for tool in (bwrap, "prlimit", "timeout", "tar"):
        if shutil.which(tool) is None:
            return f"{tool!r} not found (Debian: apt-get install bubblewrap util-linux coreutils tar)"
    try:
        res = Sandbox(timeout_s=5, bwrap=bwrap).run("echo ok", pack({}))
    except OSError as exc:
        return f"the sandbox cannot start: {exc}"
    if res.error or res.output.strip() != "ok":
        return f"bwrap cannot create its namespaces here: {res.error or res.output!r}"
    return None


def _count_processes(uid: int) -> int:
    n = 0
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                n += os.stat(f"/proc/{pid}").st_uid == uid
            except OSError:
                pass
    return n


def _memfd(data: bytes = b"") -> int:
    fd = os.memfd_create("cope-sandbox", os.MFD_CLOEXEC)
    view, done = memoryview(data), 0
    while done < len(data):
        done += os.write(fd, view[done:])
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


class Sandbox:
    """Runs shell commands in bubblewrap; see the module docstring for what is isolated and limited.

    Args:
        timeout_s: Wall-time limit of one command (the whole process tree is killed at the limit).
        grace_s: Extra host-side time for setup and packing before the host kills the sandbox itself.
        memory_mb: Address-space limit of each process (``RLIMIT_AS``).
        max_processes: Processes the sandbox may have at once (``RLIMIT_NPROC``).
        work_size_mb: Size of the ``/work`` tmpfs (the persistent work dir).
        tmp_size_mb: Size of each of the ``/tmp`` and ``/dev/shm`` tmpfs mounts (discarded per command).
        max_output_bytes: How much of the command's output is read back.
        max_members: Most members a returned work-dir archive may have (more: it is not kept).
        host_uid: Host uid to run sandboxes under when the host runs as root (None: pick one per
            instance from ``AUTO_UID_RANGE``); ignored otherwise.
        bwrap: The bubblewrap executable.
    """

    def __init__(self, timeout_s: float = 10.0, grace_s: float = 5.0, memory_mb: int = 1024,
                 max_processes: int = 64, work_size_mb: int = 64, tmp_size_mb: int = 16,
                 max_output_bytes: int = 1 << 16, max_members: int = MAX_MEMBERS, host_uid: int | None = None,
                 bwrap: str = "bwrap") -> None:
        for arg, value, low in (("timeout_s", timeout_s, 0.1), ("grace_s", grace_s, 0.5), ("memory_mb", memory_mb, 64),
                                ("max_processes", max_processes, 4), ("work_size_mb", work_size_mb, 1),
                                ("tmp_size_mb", tmp_size_mb, 1), ("max_output_bytes", max_output_bytes, 1),
                                ("max_members", max_members, 1)):
            if not isinstance(value, (int, float)) or isinstance(value, bool) or value < low:
                raise ValueError(f"{arg} must be a number >= {low}, got {value!r}")
        if host_uid is not None and (not isinstance(host_uid, int) or host_uid <= 0):
            raise ValueError(f"host_uid must be a positive int (not root) or None, got {host_uid!r}")
        self.timeout_s, self.grace_s = float(timeout_s), float(grace_s)
        self.memory_mb, self.max_processes = int(memory_mb), int(max_processes)
        self.work_size_mb, self.tmp_size_mb = int(work_size_mb), int(tmp_size_mb)
        self.max_output_bytes, self.max_members, self.bwrap = int(max_output_bytes), int(max_members), bwrap
        if os.geteuid() == 0:
            lo, hi = AUTO_UID_RANGE
            self.host_uid = host_uid or lo + (os.getpid() * 131 + next(_uid_counter)) % (hi - lo)
        else:
            self.host_uid = None

    # Files larger than this cannot be written; the packed state (work dir + tar headers) must fit too.
    @property
    def max_file_bytes(self) -> int:
        return 2 * self.work_size_mb * (1 << 20) + (1 << 20)

    def limits(self) -> list[str]:
        """``prlimit`` options (hard = soft)."""
        nproc = self.max_processes + 2  # + bwrap and the wrapper
        if self.host_uid is None:
            nproc += _count_processes(os.getuid())
        cpu = int(self.timeout_s + self.grace_s) + 1
        return [f"--as={self.memory_mb << 20}", f"--nproc={nproc}", f"--fsize={self.max_file_bytes}",
                "--core=0", "--nofile=1024", f"--cpu={cpu}"]

    def argv(self, command: str, timeout_s: float, fds: dict[str, int]) -> list[str]:
        """The full ``prlimit ... -- bwrap ... -- /.cope/bash -c WRAPPER`` command line; ``fds`` holds the
        memfds of the seccomp program (``"seccomp"``), of bwrap's status (``"status"``), of the
        execute-only programs (by inside path) and of the synthetic ``/etc`` files (by name)."""
        a = [shutil.which("prlimit") or "prlimit", *self.limits(), "--", self.bwrap,
             "--unshare-all", "--unshare-user", "--disable-userns", "--uid", str(SANDBOX_UID), "--gid", str(SANDBOX_UID),
             "--hostname", "sandbox", "--cap-drop", "ALL", "--die-with-parent", "--new-session", "--as-pid-1",
             "--seccomp", str(fds["seccomp"]), "--json-status-fd", str(fds["status"]), "--ro-bind", "/usr", "/usr"]
        for path in hidden_debuggers():
            a += ["--ro-bind", "/dev/null", path]
        for name in ("bin", "sbin", "lib", "lib32", "lib64", "libx32"):
            path = "/" + name
            if os.path.islink(path):
                a += ["--symlink", os.readlink(path), path]
            elif os.path.isdir(path):
                a += ["--ro-bind", path, path]
        a += ["--ro-bind-try", "/etc/alternatives", "/etc/alternatives",
              "--ro-bind-try", "/etc/ld.so.cache", "/etc/ld.so.cache"]
        for name, fd in fds.items():
            if name in _ETC:
                a += ["--perms", "0644", "--ro-bind-data", str(fd), f"/etc/{name}"]
            elif name in EXEC_ONLY:  # mode 0111: the kernel makes its process non-dumpable (no /proc/PID/mem, fd)
                a += ["--perms", "0111", "--ro-bind-data", str(fd), name]
        tmp, work = str(self.tmp_size_mb << 20), str(self.work_size_mb << 20)
        a += ["--proc", "/proc", "--dev", "/dev", "--size", tmp, "--tmpfs", "/dev/shm", "--remount-ro", "/dev",
              "--size", tmp, "--tmpfs", "/tmp", "--size", work, "--tmpfs", "/work", "--remount-ro", "/",
              "--chdir", "/work", "--clearenv"]
        for key, value in _ENV.items():
            a += ["--setenv", key, value]
        return a + ["--", _INIT, "--noprofile", "--norc", "-c", _WRAPPER, "sandbox", f"{timeout_s:g}", command]

    def run(self, command: str, state: bytes, timeout_s: float | None = None) -> SandboxResult:
        """Run ``command`` (bash) in ``/work`` restored from ``state``; never raises for what the
        command does (only for host-side errors such as a missing bwrap, and ``ValueError`` for a
        command that cannot be a program argument at all, see :func:`unpassable`)."""
        problem = unpassable(command)
        if problem is not None:
            raise ValueError(f"cannot run the command: {problem}")
        limit = self.timeout_s if timeout_s is None else float(timeout_s)
        fds = {"seccomp": _memfd(seccomp_filter()), "status": _memfd(),
               **{path: _memfd(program_bytes(name)) for path, name in EXEC_ONLY.items()},
               **{name: _memfd(text.encode()) for name, text in _ETC.items()}}
        fd_in, fd_out, fd_rep = _memfd(state), _memfd(), _memfd()
        user = {} if self.host_uid is None else {"user": self.host_uid, "group": self.host_uid, "extra_groups": []}
        t0 = time.perf_counter()
        try:
            proc = subprocess.Popen(self.argv(command, limit, fds), stdin=fd_in, stdout=fd_out, stderr=fd_rep,
                                    pass_fds=tuple(fds.values()), cwd="/", start_new_session=True, **user)
            try:
                proc.wait(limit + self.grace_s)
                killed = False
            except subprocess.TimeoutExpired:
                killed = True
                try:
                    os.killpg(proc.pid, signal.SIGKILL)  # --die-with-parent takes the namespace down with it
                except ProcessLookupError:
                    pass
                proc.wait()
            seconds = time.perf_counter() - t0
            size = os.fstat(fd_out).st_size
            raw = os.pread(fd_out, self.max_output_bytes, 0)
            report = os.pread(fd_rep, min(os.fstat(fd_rep).st_size, self.max_file_bytes + (1 << 16)), 0)
            status = os.pread(fds["status"], 1 << 16, 0)
        finally:
            for fd in (fd_in, fd_out, fd_rep, *fds.values()):
                os.close(fd)
        output = raw.decode("utf-8", errors="replace")
        if killed:
            return SandboxResult(output, size, None, True, False, None, seconds, "")
        return self._result(report, _exit_status(status), output, size, seconds, limit)

    def _result(self, report: bytes, exit_status: int | None | bool, output: str, size: int, seconds: float,
                limit: float) -> SandboxResult:
        """Check the report line and the archive against bwrap's own exit status of pid 1."""
        def fail(error: str = "", rejected: str = "") -> SandboxResult:
            return SandboxResult(output, size, None, False, False, None, seconds, error, rejected)

        if exit_status is False:  # bwrap never started the sandbox: its message is on the report channel
            return fail(report[:2000].decode(errors="replace").strip() or "bwrap failed with no message")
        line_end = report.find(b"\n")
        fields = report[len(REPORT):line_end].decode(errors="replace").split() if report.startswith(REPORT) else []
        if (len(fields) != 4 or fields[0] not in ("setup", "syntax", "run") or not fields[1].isdigit()
                or int(fields[1]) != exit_status):
            return fail(rejected=f"the report {report[:80]!r} does not match the exit status {exit_status} of "
                                 "the sandbox's pid 1 (forged or garbled)")
        phase, rc = fields[0], int(fields[1])
        if phase == "setup":
            return fail("the sandbox could not unpack the work dir")
        try:
            elapsed = float(fields[3]) - float(fields[2])
        except ValueError:
            return fail(rejected=f"the report {report[:80]!r} has unreadable times")
        state: bytes | None = report[line_end + 1:]
        reason = check_archive(state, max_members=self.max_members, max_bytes=self.max_file_bytes)
        if reason is not None and not reason.startswith(LIMIT_REASONS):  # GNU tar never writes that: tampering
            return fail(rejected=f"the returned archive is malformed: {reason}")
        error = ""
        if reason is not None:
            state, error = None, f"the returned archive was not kept: {reason}"
        if phase == "syntax":
            return SandboxResult(output, size, 2, False, True, state, seconds, error)
        timed_out = rc == 128 + signal.SIGKILL and elapsed >= limit - 0.05
        return SandboxResult(output, size, None if timed_out else rc, timed_out, False, state, seconds, error)


def unpassable(command: str) -> str | None:
    """Why ``command`` cannot be passed to bash as an argument (a NUL byte ends a C string; an unpaired
    surrogate has no bytes), None when it can. Byte-level tokenizers can produce both. Strict UTF-8, not
    ``os.fsencode``, which would pass U+DC80-U+DCFF on as raw bytes (the env's rule too:
    :func:`cope.envs.actions.unencodable`)."""
    if "\x00" in command:
        return "it contains a NUL byte (\\0), which no program argument can hold"
    try:
        command.encode("utf-8")
    except UnicodeEncodeError as exc:
        return f"it is not encodable text ({exc.reason} at character {exc.start})"
    return None


def _exit_status(status: bytes) -> int | None | bool:
    """pid 1's exit code from bwrap's ``--json-status-fd`` lines: False when the sandbox never started,
    None when it started but bwrap reported no exit code."""
    docs = []
    for line in status.decode(errors="replace").splitlines():
        try:
            docs.append(dict(json.loads(line)))
        except (ValueError, TypeError):
            continue
    if not any("child-pid" in d for d in docs):
        return False
    codes = [d["exit-code"] for d in docs if isinstance(d.get("exit-code"), int)]
    return codes[-1] if codes else None
