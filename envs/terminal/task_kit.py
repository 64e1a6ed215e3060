"""What the terminal task families share: the task record, the word pools, and the checkers and text helpers.

The families (:mod:`~cope.envs.terminal.tasks_files`, :mod:`~cope.envs.terminal.tasks_text`,
:mod:`~cope.envs.terminal.tasks_code`) build on it; :mod:`~cope.envs.terminal.tasks` lists them. Kept apart from
that list so that the families and the list import one way only.
"""
from __future__ import annotations

import random
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from cope.envs.terminal.workdir import Snapshot, normalize

# run(command, extra_files) -> (exit code or None on timeout, output): a fixed command in a sandbox on the final state
Runner = Callable[..., tuple]
Checker = Callable[[Snapshot, Runner], bool]

WORDS = ("apple", "river", "stone", "cloud", "maple", "tiger", "ocean", "pixel", "amber", "cedar", "delta", "ember",
         "falcon", "garnet", "harbor", "iris", "jasper", "kettle", "lemon", "meadow", "nectar", "orbit", "pepper",
         "quartz", "raven", "saffron", "timber", "umber", "velvet", "willow", "yarrow", "zephyr", "basil", "copper",
         "dune", "fern", "glacier", "hazel", "indigo", "juniper", "lotus", "marble", "nutmeg", "olive", "pebble")
NAMES = ("ana", "ben", "carla", "dmitri", "elena", "farid", "grace", "hugo", "ines", "jonas", "kira", "liam", "mona",
         "nils", "olga", "pablo", "quinn", "rosa", "sami", "tara", "uma", "victor", "wendy", "xavier", "yara", "zane")
CITIES = ("paris", "lima", "oslo", "cairo", "delhi", "tokyo", "quito", "rome", "seoul", "dakar", "perth", "boston")


@dataclass(frozen=True)
class TerminalTask:
    family: str
    instruction: str
    files: Mapping[str, str | bytes]
    solution: tuple[str, ...]  # shell commands that solve it (the env's `submit` comes after)
    check: Checker = field(repr=False)
    modes: Mapping[str, int] = field(default_factory=dict)
    dirs: tuple[str, ...] = ()
    setup: tuple[str, ...] = ()  # trusted commands run in the sandbox at reset, after the files are in place
    needs: tuple[str, ...] = ()  # programs that must exist in the sandbox besides coreutils/grep/sed/awk/tar


Family = Callable[[random.Random], TerminalTask]


# ---- helpers shared by the family modules ----------------------------------------------------------------

def words(rng: random.Random, k: int, pool: tuple[str, ...] = WORDS) -> list[str]:
    """``k`` distinct words."""
    return rng.sample(pool, k)


def text_of(lines: list[str]) -> str:
    return "".join(line + "\n" for line in lines)


def same_lines(snap: Snapshot, path: str, expected: list[str]) -> bool:
    """``path`` is a regular file whose lines are ``expected`` (a missing final newline is fine)."""
    return snap.lines(path) == expected


def answer_is(expected: str, path: str = "answer.txt") -> Checker:
    """The file's text, stripped, equals ``expected``."""

    def check(snap: Snapshot, run: Runner) -> bool:
        text = snap.text(path)
        return text is not None and text.strip() == expected

    return check


def path_answer_is(expected: str, path: str = "answer.txt") -> Checker:
    """The file holds one path that names ``expected`` (``./x`` and ``/work/x`` spellings accepted)."""

    def check(snap: Snapshot, run: Runner) -> bool:
        text = (snap.text(path) or "").strip()
        text = text.removeprefix("/work/")
        return bool(text) and "\n" not in text and normalize(text) == normalize(expected)

    return check


def lines_are(path: str, expected: list[str]) -> Checker:
    def check(snap: Snapshot, run: Runner) -> bool:
        return same_lines(snap, path, expected)

    return check


def all_of(*checks: Checker) -> Checker:
    def check(snap: Snapshot, run: Runner) -> bool:
        return all(c(snap, run) for c in checks)

    return check


def quote(text: str) -> str:
    """Single-quoted for bash (the generators only use quote-free text; this keeps solutions honest)."""
    return "'" + text.replace("'", "'\\''") + "'"
