"""Export of the trained LoRA adapter in plain peft format, next to the run's logs.

At ``on_fit_end`` (and, when ``every_n_epochs > 0``, after every n-th training epoch) the policy's
peft model and tokenizer are written with ``save_pretrained`` to ``<log_dir>/<dirname>`` (epochs:
``<log_dir>/<dirname>/epoch_<k>``, k the 0-based epoch). The result loads without this package:

    base = AutoModelForCausalLM.from_pretrained(source)
    model = PeftModel.from_pretrained(base, "<log_dir>/adapter")

A ``cope_export.json`` beside the adapter names the base model (``Policy.source``) and holds the
experience counters at export time. Only global rank zero writes; with DDP every rank holds the full
adapter, so nothing has to be gathered (sharded strategies such as FSDP would need a gather first).
"""
from __future__ import annotations

import json
from pathlib import Path

from lightning.pytorch import Callback

from cope import records

EXPORT_FILE = "cope_export.json"


def _run_dir(trainer) -> Path:
    """``trainer.log_dir`` (a collective under DDP: call it on every rank), else ``default_root_dir``."""
    return Path(getattr(trainer, "log_dir", None) or trainer.default_root_dir)


def export_adapter(policy, path: Path, info: dict | None = None) -> Path:
    """Writes ``policy.model`` (peft) and ``policy.tokenizer`` to ``path`` plus ``cope_export.json``.

    Args:
        policy: a :class:`cope.models.policy.Policy` (``model`` a ``PeftModel``, ``tokenizer``, ``source``).
        path: target folder (created).
        info: extra JSON-serializable fields for ``cope_export.json``.

    Returns:
        ``path``.
    """
    path = Path(path)
    meta = {"base_model": str(policy.source), "format": "peft", **(info or {})}
    try:
        path.mkdir(parents=True, exist_ok=True)
        policy.model.save_pretrained(str(path))
        policy.tokenizer.save_pretrained(str(path))
        (path / EXPORT_FILE).write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")
    except OSError as e:  # a full disk, a read-only folder: say where (save_pretrained's own message often does not)
        raise OSError(e.errno, f"adapter export to {path} failed: {e.strerror or e}") from e
    return path


class AdapterExport(Callback):
    """Saves the LoRA adapter and tokenizer at the end of fit (and every n epochs when asked).

    Args:
        dirname: folder inside the run folder (relative, non-empty).
        every_n_epochs: also export after epochs ``n-1, 2n-1, ...`` into ``<dirname>/epoch_<k>``;
            0 disables the periodic export; >= 0.
    """

    def __init__(self, dirname: str = "adapter", every_n_epochs: int = 0):
        if not isinstance(dirname, str) or not dirname.strip() or Path(dirname).is_absolute() or ".." in Path(dirname).parts:
            raise ValueError(f"AdapterExport.dirname must be a non-empty relative folder name, got {dirname!r}")
        if not isinstance(every_n_epochs, int) or isinstance(every_n_epochs, bool) or every_n_epochs < 0:
            raise ValueError(f"AdapterExport.every_n_epochs must be an int >= 0, got {every_n_epochs!r}")
        self.dirname, self.every_n_epochs = dirname, every_n_epochs
        self.last_path: Path | None = None  # where the latest export went (rank zero)

    def _export(self, trainer, pl_module, sub: str | None) -> None:
        path = _run_dir(trainer) / self.dirname  # on every rank: log_dir is a collective
        if sub:
            path = path / sub
        if not trainer.is_global_zero:
            return
        counters = records.counters(trainer)
        info = {
            "counters": {k: int(v) for k, v in counters.items()},
            "epoch": int(trainer.current_epoch),
            "global_step": int(trainer.global_step),
        }
        self.last_path = export_adapter(pl_module.policy, path, info)

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        if self.every_n_epochs and (trainer.current_epoch + 1) % self.every_n_epochs == 0:
            self._export(trainer, pl_module, f"epoch_{trainer.current_epoch}")

    def on_fit_end(self, trainer, pl_module) -> None:
        self._export(trainer, pl_module, None)
