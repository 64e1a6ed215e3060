"""The closed sets of model settings, as ``Literal`` types (torch-free).

The model builders annotate their arguments with these (:func:`cope.models.policy.load_pretrained`,
:func:`cope.models.tiny.tiny_policy`, :func:`cope.models.gguf.gguf_policy`), so the typed config check
(:mod:`cope.run.config_check`, which reads signatures) refuses a value outside the set before any model is built,
cached or warm-started; the builders' own checks read the same sets (``typing.get_args``). One source of truth.
"""
from __future__ import annotations

from typing import Literal

Dtype = Literal["fp32", "bf16", "fp16"]  # model.dtype: the base weights (and 4-bit compute)
Quantization = Literal["4bit", "8bit"]  # model.quantization (or null): bitsandbytes, the `quant` extra
Finetune = Literal["lora", "full"]  # model.finetune: an adapter, or every parameter
WarmStartPolicy = Literal["random", "expert"]  # model.warm_start_policy of the tiny model
