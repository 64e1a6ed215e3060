"""The environment protocol every env implements (mazes now; ScienceWorld, ALFWorld, ... next).

An env instance runs one episode at a time: ``reset(task)`` then ``step(action)`` until ``done``.
The trainer creates one instance per concurrent episode from a factory (a Hydra ``_partial_``),
so per-episode state lives on the instance and nothing is shared between episodes.

Text coming back from an env is split in two so the ECHO objective can tell them apart:

* ``observation``: what the world said (env output; a training target for ECHO);
* ``harness``: what our adapter added (format warnings, truncation notices); never a target.

This module and every env module import without torch.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

SPLITS = ("train", "test")


def check_split(split: str) -> str:
    """``split`` itself, or a ValueError naming the known splits."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    return split


@dataclass(frozen=True)
class Task:
    """One task: a split and an index inside it. The env turns the index into a concrete task
    (for mazes, the layout seed). Episodes of one GRPO group share the same Task."""

    env: str
    split: str
    index: int

    @property
    def id(self) -> str:
        return f"{self.env}/{self.split}/{self.index}"


@dataclass
class EnvReset:
    observation: str  # env output shown to the agent first (role: observation)
    task_description: str = ""  # goal in words (already contained in `observation` if the env shows it)
    admissible_actions: list[str] | None = None  # None when the env does not know them
    info: dict[str, Any] = field(default_factory=dict)
    harness: str = ""  # adapter-added text (e.g. a truncation notice), shown after `observation`, never a target


@dataclass
class EnvStep:
    observation: str  # env output (ECHO target); may be empty, e.g. when the action was unparsable
    reward: float
    done: bool
    valid: bool  # False: the action was malformed or had no effect the env considers legal
    success: bool  # the env's own success flag; CoPE builds forecast targets only from successes
    score: float  # running task score (for mazes: 1.0 on success else 0.0)
    harness: str = ""  # adapter-added text (warnings), shown after `observation`, never an ECHO target
    admissible_actions: list[str] | None = None
    info: dict[str, Any] = field(default_factory=dict)


@runtime_checkable
class Env(Protocol):
    """What the rollout engine needs from an environment."""

    name: str
    max_steps: int  # the engine ends the episode (end_reason="max_steps") after this many actions

    @property
    def instructions(self) -> str:
        """System prompt: the rules and the action format."""
        ...

    def num_tasks(self, split: str) -> int:
        """How many distinct tasks the split has (tasks are indexed 0..n-1)."""
        ...

    def reset(self, task: Task) -> EnvReset: ...

    def step(self, action: str) -> EnvStep: ...

    def close(self) -> None: ...


# Optional, not part of the protocol check:
# * ``example_actions(self) -> list[str]``: an env whose steps report no admissible actions (a shell,
#   tool calls) may list a few well-formed actions for the current state. Only the tiny model's
#   format-only warm start (random walks) uses them.
# * ``max_instances: int`` (class attribute): a memory-heavy env (one JVM per instance) says how many
#   instances should live at once; with ``data.max_live_episodes=null`` the DataModule runs an epoch's
#   episodes in waves of that many, and the tiny warm start walks with at most that many.
