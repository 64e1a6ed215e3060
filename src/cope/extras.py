"""Availability of optional dependencies, in one place. Heavy extras are imported lazily by the
code that needs them; a missing one fails with the pip extra to install."""
from __future__ import annotations

import importlib.util

EXTRAS = {"bitsandbytes": "quant", "wandb": "wandb", "gguf": "smollm2", "openenv": "openenv", "sentence_transformers": "rwml"}


def available(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def require(module: str, extra: str, feature: str) -> None:
    if not available(module):
        raise ImportError(
            f"{feature} needs the optional package {module!r}: install it with `pip install 'cope-trainer[{extra}]'`"
        )
