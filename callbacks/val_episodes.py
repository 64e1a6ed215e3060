"""Per-task held-out outcomes: one CSV per validation run, one row per greedy held-out episode.

``val/success`` is the panel's mean; analyses that need the tasks themselves (paired per-task
comparisons between runs, success broken down by a task property such as the maze size, which
tasks a method solves that another does not) read these files instead. After every validation run
(not the sanity check) the callback writes ``<dirname>/episodes<N>.csv`` in the run folder, where N
is the training episodes spent before that validation (the x of the learning curve: ``episodes0.csv``
is the starting policy). A validation run again after a resume rewrites its own file (same N), so the
files need no callback state. Under DDP each rank holds only its own share of the panel and writes
``episodes<N>_rank<r>.csv``.

Columns: ``split``, ``index`` (the task), ``success``, ``score``, ``reward``, ``steps``, ``invalid``
(actions the env rejected), ``end_reason`` (``cope.episode.EndReason``).
"""
from __future__ import annotations

import csv
import io
from pathlib import Path

from lightning.pytorch import Callback

from cope import records
from cope.episode import Episode
from cope.run.checkpoint_io import atomic_write_bytes

COLUMNS = ["split", "index", "success", "score", "reward", "steps", "invalid", "end_reason"]


def episode_row(e: Episode) -> dict:
    return {"split": e.task.split, "index": e.task.index, "success": int(bool(e.success)), "score": float(e.score),
            "reward": float(e.reward), "steps": e.num_steps, "invalid": sum(not s.valid for s in e.steps),
            "end_reason": e.end_reason}


class ValidationEpisodes(Callback):
    """Writes each validation run's held-out episodes, one row per task.

    Args:
        dirname: folder inside the run folder (a plain name, no path separators).
    """

    def __init__(self, dirname: str = "val_episodes"):
        if not dirname or not isinstance(dirname, str) or "/" in dirname or "\\" in dirname:
            raise ValueError(f"ValidationEpisodes.dirname must be a plain folder name, got {dirname!r}")
        self.dirname = dirname

    def on_validation_end(self, trainer, pl_module) -> None:
        if trainer.sanity_checking:
            return
        rec = records.val_record(trainer)
        out = Path(getattr(trainer, "log_dir", None) or trainer.default_root_dir) / self.dirname  # log_dir: a collective
        if rec is None:
            return
        n = int(records.counters(trainer).get("episodes", 0))
        suffix = f"_rank{trainer.global_rank}" if trainer.world_size > 1 else ""
        buf = io.StringIO()
        w = csv.DictWriter(buf, fieldnames=COLUMNS)
        w.writeheader()
        w.writerows(episode_row(e) for e in sorted(rec.episodes, key=lambda e: (e.task.split, e.task.index)))
        out.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(out / f"episodes{n}{suffix}.csv", buf.getvalue().encode())
