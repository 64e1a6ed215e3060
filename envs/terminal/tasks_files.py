"""Terminal task families: files and directories (create, move, rename, copy, delete, permissions,
links, archives, finding files). See :mod:`cope.envs.terminal.tasks` for the task shape."""
from __future__ import annotations

import gzip
import io
import random
import tarfile

from cope.envs.terminal.task_kit import (
    NAMES,
    WORDS,
    TerminalTask,
    answer_is,
    path_answer_is,
    quote,
    same_lines,
    text_of,
    words,
)
from cope.envs.terminal.workdir import Snapshot, normalize


def _content(rng: random.Random, n: int = 3) -> str:
    return text_of([" ".join(words(rng, 3)) for _ in range(n)])


def create_file(rng):
    name, line = f"{rng.choice(WORDS)}.txt", " ".join(words(rng, 3))
    return TerminalTask("create_file", f"Create a file named {name} whose only line is: {line}", {},
                        (f"echo {quote(line)} > {name}",), lambda s, r: same_lines(s, name, [line]))


def make_dirs(rng):
    path = "/".join(words(rng, 3))
    return TerminalTask("make_dirs", f"Create the nested directory path {path} (every level).", {},
                        (f"mkdir -p {path}",), lambda s, r: s.is_dir(path))


def rename_file(rng):
    old, new = (f"{w}.txt" for w in words(rng, 2))
    body = _content(rng)
    return TerminalTask("rename_file", f"Rename the file {old} to {new}.", {old: body}, (f"mv {old} {new}",),
                        lambda s, r: s.text(new) == body and not s.exists(old))


def copy_into_dir(rng):
    src, folder = f"{rng.choice(WORDS)}.txt", rng.choice(("backup", "archive", "copies", "saved"))
    body = _content(rng)
    return TerminalTask("copy_into_dir", f"Copy {src} into a new directory {folder}/ under the same name; keep the "
                        "original.", {src: body}, (f"mkdir {folder}", f"cp {src} {folder}/"),
                        lambda s, r: s.text(src) == body and s.text(f"{folder}/{src}") == body)


def delete_by_ext(rng):
    names = words(rng, 6)
    logs = {f"logs/{n}.log": _content(rng, 1) for n in names[:3]}
    keep = {f"logs/{n}.txt": _content(rng, 1) for n in names[3:]}
    return TerminalTask("delete_by_ext", "Delete every .log file in logs/ and keep all the other files.",
                        {**logs, **keep}, ("rm logs/*.log",), lambda s, r: s.files("logs") == sorted(keep))


def move_by_ext(rng):
    names = words(rng, 5)
    md = {f"{n}.md": _content(rng, 1) for n in names[:3]}
    txt = {f"{n}.txt": _content(rng, 1) for n in names[3:]}
    folder = rng.choice(("docs", "notes", "pages"))
    return TerminalTask(
        "move_by_ext", f"Move all .md files of the current directory into a new directory {folder}/.",
        {**md, **txt}, (f"mkdir {folder}", f"mv *.md {folder}/"),
        lambda s, r: (all(s.text(f"{folder}/{k}") == v and not s.exists(k) for k, v in md.items())
                      and all(s.text(k) == v for k, v in txt.items())))


def make_executable(rng):
    path = f"scripts/{rng.choice(WORDS)}.sh"
    return TerminalTask("make_executable", f"Make {path} executable for its owner, group and others (mode 755).",
                        {path: "#!/bin/bash\necho ok\n"}, (f"chmod 755 {path}",), lambda s, r: s.mode(path) == 0o755)


def set_mode(rng):
    path = f"{rng.choice(WORDS)}.{rng.choice(('key', 'cfg', 'dat'))}"
    mode = rng.choice((0o600, 0o640, 0o700, 0o750, 0o444, 0o664))
    return TerminalTask("set_mode", f"Set the permissions of {path} to {mode:o} (octal).", {path: "secret\n"},
                        (f"chmod {mode:o} {path}",), lambda s, r: s.mode(path) == mode and s.text(path) == "secret\n",
                        modes={path: 0o644})


def symlink(rng):
    target, link = f"data/{rng.choice(WORDS)}.txt", f"{rng.choice(NAMES)}_link"

    def check(s: Snapshot, r) -> bool:
        dest = s.link(link)
        return dest is not None and normalize(dest.removeprefix("/work/")) == target

    return TerminalTask("symlink", f"Create a symbolic link named {link} in the current directory that points to "
                        f"{target}.", {target: _content(rng)}, (f"ln -s {target} {link}",), check)


