"""Random streams re-derived from (seed, stream, rank, epoch) instead of carried from epoch to epoch.

Every rank of a DDP run must draw its own tasks, sampling seeds, anchors and dropout masks, and a run resumed
from a checkpoint must draw what the uninterrupted run drew. Checkpoints are written by rank 0 alone, so any
RNG *state* they carry is rank 0's: restored on every rank, it made all ranks collect the same experience after
the first resume. Deriving each epoch's streams from the run seed, the rank and the epoch needs no state at all:
the same on resume, distinct per rank, and independent of how many validations ran in between (the old single
stream was also advanced by validation calls). Checkpoints are taken at epoch ends and a resume reruns an
interrupted epoch from its start, so one stream per epoch is the finest grain needed. The epoch is the one being
started (Lightning's ``fit_loop.epoch_progress.current.processed``, :meth:`RolloutDataModule.epoch
<cope.train.datamodule.RolloutDataModule>`): when a fit restarts from a checkpoint, Lightning asks for the epoch's
data while ``trainer.current_epoch`` still names the saved epoch.
"""
from __future__ import annotations

import hashlib
import random

import torch


def derive_seed(seed: int, stream: str, rank: int, epoch: int) -> int:
    """A 63-bit seed of ``stream`` (e.g. ``"tasks"``) for ``rank`` in ``epoch``; stable across processes and Python
    versions (a hash of the text, not Python's salted ``hash``)."""
    digest = hashlib.blake2b(f"{int(seed)}/{stream}/{int(rank)}/{int(epoch)}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") >> 1


def stream(seed: int, name: str, rank: int, epoch: int) -> random.Random:
    """A fresh ``random.Random`` for one stream of one rank in one epoch."""
    return random.Random(derive_seed(seed, name, rank, epoch))


def seed_globals(seed: int, rank: int, epoch: int) -> None:
    """Seeds the process-global generators (torch, Python's ``random``, numpy when present) for ``rank`` in
    ``epoch``: what dropout and any library code without its own generator draw from."""
    s = derive_seed(seed, "globals", rank, epoch)
    torch.manual_seed(s)
    random.seed(s)
    try:
        import numpy as np
    except ImportError:  # numpy is optional here
        return
    np.random.seed(s % 2**32)
