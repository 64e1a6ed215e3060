"""Training throughput: wall time of each epoch's optimizer part and non-pad tokens per second.

The clock starts at the epoch's first ``on_train_batch_start`` (so a rollout collected while the
train dataloader is built or first iterated is not counted) and stops at ``on_train_epoch_end``;
validation runs inside the epoch are subtracted. Tokens are the non-padding positions of every
training batch seen by this rank:

* 2D ``attention_mask`` (collate's layout): its sum;
* 4D additive mask ``(N, 1, T, T)`` (packed forecast segments): padding attends only to itself,
  every real position past column 0 attends to at least one more key, and column 0 is always real.
  (``position_ids >= 0`` cannot tell: padding carries non-negative position ids too.)

Logged per epoch: ``perf/epoch_seconds`` (max over ranks) and ``perf/train_tokens_per_s`` (summed
over ranks: the job's throughput). Counts stay on the device until the epoch ends (no per-batch sync).
"""
from __future__ import annotations

import time
from collections.abc import Mapping

import torch
from lightning.pytorch import Callback


def count_tokens(batch) -> torch.Tensor | None:
    """Number of non-padding positions in a training batch (0-d tensor), or None if unknown."""
    if not isinstance(batch, Mapping) or not torch.is_tensor(batch.get("attention_mask")):
        return None
    mask = batch["attention_mask"]
    if mask.dim() == 2:  # (N, T), 1 on real tokens
        return mask.detach().sum()
    if mask.dim() == 4:  # (N, 1, T, T), 0 where a query may attend a key
        keys = (mask[:, 0].detach() == 0).sum(-1)  # (N, T) keys each query attends
        real = keys > 1  # (N, T)
        real[:, 0] = True
        return real.sum()
    return None


class Throughput(Callback):
    """Logs ``perf/epoch_seconds`` and ``perf/train_tokens_per_s`` after every training epoch."""

    def __init__(self):
        self._start: float | None = None
        self._paused = 0.0  # seconds spent in validation inside the current epoch
        self._val_start: float | None = None
        self._tokens: torch.Tensor | int = 0

    def on_train_epoch_start(self, trainer, pl_module) -> None:
        self._start, self._paused, self._val_start, self._tokens = None, 0.0, None, 0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if self._start is None:
            self._start = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        n = count_tokens(batch)
        if n is not None:
            self._tokens = self._tokens + n

    def on_validation_start(self, trainer, pl_module) -> None:
        if self._start is not None and not trainer.sanity_checking:
            self._val_start = time.perf_counter()

    def on_validation_end(self, trainer, pl_module) -> None:
        if self._val_start is not None:
            self._paused += time.perf_counter() - self._val_start
            self._val_start = None

    def epoch_metrics(self) -> dict[str, float]:
        """The current epoch's numbers so far (zeros before the first batch)."""
        if self._start is None:
            return {"perf/epoch_seconds": 0.0, "perf/train_tokens_per_s": 0.0}
        seconds = max(time.perf_counter() - self._start - self._paused, 1e-9)
        return {"perf/epoch_seconds": seconds, "perf/train_tokens_per_s": float(self._tokens) / seconds}

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        metrics = self.epoch_metrics()  # logged on every rank even without batches: sync_dist is a collective
        pl_module.log("perf/epoch_seconds", metrics["perf/epoch_seconds"], on_step=False, on_epoch=True,
                      sync_dist=True, reduce_fx="max", batch_size=1)
        pl_module.log("perf/train_tokens_per_s", metrics["perf/train_tokens_per_s"], on_step=False, on_epoch=True,
                      sync_dist=True, reduce_fx="sum", batch_size=1)
        self._start = None
