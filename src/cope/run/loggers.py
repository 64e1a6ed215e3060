"""A CSV logger whose ``metrics.csv`` matches the checkpoint a run resumes from.

Lightning's ``CSVLogger`` deletes an existing ``metrics.csv`` when its folder is not empty, so a run
resumed into the same folder would lose its whole history; and it rewrites the file in place when a
new column appears, so a kill during that rewrite loses it too. :class:`ResumableCSVLogger`:

* appends to an existing file under its header, and rewrites it (new columns) atomically;
* :meth:`ResumableCSVLogger.rewind` (called once when fitting starts, with the epoch the fit starts
  at) drops the rows that an earlier process logged for that epoch or later: rows of an epoch that
  was cut short by a crash and is now run again, or, for a fresh start (epoch 0) in a used folder,
  everything the earlier run left. Rows this process logged itself (a validation before fit) stay.

Lightning's logger connector saves after every ``log_metrics`` call, and so does :func:`cope.train.dist.log_now` (the
rows the trainer logs itself: its optimizer steps, the gradient statistics), so the file on disk is at most the row
being written behind the run.
"""
from __future__ import annotations

import csv
import io
import logging
import os

from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.loggers.csv_logs import ExperimentWriter
from lightning.pytorch.utilities import rank_zero_only

from cope.run.checkpoint_io import atomic_write_bytes

log = logging.getLogger(__name__)


def _epoch_of(row: dict) -> float | None:
    try:
        return float(row.get("epoch") or "")
    except ValueError:
        return None


class _AppendingWriter(ExperimentWriter):
    def _check_log_dir_exists(self) -> None:
        self.inherited_rows: list[dict] = []  # rows an earlier process wrote
        if self._fs.isfile(self.metrics_file_path):
            with self._fs.open(self.metrics_file_path, "r", newline="") as f:
                reader = csv.DictReader(f)
                self.metrics_keys = list(reader.fieldnames or [])
                self.inherited_rows = list(reader)

    def _write_all(self, rows: list[dict]) -> None:
        buf = io.StringIO(newline="")
        w = csv.DictWriter(buf, fieldnames=self.metrics_keys)
        w.writeheader()
        w.writerows(rows)
        atomic_write_bytes(self.metrics_file_path, buf.getvalue().encode())

    def _read_rows(self) -> list[dict]:
        if not self._fs.isfile(self.metrics_file_path):
            return []
        with self._fs.open(self.metrics_file_path, "r", newline="") as f:
            return list(csv.DictReader(f))

    def save(self) -> None:
        if not self.metrics:
            return
        new_keys = self._record_new_keys()
        if new_keys or not self._fs.isfile(self.metrics_file_path):
            self._write_all(self._read_rows() + self.metrics)  # header changes: one atomic rewrite
        else:
            with open(self.metrics_file_path, "a", newline="") as f:
                csv.DictWriter(f, fieldnames=self.metrics_keys).writerows(self.metrics)
                f.flush()
                os.fsync(f.fileno())
        self.metrics = []

    def contains(self, metrics: dict, step: int) -> bool:
        """Whether an earlier process logged a row at ``step`` with every key of ``metrics``."""
        for r in self.inherited_rows:
            if r.get("step") not in (None, "") and int(float(r["step"])) == step and \
                    all(r.get(k) not in (None, "") for k in metrics):
                return True
        return False

    def rewind(self, epoch: int) -> int:
        """Drops inherited rows of ``epoch`` and later; returns how many were dropped."""
        self.save()
        if not self.inherited_rows:
            return 0
        rows = self._read_rows()
        n_old = len(self.inherited_rows)
        old, mine = rows[:n_old], rows[n_old:]
        kept = [r for r in old if (_epoch_of(r) is None or _epoch_of(r) < epoch)]
        dropped = len(old) - len(kept)
        if dropped:
            self._write_all(kept + mine)
        self.inherited_rows = []
        return dropped


class ResumableCSVLogger(CSVLogger):
    """``lightning.pytorch.loggers.CSVLogger`` (same arguments) that appends to an existing metrics.csv
    and can :meth:`rewind` it to the epoch a resumed fit starts at."""

    @property
    def experiment(self) -> ExperimentWriter:
        if self._experiment is None:
            self._fs.makedirs(self.root_dir, exist_ok=True)
            self._experiment = _AppendingWriter(log_dir=self.log_dir)
        return self._experiment

    def contains(self, metrics: dict, step: int) -> bool:
        """Whether the metrics.csv this run resumed into has a row at ``step`` with every key of ``metrics``."""
        return self.experiment.contains(metrics, step)

    @rank_zero_only
    def rewind(self, epoch: int) -> None:
        dropped = self.experiment.rewind(epoch)
        if dropped:
            log.info("metrics.csv: dropped %d rows an earlier run logged for epoch %d or later", dropped, epoch)
