"""The terminal env's work dir as a value: tar bytes packed on the host or by the sandbox, read in memory.

The host never unpacks a sandbox-made archive onto its own disk, and it never hands one to
:mod:`tarfile` before :func:`check_archive` has accepted it: a strict, linear scan of the headers
(GNU/ustar only; no pax headers, whose ``size`` can be negative; no negative base-256 sizes, which
send Python 3.11's ``tarfile`` back to an earlier header forever, CVE-2025-8194; checksums; data inside
the archive; no absolute or ``..`` names; hard links only to an earlier regular file; capped member
count and bytes; a time limit). :class:`Snapshot` then only parses it, and a symlink is reported as a
symlink, never followed. Paths are relative to ``/work`` without a leading ``./`` (``"notes/a.txt"``);
the work dir itself is ``""``.
"""
from __future__ import annotations

import io
import posixpath
import tarfile
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

SANDBOX_UID = 1000
MTIME = 1_700_000_000  # fixed timestamp of host-made files (deterministic archives)
MAX_MEMBERS = 20_000  # default cap of check_archive (a work dir of a shell task has a few dozen)
MAX_BYTES = 256 << 20  # default cap of an archive's size
MAX_SECONDS = 2.0  # default time limit of check_archive (a 19 000-member archive took 0.3 s on a loaded core)
LIMIT_REASONS = ("cut off", "over the limit")  # check_archive reasons that mean "too big", not "malformed"
_BLOCK = 512
_MAGICS = (b"ustar  \x00", b"ustar\x0000")  # GNU, POSIX ustar
_DATA = frozenset(b"07")  # regular file, contiguous file (an untyped "\\0" member is one of these or a dir)
_NO_DATA = frozenset(b"123456")  # hard link, symlink, char/block device, directory, fifo: size must be 0
_LONG = frozenset(b"LK")  # GNU long name / long link name: the next header's name, as data
_MAX_LONG = 1 << 16


def normalize(path: str) -> str:
    """``./a//b/`` -> ``a/b``; ``.`` -> ``""``."""
    p = posixpath.normpath("/" + path.strip()).lstrip("/")
    return "" if p == "." else p


def pack(files: Mapping[str, str | bytes], modes: Mapping[str, int] | None = None, dirs: Iterable[str] = ()) -> bytes:
    """A work-dir archive with ``files`` (path -> content; mode 0644 unless given in ``modes``) and the
    (possibly empty) directories ``dirs``; parents are created with mode 0755 (or ``modes[dir]``)."""
    modes = {normalize(k): v for k, v in (modes or {}).items()}
    files = {normalize(k): v.encode() if isinstance(v, str) else bytes(v) for k, v in files.items()}
    all_dirs = {normalize(d) for d in dirs}
    for p in [*files, *all_dirs]:
        while (p := posixpath.dirname(p)) != "":
            all_dirs.add(p)
    all_dirs.discard("")
    if "" in files or all_dirs & set(files):
        raise ValueError("pack: a path is both a file and a directory")
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.GNU_FORMAT) as tar:
        tar.addfile(_info("", tarfile.DIRTYPE, 0o755))  # "./": the work dir itself
        for name in sorted(all_dirs):
            tar.addfile(_info(name + "/", tarfile.DIRTYPE, modes.get(name, 0o755)))
        for name in sorted(files):
            info = _info(name, tarfile.REGTYPE, modes.get(name, 0o644))
            info.size = len(files[name])
            tar.addfile(info, io.BytesIO(files[name]))
    return buf.getvalue()


def _info(name: str, kind: bytes, mode: int) -> tarfile.TarInfo:
    info = tarfile.TarInfo("./" + name if name else "./")
    info.type, info.mode, info.mtime = kind, mode, MTIME
    info.uid = info.gid = SANDBOX_UID
    info.uname = info.gname = "agent"
    return info


def add_files(state: bytes, files: Mapping[str, str | bytes]) -> bytes:
    """``state`` with extra (or replaced) regular files, e.g. a checker's hidden test input. The original
    members are copied verbatim (never extracted)."""
    reason = check_archive(state)
    if reason is not None:
        raise ValueError(f"not a valid work-dir archive: {reason}")
    extra = {normalize(k): v.encode() if isinstance(v, str) else bytes(v) for k, v in files.items()}
    src = tarfile.open(fileobj=io.BytesIO(state), mode="r:")  # noqa: SIM115 -- in memory, nothing to close
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.GNU_FORMAT) as out:
        for m in src.getmembers():
            if normalize(m.name) in extra:
                continue
            out.addfile(m, src.extractfile(m) if m.isreg() else None)
        for name, data in sorted(extra.items()):
            info = _info(name, tarfile.REGTYPE, 0o644)
            info.size = len(data)
            out.addfile(info, io.BytesIO(data))
    return buf.getvalue()


