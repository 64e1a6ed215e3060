"""Checkpoint files that survive a kill, a full disk and a damaged file (a Lightning ``CheckpointIO``).

Lightning's own ``TorchCheckpointIO`` writes through an fsspec transaction whose temporary file lies
in the system temp folder; committing it is a copy across file systems when that folder is on
another one, with no fsync, so a kill or power loss during the write can leave a torn file under
the checkpoint's name. :class:`AtomicCheckpointIO` serializes the checkpoint first, writes it to a
temporary file *in the target folder*, fsyncs it, renames it over the target (``os.replace`` is
atomic within one file system) and fsyncs the folder: a reader sees the previous checkpoint or the
new one, never a mix. A leftover temporary file from a killed write is removed by the next save.

Errors name the file: a write that fails (a full disk: ``OSError`` ENOSPC) raises
:class:`CheckpointWriteError` with the path and the size that was being written, and the previous
checkpoint stays in place; a file that cannot be read (empty, truncated, not a checkpoint) raises
:class:`CheckpointReadError` with the path, its size and what to do, never torch's advice to retry
with ``weights_only=False`` (which would execute code from an untrusted file). Checkpoints are
loaded with ``weights_only=True``: they hold tensors and plain containers only. A resume into another base
model or LoRA rank than the checkpoint's is :class:`CheckpointMismatchError`, before the model is built
(:func:`check_resume_matches`).
"""
from __future__ import annotations

import io
import logging
import os
import shutil
import zipfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO

if TYPE_CHECKING:
    from cope.models.source import BaseModel

log = logging.getLogger(__name__)
TMP_MARK = ".tmp-"
LAST = "last.ckpt"  # the file the run's checkpoint callback keeps current (conf/config.yaml)


class CheckpointWriteError(OSError):
    """A checkpoint could not be written; the message names the file."""


class CheckpointReadError(RuntimeError):
    """A checkpoint file exists but cannot be read; the message names the file."""


