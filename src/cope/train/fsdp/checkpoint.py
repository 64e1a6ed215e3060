"""Sharded checkpoints (``trainer=fsdp`` with ``trainer.strategy.distributed_checkpoint=true``): torch distributed
checkpoint (DCP), each rank writing its own shards, nothing gathered.

The checkpoint keeps the run's checkpoint path (``checkpoints/last.ckpt``), as a folder:

* the DCP files (``.metadata`` and one ``__<rank>_0.distcp`` per rank): the trained tensors under ``state_dict.*``
  (the adapter, or every weight under full fine-tuning) and each optimizer's state under ``optimizer_<i>.*``, keyed
  by parameter name, each rank's shards;
* ``meta.pt``: everything else Lightning and the module put in a checkpoint (loops, counters, schedulers, callbacks,
  the objectives' state, ``base_model``, ``finetune``, ``world_size``), written by rank zero.

**A kill never leaves a checkpoint that looks complete.** Every rank writes into ``last.ckpt.tmp-dcp/``; after a
barrier (every rank's shards are on disk) rank zero writes ``meta.pt`` there last, then swaps the folder in
(``last.ckpt`` to ``last.ckpt.old``, the new one to ``last.ckpt``, the old one removed), and a barrier ends the save.
A folder without ``meta.pt`` is not a checkpoint (:func:`is_sharded_checkpoint`); a kill between the two renames
leaves ``last.ckpt.old``, which :func:`complete_path` finds. A rank that dies mid-write leaves the previous
checkpoint in place (the others wait at the barrier until the collective timeout).

**Resume** loads each rank's shards of this run's layout from the files, whatever the world size that wrote them (DCP
reshards on load): a 2-process checkpoint resumes in one process. The load asks for every trained tensor and fails
naming the missing ones (another LoRA config or training mode). ``eval.py`` reads the trained tensors in one process
(:func:`load_trained_tensors`).

**Which strategy wrote a checkpoint** (:func:`optimizer_keying`, a file or a folder's metadata): ``trainer=fsdp`` keys
the optimizer state by parameter name, in either kind; Lightning's default (DDP, one process) by index. A resume
across the two is refused (:func:`cope.run.checkpoint_io.check_resume_matches`, and the strategy's own load).
"""
from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import torch

META = "meta.pt"
TMP = ".tmp-dcp"
OLD = ".old"


def optimizer_keying(ckpt: dict) -> str | None:
    """How a checkpoint keys its optimizer state: ``"parameter name"`` (``trainer=fsdp``), ``"index"`` (Lightning's
    default: DDP, one process), or None (no optimizer state)."""
    if ckpt.get("sharded"):  # a torch distributed checkpoint (read_meta): always by name
        return "parameter name"
    keys = {type(k) for s in ckpt.get("optimizer_states") or [] for k in (s.get("state") or {})}
    return None if not keys else "parameter name" if str in keys else "index"


def is_sharded_checkpoint(path: str | os.PathLike) -> bool:
    """A complete sharded checkpoint folder: DCP's ``.metadata`` and ``meta.pt`` (written last)."""
    path = Path(path)
    return path.is_dir() and (path / ".metadata").is_file() and (path / META).is_file()


def complete_path(path: str | os.PathLike) -> Path:
    """``path``, or the previous checkpoint ``<path>.old`` when a kill fell between the two renames of a save."""
    path = Path(path)
    old = path.with_name(path.name + OLD)
    return old if not path.exists() and is_sharded_checkpoint(old) else path


