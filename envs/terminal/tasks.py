"""The terminal env's task suite: self-made, seeded shell tasks in families (files, text, scripts, git).

A family is a function ``rng -> TerminalTask``; every task of a family has the same shape and its own
content (file names, words, numbers) drawn from ``random.Random(f"terminal/{family}/{split}/{index}")``,
so the same (family, split, index) always gives the same task and train/test draw from disjoint seeds.
The families live in :mod:`~cope.envs.terminal.tasks_files`, :mod:`~cope.envs.terminal.tasks_text` and
:mod:`~cope.envs.terminal.tasks_code`; :func:`families` lists them in a fixed order.

A task has an instruction, the files of ``/work`` at the start, optional trusted setup commands (run in
the sandbox at reset, e.g. to build a git history), a reference solution (shell commands; ``submit``
follows), the programs it needs inside the sandbox, and a checker. The checker runs on the host: it
reads the final work dir through :class:`~cope.envs.terminal.workdir.Snapshot` (in memory, symlinks never
followed) and may run *fixed* commands in a throw-away sandbox on the final state (``run``; e.g. the
agent's script on a hidden input, or ``git log``), but never executes agent-written code on the host.
"""
from __future__ import annotations

import random

from cope.envs.terminal import tasks_code, tasks_files, tasks_text
from cope.envs.terminal.task_kit import Family, TerminalTask

__all__ = ["Family", "TerminalTask", "families", "make_task"]


def families() -> dict[str, Family]:
    """All task families, name -> generator, in a fixed order."""
    return {**tasks_files.FAMILIES, **tasks_text.FAMILIES, **tasks_code.FAMILIES}


def make_task(family: str, split: str, index: int) -> TerminalTask:
    """Task ``index`` of ``family`` in ``split`` (deterministic)."""
    task = families()[family](random.Random(f"terminal/{family}/{split}/{index}"))
    if task.family != family:
        raise RuntimeError(f"family {family!r} produced a task of family {task.family!r}")
    return task


