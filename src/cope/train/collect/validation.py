"""The held-out panel: a fixed set of test tasks, each rank its shard, evaluated greedily at every validation.

The panel is test tasks ``data.val_offset .. data.val_offset + data.val_tasks - 1`` (a tuning panel disjoint from
the reported one is another offset). Each rank evaluates every ``world``-th of them, in chunks of
``data.val_batch_size`` run together; the module calls the DataModule's ``evaluate`` per chunk, and the episodes of
one validation run are gathered in one :class:`~cope.records.ValidationRecord`, whose tally the module pools over
ranks (:func:`cope.train.dist.log_val_metrics`). Validation always samples the newest weights in the main thread,
whichever collector gathers the training episodes.
"""
from __future__ import annotations

from typing import Callable

from cope.envs.base import Task
from cope.episode import Episode
from cope.records import ValidationRecord
from cope.rollout.metrics import episode_metrics


class HeldOutPanel:
    """The panel's shards and the newest validation's record.

    Args:
        env_name: the env whose ``test`` split holds the panel.
        num_test_tasks: that split's size (the panel must fit in it).
        val_tasks: tasks in the panel (>= 0; more than the split has: the whole split).
        val_offset: the panel's first task (>= 0).
        val_batch_size: held-out episodes run together (a chunk).
    """

    def __init__(self, env_name: str, num_test_tasks: int, val_tasks: int, val_offset: int, val_batch_size: int):
        if val_tasks < 0:
            raise ValueError(f"data.val_tasks must be >= 0, got {val_tasks}")
        if val_offset < 0:
            raise ValueError(f"data.val_offset must be >= 0, got {val_offset}")
        if val_offset and val_offset + val_tasks > num_test_tasks:
            raise ValueError(f"data.val_offset + data.val_tasks = {val_offset + val_tasks} exceeds the "
                             f"{num_test_tasks} test tasks of env {env_name!r}")
        self.env_name, self.num_test_tasks = env_name, num_test_tasks
        self.val_tasks, self.val_offset, self.val_batch_size = val_tasks, val_offset, val_batch_size
        self.record: ValidationRecord | None = None  # the newest validation's held-out episodes

    def chunks(self, rank: int, world: int) -> list[list[int]]:
        """This rank's shard of the panel (every ``world``-th task), as chunks of test-task indices."""
        n = min(self.val_tasks, self.num_test_tasks)
        mine = list(range(self.val_offset, self.val_offset + n))[rank::world]
        return [mine[s: s + self.val_batch_size] for s in range(0, len(mine), self.val_batch_size)]

    def evaluate(self, indices: list[int], epoch: int, first: bool,
                 rollout: Callable[[list[Task], list[int]], tuple[list[Episode], object]]) -> tuple[list[Episode], dict[str, float]]:
        """Episodes of held-out tasks ``indices`` from ``rollout(tasks, groups)`` (greedy, one group per task) with
        their ``val/*`` metrics; adds them to ``record`` (a new one when ``first``: a validation run's first chunk)."""
        tasks = [Task(self.env_name, "test", i) for i in indices]
        eps, _ = rollout(tasks, list(range(len(tasks))))
        metrics = episode_metrics(eps, prefix="val")
        if first or self.record is None:
            self.record = ValidationRecord(epoch=epoch)
        self.record.episodes.extend(eps)
        self.record.metrics = episode_metrics(self.record.episodes, prefix="val")
        return eps, metrics
