"""A test-only callback for multi-process runs of ``train.py``: each rank writes what it collected and what it
trained to ``<out>/rank<r>.jsonl``, and can kill its own process (SIGKILL, no cleanup) at the start of an epoch
(``kill_at_epoch``) or right after an epoch's checkpoint was written, before Lightning logs that epoch's metrics row
(``kill_after_checkpoint``).

Loaded into a ``train.py`` subprocess with ``PYTHONPATH=<tests>`` and ``+callbacks.trace._target_=ddp_trace.DDPTrace``.
Lines: ``{"epoch": e, "tasks": [...], "sampled": <hash of every episode's token ids>}`` at each training epoch's
start (after the epoch's rollouts), ``{"step": s, "adapter": <hash of the trainable weights>}`` after each step.
"""
from __future__ import annotations

import hashlib
import json
import os
import signal
from pathlib import Path

from lightning.pytorch import Callback

from cope.callbacks.checkpoint import EpochCheckpoint
from cope.records import train_record


def _digest(chunks) -> str:
    h = hashlib.sha256()
    for c in chunks:
        h.update(c)
    return h.hexdigest()[:16]


class DDPTrace(Callback):
    def __init__(self, out: str, kill_at_epoch: int = -1, kill_after_checkpoint: int = -1):
        self.out, self.kill_at_epoch, self.kill_after_checkpoint = Path(out), int(kill_at_epoch), int(kill_after_checkpoint)

    def setup(self, trainer, pl_module, stage: str) -> None:
        if self.kill_after_checkpoint < 0:
            return
        (ckpt,) = [c for c in trainer.checkpoint_callbacks if isinstance(c, EpochCheckpoint)]  # last.ckpt's writer
        save = ckpt.on_train_epoch_end

        def save_then_die(trainer, pl_module):  # on this instance only: the checkpoint callback runs after this one
            save(trainer, pl_module)
            if trainer.current_epoch == self.kill_after_checkpoint:
                assert ckpt.path.exists()
                self._die(trainer)

        ckpt.on_train_epoch_end = save_then_die

    @staticmethod
    def _die(trainer) -> None:
        trainer.strategy.barrier("ddp_trace_kill")  # both ranks die here, neither one inside a collective
        os.kill(os.getpid(), signal.SIGKILL)  # as a preemption without grace would: nothing runs after this

    def _write(self, trainer, row: dict) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        with open(self.out / f"rank{trainer.global_rank}.jsonl", "a") as f:
            f.write(json.dumps(row) + "\n")
            f.flush()
            os.fsync(f.fileno())

    def on_train_epoch_start(self, trainer, pl_module) -> None:
        rec = train_record(trainer)
        self._write(trainer, {"epoch": trainer.current_epoch, "tasks": [e.task.id for e in rec.episodes],
                              "sampled": _digest(bytes(str(e.tokens), "ascii") for e in rec.episodes)})
        if trainer.current_epoch == self.kill_at_epoch:
            self._die(trainer)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        params = sorted(((n, p) for n, p in pl_module.named_parameters() if p.requires_grad), key=lambda x: x[0])
        whole = [(n, p.full_tensor() if hasattr(p, "full_tensor") else p) for n, p in params]  # FSDP: every rank gathers
        self._write(trainer, {"step": trainer.global_step,
                              "adapter": _digest(n.encode() + p.detach().cpu().numpy().tobytes() for n, p in whole)})
