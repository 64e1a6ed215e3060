"""What keeps a sandboxed command from steering the sandbox's pid 1 (used by :mod:`cope.envs.terminal.sandbox`).

* :func:`seccomp_filter`: a classic-BPF program for bwrap's ``--seccomp`` that denies the cross-process
  calls (``ptrace``, ``process_vm_readv``/``writev``, ``pidfd_getfd``) and every other syscall ABI;
* :data:`EXEC_ONLY`: programs that run from execute-only copies (pid 1's bash, the command's ``timeout``):
  the kernel makes such a process non-dumpable, so ``/proc/<pid>/mem`` and ``/proc/<pid>/fd`` are closed
  to the command even with the same uid;
* :data:`DEBUGGERS`: covered with ``/dev/null`` inside (ptrace is denied anyway; this leaves no hint).
"""
from __future__ import annotations

import os
import platform
import shutil
import struct
from functools import cache

_PATH = "/usr/local/bin:/usr/bin:/bin"
# Covered with /dev/null inside (where they exist under /usr): ptrace is denied anyway, this leaves no hint.
DEBUGGERS = ("gdb", "gdb-multiarch", "gdbserver", "strace", "ltrace", "lldb", "lldb-server")
# machine -> (AUDIT_ARCH_*, numbers of ptrace, process_vm_readv, process_vm_writev, pidfd_getfd)
DENIED_SYSCALLS = {"x86_64": (0xC000003E, (101, 310, 311, 438)), "aarch64": (0xC00000B7, (117, 270, 271, 438))}
# Execute-only copies (inside path -> program): the kernel makes a process that runs one non-dumpable.
EXEC_ONLY = {"/.cope/bash": "bash", "/.cope/timeout": "timeout"}


def seccomp_filter(machine: str | None = None) -> bytes:
    """A classic-BPF seccomp program (``struct sock_filter[]``, what bwrap's ``--seccomp`` reads): on the
    native architecture, ``ptrace``, ``process_vm_readv``, ``process_vm_writev`` and ``pidfd_getfd``
    fail with ``EPERM``; so does every syscall of another ABI (x32 numbers, 32-bit compat), which have
    other numbers for the same calls. Everything else is allowed."""
    machine = machine or platform.machine()
    if machine not in DENIED_SYSCALLS:
        raise OSError(f"no seccomp filter for machine {machine!r} (known: {sorted(DENIED_SYSCALLS)})")
    arch, denied = DENIED_SYSCALLS[machine]
    ld, jeq, jge, ret = 0x20, 0x15, 0x35, 0x06  # BPF_LD|W|ABS, BPF_JMP|JEQ|K, BPF_JMP|JGE|K, BPF_RET|K
    allow, deny = 0x7FFF0000, 0x00050000 | 1  # SECCOMP_RET_ALLOW, SECCOMP_RET_ERRNO | EPERM
    n = len(denied)
    prog = [(ld, 0, 0, 4), (jeq, 1, 0, arch), (ret, 0, 0, deny), (ld, 0, 0, 0),  # seccomp_data.arch, .nr
            (jge, n + 1, 0, 0x40000000 if machine == "x86_64" else 0xFFFFFFFF)]  # x32 syscalls
    prog += [(jeq, n - i, 0, nr) for i, nr in enumerate(denied)]
    prog += [(ret, 0, 0, allow), (ret, 0, 0, deny)]
    return b"".join(struct.pack("=HBBI", *ins) for ins in prog)


@cache
def program_bytes(name: str) -> bytes:
    """The bytes of a program under /usr, for an execute-only copy of it inside the sandbox."""
    found = shutil.which(name, path=_PATH)
    if found is None:
        raise OSError(f"{name} not found under /usr/bin or /bin")
    with open(os.path.realpath(found), "rb") as f:
        return f.read()


def hidden_debuggers() -> list[str]:
    found = {os.path.realpath(os.path.join(d, name)) for d in ("/usr/local/bin", "/usr/local/sbin", "/usr/bin",
                                                                "/usr/sbin") for name in DEBUGGERS}
    return sorted(p for p in found if p.startswith("/usr/") and os.path.isfile(p))
