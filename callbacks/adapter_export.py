"""Export of the trained LoRA adapter in plain peft format (or, under ``model.finetune=full``, of the whole trained
model as a plain HF model folder), next to the run's logs.

At ``on_fit_end`` (and, when ``every_n_epochs > 0``, after every n-th training epoch) the policy's
peft model and tokenizer are written with ``save_pretrained`` to ``<log_dir>/<dirname>`` (epochs:
``<log_dir>/<dirname>/epoch_<k>``, k the 0-based epoch). The result loads without this package:

    base = AutoModelForCausalLM.from_pretrained(source)
    model = PeftModel.from_pretrained(base, "<log_dir>/adapter")

A ``cope_export.json`` beside the adapter names the base model (``Policy.source``) and holds the
experience counters at export time.

Full fine-tuning: the same call writes the model's weights and config (``save_pretrained`` of the causal LM, format
``hf`` in ``cope_export.json``) into ``<log_dir>/model`` (the default folder name then), which loads with plain
``AutoModelForCausalLM.from_pretrained`` and is a ``model.path`` for ``eval.py`` or a next run.

``merged=true`` also writes, at the end of fit, ``<log_dir>/<merged_dirname>``: the base model with the
adapter merged in (W + scale B A per LoRA layer, added in fp32 and cast back to the base's dtype), loadable
by plain ``AutoModelForCausalLM.from_pretrained`` (a plain model folder, the format ``vllm serve`` takes without
LoRA); no adapter file.
Computed from a state dict: the training model is not touched (a merge and unmerge would not round-trip
exactly). A quantized (4-bit or 8-bit) base is refused: merging into nf4 rounds the adapter away.

Only global rank zero writes; with DDP every rank holds the full adapter, so nothing has to be gathered; under
``trainer=fsdp`` the trained tensors are gathered whole onto rank zero's CPU first
(:func:`cope.train.fsdp.sharding.whole_trainable_state`).
"""
from __future__ import annotations

import json
from pathlib import Path

from lightning.pytorch import Callback

from cope import records
from cope.train.fsdp.sharding import whole_trainable_state

EXPORT_FILE = "cope_export.json"


def _run_dir(trainer) -> Path:
    """``trainer.log_dir`` (a collective under DDP: call it on every rank), else ``default_root_dir``."""
    return Path(getattr(trainer, "log_dir", None) or trainer.default_root_dir)


def export_adapter(policy, path: Path, info: dict | None = None, state_dict: dict | None = None) -> Path:
    """Writes ``policy.model`` (peft: the adapter; full fine-tuning: the whole model) and ``policy.tokenizer`` to
    ``path`` plus ``cope_export.json``.

    Args:
        policy: a :class:`cope.models.policy.Policy` (``model`` a ``PeftModel`` or a causal LM, ``tokenizer``, ``source``).
        path: target folder (created).
        info: extra JSON-serializable fields for ``cope_export.json``.
        state_dict: the adapter's whole tensors when the model holds shards of them (``trainer=fsdp``); None: the
            model's own.

    Returns:
        ``path``.
    """
    path = Path(path)
    meta = {"base_model": str(policy.source), "format": "hf" if policy.finetune == "full" else "peft", **(info or {})}
    try:
        path.mkdir(parents=True, exist_ok=True)
        policy.model.save_pretrained(str(path), **({} if state_dict is None else {"state_dict": state_dict}))
        policy.tokenizer.save_pretrained(str(path))
        (path / EXPORT_FILE).write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")
    except OSError as e:  # a full disk, a read-only folder: say where (save_pretrained's own message often does not)
        raise OSError(e.errno, f"adapter export to {path} failed: {e.strerror or e}") from e
    return path


