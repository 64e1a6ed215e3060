"""Terminal task families: small scripts (bash, python3) and git. The checkers run the agent's script on a
hidden input, or ``git`` on the agent's repository, inside a throw-away sandbox (never on the host).
See :mod:`cope.envs.terminal.tasks` for the task shape."""
from __future__ import annotations

from cope.envs.terminal.task_kit import NAMES, WORDS, TerminalTask, answer_is, quote, text_of, words
from cope.envs.terminal.workdir import Snapshot

# git for checkers: never run hooks or an fsmonitor command the agent may have configured
GIT = "git -c core.fsmonitor=false -c core.hooksPath=/dev/null"


def _output_is(run, command: str, expected: str, files=None) -> bool:
    code, out = run(command, files)
    return code == 0 and out.strip() == expected


def greet_script(rng):
    word = rng.choice(("Hello", "Hi", "Welcome", "Greetings"))
    hidden = rng.sample(NAMES, 2)

    def check(s: Snapshot, run) -> bool:
        return (s.mode("greet.sh") or 0) & 0o100 != 0 and all(
            _output_is(run, f"./greet.sh {n}", f"{word}, {n}!") for n in hidden)

    return TerminalTask("greet_script", f"Write an executable bash script greet.sh that prints '{word}, NAME!' where "
                        f"NAME is its first argument (./greet.sh bob prints: {word}, bob!).", {},
                        (f"printf '#!/bin/bash\\necho \"{word}, $1!\"\\n' > greet.sh", "chmod +x greet.sh"), check)


def count_lines_script(rng):
    hidden = [" ".join(words(rng, 2)) for _ in range(rng.randint(3, 12))]
    example = f"{rng.choice(WORDS)}.txt"

    def check(s: Snapshot, run) -> bool:
        return (s.mode("count.sh") or 0) & 0o100 != 0 and _output_is(
            run, "./count.sh check_input.txt", str(len(hidden)), {"check_input.txt": text_of(hidden)})

    return TerminalTask("count_lines_script", "Write an executable bash script count.sh that prints only the number of "
                        f"lines of the file named by its first argument (try it on {example}).",
                        {example: text_of(words(rng, 4))},
                        ("printf '#!/bin/bash\\nwc -l < \"$1\"\\n' > count.sh", "chmod +x count.sh"), check)


def backup_script(rng):
    present = {f"{w}.txt": "x\n" for w in words(rng, 2)}
    hidden = {f"zz_{w}.txt": "y\n" for w in words(rng, 2)}

    def check(s: Snapshot, run) -> bool:
        code, out = run("./backup.sh && ls backup", hidden)
        return code == 0 and set(present) | set(hidden) <= set(out.split())

    return TerminalTask("backup_script", "Write an executable bash script backup.sh that copies every .txt file of the "
                        "current directory into the directory backup/ (creating it when needed).",
                        {**present, "readme.md": "keep\n"},
                        ("printf '#!/bin/bash\\nmkdir -p backup\\ncp *.txt backup/\\n' > backup.sh", "chmod +x backup.sh"),
                        check)


def python_sum(rng):
    nums = [rng.randint(-50, 500) for _ in range(rng.randint(3, 10))]
    return TerminalTask(
        "python_sum", "Write a Python 3 script sum.py that prints the sum of the integers (one per line) in the file "
        "named by its first argument; it is run as: python3 sum.py FILE", {"sample.txt": text_of(["1", "2", "3"])},
        ("printf 'import sys\\nprint(sum(int(x) for x in open(sys.argv[1]) if x.strip()))\\n' > sum.py",),
        lambda s, run: _output_is(run, "python3 sum.py check_input.txt", str(sum(nums)),
                                  {"check_input.txt": text_of([str(n) for n in nums])}), needs=("python3",))