@dataclass(frozen=True)
class Entry:
    kind: str  # "file", "dir", "symlink" or "other" (fifo, hard link to a missing file, ...)
    mode: int  # permission bits, e.g. 0o644
    size: int
    link: str = ""  # symlink target


class Snapshot:
    """Read-only view of a work-dir archive (raises ``ValueError`` when ``state`` is not a complete one)."""

    def __init__(self, state: bytes) -> None:
        reason = check_archive(state)
        if reason is not None:
            raise ValueError(f"not a valid work-dir archive: {reason}")
        self._tar = tarfile.open(fileobj=io.BytesIO(state), mode="r:")  # noqa: SIM115 -- in memory, kept open
        self._members: dict[str, tarfile.TarInfo] = {}
        self.entries: dict[str, Entry] = {}
        for m in self._tar.getmembers():
            path = normalize(m.name)
            if path == "":
                continue
            kind = ("file" if m.isreg() or (m.islnk() and normalize(m.linkname) in self._members)
                    else "dir" if m.isdir() else "symlink" if m.issym() else "other")
            self._members[path] = m
            self.entries[path] = Entry(kind, m.mode & 0o7777, m.size, m.linkname if m.issym() else "")

    def kind(self, path: str) -> str | None:
        entry = self.entries.get(normalize(path))
        return None if entry is None else entry.kind

    def exists(self, path: str) -> bool:
        return normalize(path) in self.entries

    def is_file(self, path: str) -> bool:
        return self.kind(path) == "file"

    def is_dir(self, path: str) -> bool:
        return normalize(path) == "" or self.kind(path) == "dir"

    def mode(self, path: str) -> int | None:
        entry = self.entries.get(normalize(path))
        return None if entry is None else entry.mode

    def link(self, path: str) -> str | None:
        """A symlink's target text, None when ``path`` is not a symlink."""
        entry = self.entries.get(normalize(path))
        return entry.link if entry is not None and entry.kind == "symlink" else None

    def read(self, path: str) -> bytes | None:
        """A regular file's bytes (symlinks are not followed), None otherwise."""
        path = normalize(path)
        if self.kind(path) != "file":
            return None
        f = self._tar.extractfile(self._members[path])
        return f.read() if f is not None else None

    def text(self, path: str) -> str | None:
        data = self.read(path)
        try:
            return None if data is None else data.decode("utf-8")
        except UnicodeDecodeError:
            return None

    def lines(self, path: str) -> list[str] | None:
        """A text file's lines without line ends (a final newline is optional)."""
        text = self.text(path)
        return None if text is None else text.splitlines()

    def files(self, under: str = "") -> list[str]:
        """Regular files under a directory (recursively), sorted."""
        base = normalize(under)
        prefix = base + "/" if base else ""
        return sorted(p for p, e in self.entries.items() if e.kind == "file" and p.startswith(prefix))

    def listdir(self, path: str = "") -> list[str]:
        """Names directly inside a directory, sorted."""
        base = normalize(path)
        return sorted(p.rsplit("/", 1)[-1] for p in self.entries if posixpath.dirname(p) == base)


def is_complete(state: bytes) -> bool:
    """True when ``state`` is a whole, valid work-dir archive (see :func:`check_archive`). A cut-off
    archive (e.g. packing stopped by the file-size limit) is not complete."""
    return check_archive(state) is None


