"""ScienceWorld's task table and the map from our ``Task.index`` to a (task name, variation) pair.

The table is ScienceWorld 1.2.3's own (30 tasks, 7,207 variations): each task's variations are split by
the simulator into contiguous ranges ``train | dev | test`` (``getVariationsTrain/Dev/Test``). It is
copied here so that ``num_tasks`` and the index map need no JVM (the trainer builds a throw-away env
instance just to ask for ``num_tasks``); ``tests/envs/test_scienceworld.py`` checks it against the
simulator.

Our splits: ``train`` = ScienceWorld's train variations; ``test`` = its ``dev`` or ``test`` variations
(``test_split``). The selected tasks' variation lists are *interleaved*: index 0 is the first variation
of the first selected task, index 1 the first variation of the second task, ... then the second
variations, and so on (a task whose list is used up drops out of the rotation). Every (task, variation)
pair of the split appears exactly once, and any prefix ``0..k-1`` of the indices (the validation panel
is the first ``data.val_tasks`` indices) spreads over all selected tasks. Stdlib only.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

# (paper id, simulator name, variations, train count, dev count); test = the rest. Paper order.
TASK_TABLE: tuple[tuple[str, str, int, int, int], ...] = (
    ("1-1", "boil", 30, 14, 7),
    ("1-2", "melt", 30, 14, 7),
    ("1-3", "freeze", 30, 14, 7),
    ("1-4", "change-the-state-of-matter-of", 30, 14, 7),
    ("2-1", "use-thermometer", 540, 270, 135),
    ("2-2", "measure-melting-point-known-substance", 436, 218, 109),
    ("2-3", "measure-melting-point-unknown-substance", 300, 150, 75),
    ("3-1", "power-component", 20, 10, 5),
    ("3-2", "power-component-renewable-vs-nonrenewable-energy", 20, 10, 5),
    ("3-3", "test-conductivity", 900, 450, 225),
    ("3-4", "test-conductivity-of-unknown-substances", 600, 300, 150),
    ("4-1", "find-living-thing", 300, 150, 75),
    ("4-2", "find-non-living-thing", 300, 150, 75),
    ("4-3", "find-plant", 300, 150, 75),
    ("4-4", "find-animal", 300, 150, 75),
    ("5-1", "grow-plant", 126, 62, 31),
    ("5-2", "grow-fruit", 126, 62, 31),
    ("6-1", "chemistry-mix", 32, 16, 8),
    ("6-2", "chemistry-mix-paint-secondary-color", 36, 18, 9),
    ("6-3", "chemistry-mix-paint-tertiary-color", 36, 18, 9),
    ("7-1", "lifespan-longest-lived", 125, 62, 31),
    ("7-2", "lifespan-shortest-lived", 125, 62, 31),
    ("7-3", "lifespan-longest-lived-then-shortest-lived", 125, 62, 31),
    ("8-1", "identify-life-stages-1", 14, 6, 3),
    ("8-2", "identify-life-stages-2", 10, 4, 2),
    ("9-1", "inclined-plane-determine-angle", 168, 84, 42),
    ("9-2", "inclined-plane-friction-named-surfaces", 1386, 692, 346),
    ("9-3", "inclined-plane-friction-unnamed-surfaces", 162, 80, 40),
    ("10-1", "mendelian-genetics-known-plant", 120, 60, 30),
    ("10-2", "mendelian-genetics-unknown-plant", 480, 240, 120),
)
TASK_NAMES: tuple[str, ...] = tuple(row[1] for row in TASK_TABLE)
_BY_NAME = {row[1]: row for row in TASK_TABLE}
_BY_ID = {row[0]: row[1] for row in TASK_TABLE}

# Simplification flags the simulator accepts ("easy" = all that apply to the task).
SIMPLIFICATIONS = ("easy", "teleportAction", "selfWateringFlowerPots", "openContainers", "openDoors",
                   "noElectricalAction")
TEST_SPLITS = ("dev", "test")


def is_electrical(task: str) -> bool:
    """Tasks that need ``connect``/``disconnect`` (the package refuses ``noElectricalAction`` for them)."""
    return "power-component" in task or "conductivity" in task


def resolve_tasks(tasks: Sequence[str] | None) -> tuple[str, ...]:
    """Simulator names for ``tasks`` (names like ``boil`` or paper ids like ``1-1``), in the given order;
    None or empty: all 30 in paper order. Raises ValueError naming ``tasks`` on unknown or repeated ones."""
    if tasks is None or len(tasks) == 0:
        return TASK_NAMES
    if isinstance(tasks, str):
        raise ValueError(f"tasks must be a list of task names or ids, got the string {tasks!r}")
    names = []
    for t in tasks:
        key = str(t).strip()
        name = _BY_ID.get(key, key)
        if name not in _BY_NAME:
            raise ValueError(f"tasks: unknown ScienceWorld task {t!r}; known ids {sorted(_BY_ID)} "
                             f"and names {list(TASK_NAMES)}")
        if name in names:
            raise ValueError(f"tasks: {t!r} is listed twice")
        names.append(name)
    return tuple(names)


def parse_simplifications(text: str, tasks: Sequence[str]) -> str:
    """The simulator's comma-separated simplification string, validated (ValueError names
    ``simplifications``). Spaces around commas are dropped."""
    if not isinstance(text, str):
        raise ValueError(f"simplifications must be a comma-separated string, got {text!r}")
    flags = [f.strip() for f in text.split(",") if f.strip()]
    for f in flags:
        if f not in SIMPLIFICATIONS:
            raise ValueError(f"simplifications: unknown flag {f!r}; known: {', '.join(SIMPLIFICATIONS)}")
    if len(set(flags)) != len(flags):
        raise ValueError(f"simplifications: a flag is repeated in {text!r}")
    if "noElectricalAction" in flags:
        electrical = [t for t in tasks if is_electrical(t)]
        if electrical:
            raise ValueError(f"simplifications: noElectricalAction removes the actions that tasks {electrical} "
                             "need; drop those tasks or the flag ('easy' keeps them for electrical tasks)")
    return ",".join(flags)


def split_variations(task: str, split: str, test_split: str = "dev") -> range:
    """ScienceWorld's variation indices of ``task`` for our ``split`` (``test`` -> its ``test_split``)."""
    _, _, total, n_train, n_dev = _BY_NAME[task]
    if split == "train":
        return range(n_train)
    if test_split == "dev":
        return range(n_train, n_train + n_dev)
    return range(n_train + n_dev, total)


@dataclass(frozen=True)
class TaskMap:
    """Interleaved (task, variation) pairs of one split; ``pairs[index]`` is the task of ``index``."""

    pairs: tuple[tuple[str, int], ...]

    @classmethod
    def build(cls, tasks: Sequence[str], split: str, test_split: str, max_variations_per_task: int = 0) -> TaskMap:
        lists = [list(split_variations(t, split, test_split)) for t in tasks]
        if max_variations_per_task > 0:
            lists = [v[:max_variations_per_task] for v in lists]
        longest = max(len(v) for v in lists)
        pairs = tuple((t, v[k]) for k in range(longest) for t, v in zip(tasks, lists) if k < len(v))
        return cls(pairs)

    def __len__(self) -> int:
        return len(self.pairs)