def python_evens(rng):
    args = [str(rng.randint(1, 99)) for _ in range(rng.randint(4, 9))]
    expected = "\n".join(a for a in args if int(a) % 2 == 0)
    return TerminalTask(
        "python_evens", "Write a Python 3 script evens.py that prints the even numbers among its command-line "
        "arguments, one per line, in order; it is run as: python3 evens.py 3 8 10", {},
        ("printf 'import sys\\nfor a in sys.argv[1:]:\\n    if int(a) %% 2 == 0:\\n        print(a)\\n' > evens.py",),
        lambda s, run: _output_is(run, f"python3 evens.py {' '.join(args)}", expected), needs=("python3",))


def _repo(rng, folder: str = "repo") -> tuple[dict, tuple[str, ...]]:
    files = {f"{folder}/notes.txt": text_of(words(rng, 2)), f"{folder}/README": "a small repository\n"}
    return files, (f"git init -q -b main {folder}", f"cd {folder} && git add -A && git commit -qm 'initial commit'")


def git_init_commit(rng):
    msg = f"add {rng.choice(WORDS)} {rng.choice(('files', 'notes', 'draft'))}"
    files = {f"project/{w}.txt": text_of(words(rng, 2)) for w in words(rng, 3)}
    names = sorted(p.split("/", 1)[1] for p in files)

    def check(s: Snapshot, run) -> bool:
        code, out = run(f"cd project && {GIT} log --format=%s && echo --- && {GIT} status --porcelain && echo --- && "
                        f"{GIT} ls-files")
        parts = out.split("---\n")
        return (code == 0 and len(parts) == 3 and parts[0].strip() == msg and parts[1].strip() == ""
                and sorted(parts[2].split()) == names)

    return TerminalTask("git_init_commit", f"Turn the directory project/ into a git repository and commit all of its "
                        f"files with the message: {msg}", files,
                        (f"cd project && git init -q && git add -A && git commit -qm {quote(msg)}",), check,
                        needs=("git",))


def git_branch(rng):
    files, setup = _repo(rng)
    branch = f"{rng.choice(('feature', 'fix', 'topic'))}-{rng.choice(WORDS)}"
    return TerminalTask("git_branch", f"In the git repository repo/, create a branch named {branch} and switch to it.",
                        files, (f"git -C repo checkout -q -b {branch}",),
                        lambda s, run: _output_is(run, f"{GIT} -C repo rev-parse --abbrev-ref HEAD", branch),
                        setup=setup, needs=("git",))


def git_commit_change(rng):
    files, setup = _repo(rng)
    line, msg = " ".join(words(rng, 3)), f"update notes with {rng.choice(WORDS)}"

    def check(s: Snapshot, run) -> bool:
        code, out = run(f"{GIT} -C repo log --format=%s && echo --- && {GIT} -C repo show HEAD:notes.txt && echo --- "
                        f"&& {GIT} -C repo status --porcelain")
        parts = out.split("---\n")
        return (code == 0 and len(parts) == 3 and parts[0].split("\n")[:2] == [msg, "initial commit"]
                and parts[1].splitlines()[-1:] == [line] and parts[2].strip() == "")

    return TerminalTask("git_commit_change", f"In the git repository repo/, append the line '{line}' to notes.txt and "
                        f"commit the change with the message: {msg}", files,
                        (f"echo {quote(line)} >> repo/notes.txt", f"git -C repo commit -qam {quote(msg)}"), check,
                        setup=setup, needs=("git",))


def git_count_commits(rng):
    files, setup = _repo(rng)
    extra = rng.randint(1, 6)
    setup += ((f"cd repo && for i in $(seq {extra}); do echo $i >> log.txt; git add log.txt; "
               "git commit -qm \"change $i\"; done"),)
    return TerminalTask("git_count_commits", "Write the number of commits of the current branch of the git repository "
                        "repo/ into answer.txt.", files, ("git -C repo rev-list --count HEAD > answer.txt",),
                        answer_is(str(extra + 1)), setup=setup, needs=("git",))


FAMILIES = {f.__name__: f for f in (
    greet_script, count_lines_script, backup_script, python_sum, python_evens,
    git_init_commit, git_branch, git_commit_change, git_count_commits)}