def check_archive(state: bytes, max_members: int = MAX_MEMBERS, max_bytes: int = MAX_BYTES,
                  max_seconds: float = MAX_SECONDS) -> str | None:
    """None when ``state`` is a complete work-dir archive that is safe to give to :mod:`tarfile`, else
    why not. It reads each header the way Python's ``tarfile`` does (so both see the same members) and
    only moves forward, so it ends after ``len(state) / 512`` steps at the latest; ``max_seconds``
    bounds it on a slow machine too."""
    if not isinstance(state, (bytes, bytearray)):
        return f"not bytes but {type(state).__name__}"
    if len(state) > max_bytes:
        return f"over the limit: {len(state)} bytes > {max_bytes}"
    off, members, pending = 0, 0, {}  # pending: a GNU long name ("L") / link name ("K") for the next header
    regular, seen = set(), set()
    deadline = time.monotonic() + max_seconds
    while True:
        block = bytes(state[off:off + _BLOCK])
        if len(block) < _BLOCK:
            return f"cut off at byte {off} (no end-of-archive marker)"
        if block == bytes(_BLOCK):
            if state[off + _BLOCK:off + 2 * _BLOCK] != bytes(_BLOCK):
                return f"cut off at byte {off} (one zero block instead of two)"
            return ("a long name with no member after it" if pending else "no members" if not members else None)
        members += 1
        if members > max_members:
            return f"over the limit: more than {max_members} members"
        if members % 256 == 0 and time.monotonic() > deadline:
            return f"over the limit: not checked within {max_seconds:g} s"
        problem, kind, size, name, link = _header(block)
        padded = -(-size // _BLOCK) * _BLOCK
        if problem:
            return f"header at byte {off}: {problem}"
        if off + _BLOCK + padded > len(state):
            return f"cut off in the {size} bytes of data of the member at byte {off}"
        if kind in _LONG:
            if kind in pending or size > _MAX_LONG:
                return f"header at byte {off}: a second or over-long ({size} bytes) GNU long name"
            pending[kind] = bytes(state[off + _BLOCK:off + _BLOCK + padded]).split(b"\x00", 1)[0].decode(
                "utf-8", "surrogateescape")
        else:
            name, link = pending.pop(ord("L"), name), pending.pop(ord("K"), link)
            problem = _member_problem(kind, normalize(name), name, link, regular, seen)
            if problem:
                return f"member {name!r}: {problem}"
        off += _BLOCK + padded


def _header(block: bytes) -> tuple[str, int, int, str, str]:
    """(problem or "", type byte, data size, name, link name) of one 512-byte header, read like
    ``tarfile.TarInfo.frombuf`` (an untyped member whose name ends in ``/`` is a directory; a ustar
    prefix is joined to the name)."""
    if block[257:265] not in _MAGICS:
        return "not a GNU or ustar header", 0, 0, "", ""
    if _octal(block[148:156]) != sum(block[:148]) + 8 * 32 + sum(block[156:]):
        return "bad checksum", 0, 0, "", ""
    raw = block[:100].split(b"\x00", 1)[0]
    kind = block[156] or (ord("5") if raw.endswith(b"/") else ord("0"))
    if kind not in _DATA and kind not in _NO_DATA and kind not in _LONG:
        return f"member type {chr(kind)!r} is not allowed (only files, dirs, links, fifos, devices)", 0, 0, "", ""
    field = block[124:136]
    if field[0] == 0xFF:
        return "a negative size (GNU base-256)", 0, 0, "", ""
    size = int.from_bytes(field[1:], "big") if field[0] == 0x80 else _octal(field)
    if size is None:
        return "an unreadable size field", 0, 0, "", ""
    if kind in _NO_DATA and size:
        return f"a member of type {chr(kind)!r} with {size} bytes of data", 0, 0, "", ""
    prefix = block[345:500].split(b"\x00", 1)[0]
    name = prefix + b"/" + raw if prefix and kind not in _LONG else raw
    link = block[157:257].split(b"\x00", 1)[0]
    return "", kind, size, name.decode("utf-8", "surrogateescape"), link.decode("utf-8", "surrogateescape")


def _octal(field: bytes) -> int | None:
    text = field.split(b"\x00", 1)[0].strip(b" ")
    return int(text, 8) if text and all(48 <= c <= 55 for c in text) else None


def _member_problem(kind: int, path: str, name: str, link: str, regular: set[str], seen: set[str]) -> str:
    """Why a member is refused ("" when it is fine); records it in ``regular``/``seen``."""
    for text, what in ((name, "name"), *(((link, "hard link target"),) if kind == ord("1") else ())):
        if not text:
            return f"an empty {what}"
        if text.startswith("/") or ".." in text.split("/"):
            return f"an absolute {what} or one with '..'"
    if path in seen:
        return "a second member with this name"
    if kind == ord("1") and normalize(link) not in regular:
        return f"a hard link to {link!r}, which is not an earlier regular file"
    seen.add(path)
    if kind in _DATA:
        regular.add(path)
    return ""