class CheckpointMismatchError(ValueError):
    """A checkpoint was trained on another base model or LoRA shape than the run's config builds."""


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    """Writes ``data`` to ``path`` atomically (temp file in the same folder, fsync, rename, fsync folder)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    for stale in path.parent.glob(f"{path.name}{TMP_MARK}*"):  # left by a write that was killed
        stale.unlink(missing_ok=True)
    tmp = path.with_name(f"{path.name}{TMP_MARK}{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise CheckpointWriteError(e.errno, f"could not write {path} ({len(data) / 2**20:.1f} MiB): {e.strerror or e}; "
                                            "the previous file at that path, if any, is unchanged") from e
    try:
        fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError:  # some file systems cannot fsync a folder; the rename itself is done
        pass


def read_checkpoint(path: str | os.PathLike, map_location: Any = "cpu", mmap: bool = False) -> dict[str, Any]:
    """Loads a checkpoint file (``weights_only=True``); any damage becomes one :class:`CheckpointReadError`.
    ``mmap``: tensors stay in the file until read (a look at keys and shapes costs no tensor data). A sharded
    checkpoint folder gives its metadata and the trained tensors' shapes only (:func:`cope.train.fsdp.checkpoint.
    read_meta`)."""
    from cope.train.fsdp import checkpoint as sharded_checkpoint

    path = sharded_checkpoint.complete_path(path)
    if path.is_dir():  # a sharded checkpoint: its metadata and the trained tensors' shapes, no tensor data
        check_checkpoint_file(path)
        return sharded_checkpoint.read_meta(path)
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint not found: {path}")
    check_checkpoint_file(path)
    size = path.stat().st_size
    hint = "the file is damaged or incomplete; resume from an earlier checkpoint or start a new run"
    try:
        ckpt = torch.load(path, map_location=map_location, weights_only=True, mmap=mmap)
    except Exception as e:  # noqa: BLE001 - torch raises many types here (EOFError, UnpicklingError, RuntimeError, ...)
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        if "weights_only" in first or "Weights only load failed" in first:
            first = "it holds objects other than tensors and plain containers"
        raise CheckpointReadError(f"checkpoint {path} ({size} bytes) cannot be read ({type(e).__name__}: {first}): {hint}") from None
    if not isinstance(ckpt, dict):
        raise CheckpointReadError(f"checkpoint {path} holds a {type(ckpt).__name__}, not a checkpoint dict: {hint}")
    return ckpt


def check_checkpoint_file(path: str | os.PathLike) -> None:
    """A cheap look at a checkpoint before any model is built: present, non-empty, a torch zip archive.

    A full read happens when the fit restores it (:func:`read_checkpoint`, same error type)."""
    from cope.train.fsdp.checkpoint import META, is_sharded_checkpoint

    path = Path(path)
    hint = "the file is damaged or incomplete; resume from an earlier checkpoint or start a new run"
    if path.is_dir():
        if not is_sharded_checkpoint(path):
            raise CheckpointReadError(f"checkpoint {path} is a folder without .metadata or {META}: not a complete sharded "
                                      f"checkpoint (a save was cut short?): {hint}")
        return
    size = path.stat().st_size
    if size == 0:
        raise CheckpointReadError(f"checkpoint {path} is empty (0 bytes): {hint}")
    if not zipfile.is_zipfile(path):
        raise CheckpointReadError(f"checkpoint {path} ({size} bytes) is not a torch checkpoint archive: {hint}")


def lora_ranks(state_dict: dict[str, Any]) -> set[int]:
    """The LoRA ranks of a checkpoint's adapter: rows of each ``lora_A`` weight, (r, in_features)."""
    return {int(v.shape[0]) for k, v in state_dict.items() if ".lora_A." in k and k.endswith(".weight") and v.dim() == 2}


def check_resume_matches(path: str | os.PathLike, base: BaseModel | None, lora_r: int | None,
                         sharded: bool | None = None, finetune: str | None = None) -> None:
    """Refuses to resume from ``path`` into another base model, another LoRA rank or another strategy's layout than the
    checkpoint's, in one :class:`CheckpointMismatchError` naming both sides, before any model is built (it would
    otherwise fail after the model load with a bare shape error, or, on another base with the same shapes, resume
    silently).

    Args:
        base: what this run's config builds (:func:`cope.models.source.base_model_of`; None: not known, no check).
        lora_r: ``model.lora.r`` (None: no check). Checkpoints without a ``base_model`` record pass that check.
        sharded: this run is ``trainer=fsdp`` (its optimizer state is keyed by parameter name; any other strategy's by
            index, Lightning's default); None: no check.
        finetune: ``model.finetune`` (``lora`` | ``full``); None: no check. Checkpoints without a ``finetune`` record
            were written under LoRA.
    """
    from cope.train.fsdp.checkpoint import optimizer_keying

    ckpt = read_checkpoint(path, mmap=True)
    problems = []
    recorded = ckpt.get("base_model")
    if base is not None and isinstance(recorded, str) and not base.matches(recorded):
        problems.append(f"base model: the checkpoint was trained on {recorded!r}, this config builds {base.source!r} "
                        f"(from {base.named_by})")
    written = ckpt.get("finetune", "lora")
    if finetune is not None and written != finetune:
        problems.append(f"training mode: the checkpoint was written with model.finetune={written}, this config has "
                        f"model.finetune={finetune}")
    ranks = lora_ranks(ckpt.get("state_dict") or {})
    if lora_r is not None and ranks and ranks != {lora_r} and finetune != "full":
        problems.append(f"LoRA rank: the checkpoint's adapter has r={'/'.join(map(str, sorted(ranks)))}, this config has "
                        f"model.lora.r={lora_r}")
    keyed = optimizer_keying(ckpt)
    if sharded is not None and keyed is not None and (keyed == "parameter name") != sharded:
        was, now = ("trainer=fsdp", "another trainer") if sharded is False else ("trainer=ddp (or one process)", "trainer=fsdp")
        problems.append(f"strategy: the checkpoint was written under {was} (optimizer state keyed by {keyed}), this run "
                        f"is {now}")
    if problems:
        raise CheckpointMismatchError(f"checkpoint {path} does not fit this run: {'; '.join(problems)}. Resume "
                                      "with the model, model.lora, model.finetune and trainer it was trained with, or start a new run "
                                      "(drop ckpt_path, or use another hydra.run.dir)")


def estimate_output_bytes(trainable_params: int) -> int:
    """Disk a run's outputs need at their peak: a checkpoint (fp32 adapter + two AdamW moments) twice
    (the new one is written beside the old before the rename), the exported adapter, and 64 MiB of logs."""
    per_ckpt = trainable_params * 4 * 3
    return 2 * per_ckpt + trainable_params * 4 + 64 * 2**20


def check_free_space(output_dir: str | os.PathLike, policy: Any) -> bool:
    """Warns (and returns False) when ``output_dir``'s file system has less room than the run's outputs need."""
    need = estimate_output_bytes(sum(p.numel() for p in policy.trainable_parameters()))
    path = Path(output_dir)
    while not path.exists() and path != path.parent:
        path = path.parent
    free = shutil.disk_usage(path).free
    if free < need:
        log.warning("only %.1f MiB free under %s; this run's checkpoints, adapter export and logs need about %.1f MiB: "
                    "writes will fail (each error names its file) unless space is freed", free / 2**20, output_dir,
                    need / 2**20)
        return False
    return True


class AtomicCheckpointIO(TorchCheckpointIO):
    """``TorchCheckpointIO`` with atomic, fsynced writes and errors that name the file (see module doc)."""

    def save_checkpoint(self, checkpoint: dict[str, Any], path, storage_options: Any | None = None) -> None:
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__} takes no storage_options")
        buf = io.BytesIO()
        torch.save(checkpoint, buf)
        atomic_write_bytes(path, buf.getvalue())
        log.debug("checkpoint written: %s (%d bytes)", path, buf.tell())

    def load_checkpoint(self, path, map_location: Any = None, weights_only: bool | None = None) -> dict[str, Any]:
        return read_checkpoint(path, map_location=map_location if map_location is not None else "cpu")