def concat_files(rng):
    parts = [f"part{i}.txt" for i in range(1, rng.randint(3, 4) + 1)]
    rng.shuffle(parts)
    bodies = {p: _content(rng, 2) for p in parts}
    out = f"{rng.choice(WORDS)}_full.txt"
    return TerminalTask("concat_files", f"Concatenate {', '.join(parts)} (in exactly this order) into {out}.", bodies,
                        (f"cat {' '.join(parts)} > {out}",),
                        lambda s, r: s.text(out) == "".join(bodies[p] for p in parts))


def largest_file(rng):
    names = words(rng, 5)
    sizes = rng.sample(range(10, 400), 5)
    files = {f"data/{n}.bin": "x" * size for n, size in zip(names, sizes)}
    best = names[sizes.index(max(sizes))] + ".bin"
    return TerminalTask("largest_file", "Write the name (only the file name) of the largest file in data/ into "
                        "answer.txt.", files, ("ls -S data | head -n 1 > answer.txt",), answer_is(best))


def count_files(rng):
    files = {}
    for _ in range(rng.randint(4, 11)):
        depth = rng.randint(0, 2)
        files["/".join(["tree", *words(rng, depth), f"{rng.choice(WORDS)}{rng.randint(1, 99)}.txt"])] = "x\n"
    dirs = ("tree/" + rng.choice(NAMES),)  # an empty directory, not a file
    return TerminalTask("count_files", "Write the number of regular files under tree/ (all levels) into answer.txt.",
                        files, ("find tree -type f | wc -l > answer.txt",), answer_is(str(len(files))), dirs=dirs)


def make_archive(rng):
    name = rng.choice(WORDS)
    files = {f"project/{w}.txt": _content(rng, 1) for w in words(rng, 3)}

    def check(s: Snapshot, run) -> bool:
        code, out = run(f"tar -tzf {name}.tar.gz")
        listed = {normalize(line) for line in out.splitlines()}
        return code == 0 and set(files) <= listed

    return TerminalTask("make_archive", f"Create a gzip-compressed tar archive {name}.tar.gz of the directory "
                        "project/ (paths inside start with project/).", files,
                        (f"tar -czf {name}.tar.gz project",), check)


def extract_archive(rng):
    files = {f"{rng.choice(('site', 'app', 'kit'))}/{w}.txt": _content(rng, 1) for w in words(rng, 3)}
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.GNU_FORMAT) as tar:
        for path, body in sorted(files.items()):
            info = tarfile.TarInfo(path)
            info.size, info.mtime, info.mode = len(body), 1_700_000_000, 0o644
            tar.addfile(info, io.BytesIO(body.encode()))
    gz = gzip.compress(buf.getvalue(), mtime=0)  # deterministic bytes
    return TerminalTask("extract_archive", "Extract the archive backup.tar.gz into the current directory.",
                        {"backup.tar.gz": gz}, ("tar -xzf backup.tar.gz",),
                        lambda s, r: all(s.text(p) == b for p, b in files.items()))


def rename_ext(rng):
    names = words(rng, rng.randint(2, 4))
    files = {f"docs/{n}.txt": _content(rng, 1) for n in names}
    return TerminalTask(
        "rename_ext", "Change the extension of every .txt file in docs/ to .md (same names, same contents).", files,
        ('for f in docs/*.txt; do mv "$f" "${f%.txt}.md"; done',),
        lambda s, r: s.files("docs") == sorted(f"docs/{n}.md" for n in names)
        and all(s.text(f"docs/{n}.md") == files[f"docs/{n}.txt"] for n in names))


def find_by_content(rng):
    token = f"{rng.choice(WORDS)}{rng.randint(100, 999)}"
    paths = sorted({f"src/{rng.choice(NAMES)}/{rng.choice(WORDS)}.txt" for _ in range(6)})
    secret = rng.choice(paths)
    files = {p: _content(rng, 2) for p in paths}
    files[secret] = files[secret] + f"the key is {token}\n"
    return TerminalTask("find_by_content", f"Exactly one file under src/ contains the word {token}. Write its path "
                        "relative to the current directory (like src/a/b.txt) into answer.txt.", files,
                        (f"grep -rl {token} src > answer.txt",), path_answer_is(secret))


FAMILIES = {f.__name__: f for f in (
    create_file, make_dirs, rename_file, copy_into_dir, delete_by_ext, move_by_ext, make_executable, set_mode, symlink,
    concat_files, largest_file, count_files, make_archive, extract_archive, rename_ext, find_by_content)}
