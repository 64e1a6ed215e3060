"""The run's checkpoint: ``<dirpath>/last.ckpt``, rewritten after every n-th training epoch and at the end of fit.

Lightning's ``ModelCheckpoint(save_top_k=0, save_last=True)`` writes ``last.ckpt`` only when a top-k
file was saved in the same step, so with top-k 0 it is written once, when fit ends: a run killed in
its last epoch left no checkpoint at all. This subclass keeps exactly one file and writes it

* at the end of every ``every_n_epochs``-th training epoch (after that epoch's validation, so the
  file holds the state the next epoch starts from: weights, optimizer, loops, counters, RNG and
  every callback's state), and
* at the end of fit when the last epoch was not on that grid (so a finished run can be extended).

The write itself is atomic (the trainer's ``plugins`` carry :class:`cope.run.checkpoint_io.AtomicCheckpointIO`):
a kill during a write leaves the previous file intact. Resume with ``ckpt_path=last`` (the file must
exist) or ``ckpt_path=auto`` (resume if it exists, else start fresh).
"""
from __future__ import annotations

from pathlib import Path

from lightning.pytorch.callbacks import ModelCheckpoint

from cope.run.checkpoint_io import LAST


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

    @property
    def path(self) -> Path:
        return Path(self.dirpath) / LAST

    def on_save_checkpoint(self, trainer, pl_module, checkpoint: dict) -> None:
        self._saved_step = trainer.global_step

    def on_train_end(self, trainer, pl_module) -> None:
        if self._saved_step != trainer.global_step and trainer.global_step > 0:
            trainer.save_checkpoint(str(self.path))
