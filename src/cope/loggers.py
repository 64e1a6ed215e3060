"""A CSV logger that survives resume.

Lightning's ``CSVLogger`` deletes an existing ``metrics.csv`` when its folder is not empty, so a run
resumed into the same folder (``ckpt_path=last``) would lose its whole metrics history. This
subclass appends instead: it reads the existing header and keeps writing under it (new columns
rewrite the header, as upstream does). Rows logged after the checkpoint by an interrupted run stay
in the file; their ``step`` column tells them apart.
"""
from __future__ import annotations

import csv

from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.loggers.csv_logs import ExperimentWriter


class _AppendingWriter(ExperimentWriter):
    def _check_log_dir_exists(self) -> None:
        if self._fs.isfile(self.metrics_file_path):
            with self._fs.open(self.metrics_file_path, "r", newline="") as f:
                self.metrics_keys = list(csv.DictReader(f).fieldnames or [])


class ResumableCSVLogger(CSVLogger):
    """``lightning.pytorch.loggers.CSVLogger`` (same arguments) that appends to an existing metrics.csv."""

    @property
    def experiment(self) -> ExperimentWriter:
        if self._experiment is None:
            self._fs.makedirs(self.root_dir, exist_ok=True)
            self._experiment = _AppendingWriter(log_dir=self.log_dir)
        return self._experiment