def export_merged(policy, path: Path, info: dict | None = None) -> Path:
    """Writes the base model with ``policy``'s LoRA adapter merged in, and the tokenizer, to ``path`` (see the
    module docstring); raises ValueError for a quantized base."""
    from peft.tuners.lora import LoraLayer

    base = policy.model.get_base_model()
    if getattr(base, "is_loaded_in_4bit", False) or getattr(base, "is_loaded_in_8bit", False) or \
            getattr(base.config, "quantization_config", None) is not None:
        raise ValueError("callbacks.adapter_export.merged=true: the base model is quantized (model.quantization); merging "
                         "the adapter into 4-bit/8-bit weights would round it away. Export the adapter (the default) and "
                         "merge it into the full-precision base: load that base, then PeftModel.from_pretrained(...).merge_and_unload()")
    deltas = {f"{name}.weight": mod.get_delta_weight("default") for name, mod in base.named_modules()
              if isinstance(mod, LoraLayer) and "default" in mod.lora_A}
    merged = {}
    for key, value in base.state_dict().items():
        if "lora_" in key:
            continue
        key = key.replace(".base_layer.", ".")
        merged[key] = (value.float() + deltas[key].float()).to(value.dtype) if key in deltas else value
    missing = set(deltas) - set(merged)
    if missing:
        raise RuntimeError(f"adapter merge: no base weight for {sorted(missing)[:3]}")
    path = Path(path)
    meta = {"base_model": str(policy.source), "format": "merged", "dtype": str(next(iter(merged.values())).dtype)}
    try:
        path.mkdir(parents=True, exist_ok=True)
        base.save_pretrained(str(path), state_dict=merged)  # (transformers empties the dict it is given)
        policy.tokenizer.save_pretrained(str(path))
        (path / EXPORT_FILE).write_text(json.dumps({**meta, **(info or {})}, indent=2, sort_keys=True) + "\n")
    except OSError as e:
        raise OSError(e.errno, f"merged export to {path} failed: {e.strerror or e}") from e
    return path


class AdapterExport(Callback):
    """Saves the LoRA adapter and tokenizer at the end of fit (and every n epochs when asked).

    Args:
        dirname: folder inside the run folder (relative, non-empty); None: ``adapter``, or ``model`` under
            ``model.finetune=full``.
        every_n_epochs: also export after epochs ``n-1, 2n-1, ...`` into ``<dirname>/epoch_<k>``;
            0 disables the periodic export; >= 0.
        merged: also write the base with the adapter merged in, at the end of fit, into ``merged_dirname``.
        merged_dirname: that folder inside the run folder.
    """

    def __init__(self, dirname: str | None = None, every_n_epochs: int = 0, merged: bool = False,
                 merged_dirname: str = "merged"):
        if dirname is not None and (not isinstance(dirname, str) or not dirname.strip() or Path(dirname).is_absolute()
                                    or ".." in Path(dirname).parts):
            raise ValueError(f"AdapterExport.dirname must be a non-empty relative folder name, got {dirname!r}")
        if not isinstance(every_n_epochs, int) or isinstance(every_n_epochs, bool) or every_n_epochs < 0:
            raise ValueError(f"AdapterExport.every_n_epochs must be an int >= 0, got {every_n_epochs!r}")
        if merged and (not merged_dirname.strip() or Path(merged_dirname).is_absolute() or merged_dirname == dirname):
            raise ValueError(f"AdapterExport.merged_dirname must be a relative folder other than dirname, got {merged_dirname!r}")
        self.dirname, self.every_n_epochs, self.merged, self.merged_dirname = dirname, every_n_epochs, merged, merged_dirname
        self.last_path: Path | None = None  # where the latest export went (rank zero)

    def _export(self, trainer, pl_module, sub: str | None) -> None:
        name = self.dirname or ("model" if pl_module.policy.finetune == "full" else "adapter")
        path = _run_dir(trainer) / name  # on every rank: log_dir is a collective
        if sub:
            path = path / sub
        state = whole_trainable_state(pl_module.policy)  # trainer=fsdp: gathered on every rank (a collective); else None
        if not trainer.is_global_zero:
            return
        counters = records.counters(trainer)
        info = {
            "counters": {k: int(v) for k, v in counters.items()},
            "epoch": int(trainer.current_epoch),
            "global_step": int(trainer.global_step),
        }
        self.last_path = export_adapter(pl_module.policy, path, info, state)

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        if self.every_n_epochs and (trainer.current_epoch + 1) % self.every_n_epochs == 0:
            self._export(trainer, pl_module, f"epoch_{trainer.current_epoch}")

    def on_fit_end(self, trainer, pl_module) -> None:
        self._export(trainer, pl_module, None)
        if self.merged:
            path = _run_dir(trainer) / self.merged_dirname  # on every rank: log_dir is a collective
            if trainer.is_global_zero:
                export_merged(pl_module.policy, path, {"global_step": int(trainer.global_step)})