def save(strategy, checkpoint: dict[str, Any], path: str | os.PathLike) -> None:
    """Writes ``checkpoint`` (its ``state_dict`` and ``optimizer_states`` hold this rank's shards) to the folder
    ``path``, atomically as the module docstring says; a collective (every rank calls it)."""
    import torch.distributed.checkpoint as dcp

    path = Path(path)
    tmp, old = path.with_name(path.name + TMP), path.with_name(path.name + OLD)
    if strategy.is_global_zero:
        shutil.rmtree(tmp, ignore_errors=True)  # a killed save's leftovers
    strategy.barrier("sharded_checkpoint.clean")
    tensors = {"state_dict": checkpoint.pop("state_dict")}
    tensors.update({f"optimizer_{i}": s for i, s in enumerate(checkpoint.pop("optimizer_states", []))})
    dcp.save(tensors, checkpoint_id=tmp)
    strategy.barrier("sharded_checkpoint.written")
    if strategy.is_global_zero:
        torch.save(checkpoint, tmp / META)  # last: its presence marks the folder complete
        _fsync_dir(tmp)
        if path.is_file():  # a single-file checkpoint of an earlier run in the same folder
            path.unlink()
        if path.exists():
            shutil.rmtree(old, ignore_errors=True)
            os.replace(path, old)
        os.replace(tmp, path)
        _fsync_dir(path.parent)
        shutil.rmtree(old, ignore_errors=True)
    strategy.barrier("sharded_checkpoint.done")


def load(path: str | os.PathLike, module: torch.nn.Module, optimizers: list[torch.optim.Optimizer]) -> dict[str, Any]:
    """This rank's shards of ``module``'s trained tensors and each optimizer's state, read from the folder ``path`` and
    loaded in place; returns ``meta.pt`` (the rest of the checkpoint). A collective."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    path = complete_path(path)
    if not is_sharded_checkpoint(path):
        raise FileNotFoundError(f"{path} is not a complete sharded checkpoint (no {META} or .metadata): a save was cut "
                                "short; resume from an earlier checkpoint or start a new run")
    opts = StateDictOptions(ignore_frozen_params=True)
    trained = {n for n, p in module.named_parameters() if p.requires_grad}  # as the module's on_save_checkpoint keeps
    model_state = {k: v for k, v in get_model_state_dict(module, options=opts).items() if k in trained}
    state: dict[str, Any] = {"state_dict": model_state}  # (a tied head's alias of the embedding is not asked for)
    state.update({f"optimizer_{i}": get_optimizer_state_dict(module, opt) for i, opt in enumerate(optimizers)})
    try:
        dcp.load(state, checkpoint_id=path)
    except Exception as e:  # noqa: BLE001 - DCP raises a CheckpointException wrapping each rank's error
        raise ValueError(f"sharded checkpoint {path} does not hold this run's trained tensors ({str(e).splitlines()[0]}): "
                         "another LoRA config or model.finetune? Resume with the settings it was written with") from e
    set_model_state_dict(module, state["state_dict"], options=StateDictOptions(ignore_frozen_params=True, strict=False))
    for i, opt in enumerate(optimizers):
        set_optimizer_state_dict(module, opt, optim_state_dict=state[f"optimizer_{i}"])
    return torch.load(path / META, map_location="cpu", weights_only=True)


def read_meta(path: str | os.PathLike) -> dict[str, Any]:
    """What a look before the build needs (:func:`cope.run.checkpoint_io.check_resume_matches`): ``meta.pt`` plus the
    trained tensors as meta-device tensors of their shapes under ``state_dict``, and ``sharded: True``. Reads no tensor
    data."""
    from torch.distributed.checkpoint import FileSystemReader

    path = complete_path(path)
    meta = torch.load(path / META, map_location="cpu", weights_only=True)
    entries = FileSystemReader(str(path)).read_metadata().state_dict_metadata
    prefix = "state_dict."
    meta["state_dict"] = {k[len(prefix):]: torch.empty(tuple(m.size), device="meta")
                          for k, m in entries.items() if k.startswith(prefix) and hasattr(m, "size")}
    meta["sharded"] = True  # its optimizer state is keyed by parameter name (optimizer_keying)
    return meta


def load_trained_tensors(path: str | os.PathLike, names: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The trained tensors ``names`` (checkpoint key -> a tensor of its shape to fill) read in one process, without a
    process group (``eval.py``); every name must be in the checkpoint."""
    import torch.distributed.checkpoint as dcp

    state = {"state_dict": {k: torch.empty_like(v) for k, v in names.items()}}
    dcp.load(state, checkpoint_id=complete_path(path), no_dist=True)
    return state["state_dict"]


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError:  # some file systems cannot fsync a folder
        pass
