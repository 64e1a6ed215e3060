"""The terminal env's work dir as a value: tar bytes packed on the host or by the sandbox, read in memory.

The host never unpacks a sandbox-made archive onto its own disk, so a hostile archive (absolute
paths, ``..``, symlinks to host files, device nodes) cannot touch the host: :class:`Snapshot` only
parses it, and a symlink is reported as a symlink, never followed. Paths are relative to ``/work``
without a leading ``./`` (``"notes/a.txt"``); the work dir itself is ``""``.
"""
from __future__ import annotations

import io
import posixpath
import tarfile
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

SANDBOX_UID = 1000
MTIME = 1_700_000_000  # fixed timestamp of host-made files (deterministic archives)


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
        if not is_complete(state):
            raise ValueError("not a complete work-dir archive")
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
    """True when ``state`` is a whole tar archive: every member's data inside it, then the end marker
    (two zero blocks). A cut-off archive (e.g. packing stopped by the file-size limit) is not complete."""
    try:
        with tarfile.open(fileobj=io.BytesIO(state), mode="r:") as tar:
            members = tar.getmembers()
            end = tar.offset
    except (tarfile.TarError, EOFError, ValueError):
        return False
    if any(m.offset_data + (m.size if m.isreg() else 0) > len(state) for m in members):
        return False
    return state[end:end + 1024] == bytes(1024)
