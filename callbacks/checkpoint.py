"""The run's checkpoint: ``<dirpath>/last.ckpt``, rewritten after every n-th training epoch and at the end of fit.

Lightning's ``ModelCheckpoint(save_top_k=0, save_last=True)`` writes ``last.ckpt`` only when a top-k
file was saved in the same step, so with top-k 0 it is written once, when fit ends: a run killed in
its last epoch left no checkpoint at all. This subclass keeps exactly one file and writes it

* at the end of every ``every_n_epochs``-th training epoch (after that epoch's validation, so the
  file holds the state the next epoch starts from: weights, optimizer, loops, counters, RNG and
  every callback's state), and
* at the end of fit when the last epoch was not on that grid (so a finished run can be extended).

An epoch's checkpoint carries that epoch's metrics row. Lightning (2.6) logs the row (``update_train_epoch_metrics``)
after the epoch-end callbacks that write the checkpoint: a run killed between the two would resume after that epoch
and its row would be lost for good. The row Lightning is about to log is read when the checkpoint is written
(:func:`epoch_row`), and a resumed run logs it at ``on_train_start`` unless ``metrics.csv`` already has it.

The write itself is atomic (the trainer's ``plugins`` carry :class:`cope.run.checkpoint_io.AtomicCheckpointIO`):
a kill during a write leaves the previous file intact. Resume with ``ckpt_path=last`` (the file must
exist) or ``ckpt_path=auto`` (resume if it exists, else start fresh).
"""
from __future__ import annotations

from pathlib import Path

from lightning.fabric.utilities.apply_func import convert_tensors_to_scalars
from lightning.pytorch.callbacks import ModelCheckpoint

from cope.run.checkpoint_io import LAST


def epoch_row(trainer) -> dict:
    """The epoch-level metrics row Lightning logs after ``on_train_epoch_end``: ``{"step", "epoch", "metrics"}``
    (plain numbers, so the checkpoint still loads with ``weights_only=True``). Read through the trainer's logger
    connector and epoch loop, which Lightning keeps private; tests/test_resume.py fails if either changes. Every rank
    calls it: the values of ``sync_dist`` metrics are reduced here (Lightning reuses them when it logs the row)."""
    metrics = convert_tensors_to_scalars(dict(trainer._logger_connector.metrics["log"]))
    step = trainer.fit_loop.epoch_loop._batches_that_stepped - 1  # Lightning logs the row at the epoch's last step
    return {"step": int(step), "epoch": int(trainer.current_epoch), "metrics": {k: float(v) for k, v in metrics.items()}}


class EpochCheckpoint(ModelCheckpoint):
    """Args:
        dirpath: folder of ``last.ckpt``.
        every_n_epochs: write after epochs ``n-1, 2n-1, ...`` (0-based); >= 1.
    """

    def __init__(self, dirpath: str, every_n_epochs: int = 1):
        if not isinstance(every_n_epochs, int) or isinstance(every_n_epochs, bool) or every_n_epochs < 1:
            raise ValueError(f"callbacks.checkpoint.every_n_epochs must be an int >= 1, got {every_n_epochs!r}")
        super().__init__(dirpath=dirpath, filename=Path(LAST).stem, save_top_k=1, save_last=False,
                         every_n_epochs=every_n_epochs, save_on_train_epoch_end=True, enable_version_counter=False)
        self._saved_step: int | None = None
        self._row: dict | None = None  # the epoch row being saved with the checkpoint (on_train_epoch_end only)
        self._restored_row: dict | None = None  # the row of the checkpoint a resumed run starts from

    @property
    def path(self) -> Path:
        return Path(self.dirpath) / LAST

    def on_save_checkpoint(self, trainer, pl_module, checkpoint: dict) -> None:
        self._saved_step = trainer.global_step

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        self._row = epoch_row(trainer)
        try:
            super().on_train_epoch_end(trainer, pl_module)
        finally:
            self._row = None

    def state_dict(self) -> dict:
        return {**super().state_dict(), "epoch_row": self._row}

    def load_state_dict(self, state_dict: dict) -> None:
        super().load_state_dict(state_dict)
        self._restored_row = state_dict.get("epoch_row")

    def on_train_start(self, trainer, pl_module) -> None:
        """A resumed run logs its checkpoint's epoch row where the killed run did not get to (a logger with
        ``contains``, the run's metrics.csv, says whether it did; without one the row is logged again, a repeated
        point at the same step at worst)."""
        row, self._restored_row = self._restored_row, None
        if not row or not row["metrics"] or trainer.global_rank != 0:
            return
        if any(getattr(lg, "contains", lambda *_: False)(row["metrics"], row["step"]) for lg in trainer.loggers):
            return
        for lg in trainer.loggers:
            lg.log_metrics({**row["metrics"], "epoch": row["epoch"]}, step=row["step"])
            lg.save()

    def on_train_end(self, trainer, pl_module) -> None:
        if self._saved_step != trainer.global_step and trainer.global_step > 0:
            trainer.save_checkpoint(str(self.path))
