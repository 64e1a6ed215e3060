"""bench/gpu_check.py, the prepared GPU check: its CPU smoke run from a bare checkout (no editable
install, hydra-core and omegaconf absent, as on the GPU image) reports every phase; it refuses to start
the full run without CUDA; its shim for transformers releases before the ``cache=`` rename translates
both ways. The full run (Qwen2.5-7B's shape) is marked ``gpu``."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "bench" / "gpu_check.py"

# A clean interpreter as the GPU image has it: no `pip install -e .` finder for cope, and hydra /
# omegaconf not installed (find_spec gives None, import fails); then the script runs as __main__.
BARE = """
import importlib.machinery as m, runpy, sys
class PathFinderWithout(m.PathFinder):
    @classmethod
    def find_spec(cls, name, path=None, target=None):
        return None if name.partition(".")[0] in ("hydra", "omegaconf") else super().find_spec(name, path, target)
sys.meta_path[:] = [PathFinderWithout if f is m.PathFinder else f for f in sys.meta_path if "editable" not in getattr(f, "__module__", "")]
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""
PHASE_KEYS = {"step_s", "step_s_all", "tokens_per_s", "tokens", "cells", "microbatches", "score_s", "peak_mem_gib", "loss",
              "finite", "adapter_moved", "rows", "width"}
GEN_KEYS = {"batch", "prompt_tokens", "max_new_tokens", "new_tokens", "seconds", "tokens_per_s", "peak_mem_gib"}


def _bare_env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "OUT")}
    return {**env, "OMP_NUM_THREADS": "1", **extra}


def _run(args: list[str], cwd: Path, timeout: float, **env) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", BARE, str(SCRIPT), *args], cwd=cwd, env=_bare_env(**env), capture_output=True,
                          text=True, timeout=timeout)


def _summary(proc: subprocess.CompletedProcess) -> dict:
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    assert lines, proc.stdout[-3000:]
    return json.loads(lines[-1])


def _check(summary: dict, smoke: bool) -> None:
    assert summary["ok"] and summary["smoke"] is smoke
    assert summary["cope_path"] == str(REPO / "src" / "cope")  # this checkout, through the script's own finder
    assert summary["imported_hydra_or_omegaconf"] == []
    model = summary["model"]
    assert model["trainable"] == model["trainable_expected"] and model["lora_targets_complete"]
    for name in ("grpo", "cope", "cope_tree", "grpo_shared"):
        r = summary[name]
        assert PHASE_KEYS <= r.keys(), (name, r)
        assert r["finite"] and r["adapter_moved"] and r["step_s"] > 0 and r["tokens_per_s"] > 0
        assert len(r["step_s_all"]) >= 1 and r["microbatches"] >= 2  # the token budget split the minibatch
        assert (r["peak_mem_gib"] is None) is smoke
    assert summary["cope"]["chunks"] > 0 and summary["cope"]["width"] > summary["grpo"]["width"]  # forecast segments appended
    assert summary["cope"]["tokens"] == summary["grpo"]["tokens"] == sum(summary["episode_tokens"])
    assert summary["forecast_overhead"] == pytest.approx(summary["cope"]["step_s"] / summary["grpo"]["step_s"], rel=1e-2)
    # the shared-prefix rows: the same transcripts and steps, the group prompts forwarded once
    assert summary["cope_tree"]["shared"] and summary["cope_tree"]["width"] == summary["cope"]["width"]
    assert summary["grpo_shared"]["tokens_forwarded"] < summary["grpo"]["tokens"] == summary["grpo_shared"]["tokens"]
    assert summary["cope_tree_vs_cope"] > 0 and summary["grpo_shared_vs_grpo"] > 0
    gen = summary["generation"]
    assert GEN_KEYS <= gen.keys() and gen["new_tokens"] > 0 and gen["tokens_per_s"] > 0
    assert (gen["peak_mem_gib"] is None) is smoke


@pytest.mark.long
def test_smoke_run_from_a_bare_checkout(tmp_path):
    proc = _run(["--smoke"], cwd=tmp_path, timeout=180, OUT=str(tmp_path))
    summary = _summary(proc)
    _check(summary, smoke=True)
    assert summary["sizes"]["episodes"] == 4 and summary["settings"]["lora"]["r"] == 32  # the 7B preset's LoRA, tiny shapes
    assert json.loads((tmp_path / "gpu_check.json").read_text()) == summary  # $OUT/gpu_check.json
    assert "| grpo |" in proc.stdout and "forecast overhead" in proc.stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_full_run_needs_cuda(tmp_path):
    proc = _run([], cwd=tmp_path, timeout=120)
    assert proc.returncode == 2
    assert "no CUDA device" in proc.stderr and "--smoke" in proc.stderr


@pytest.fixture
def gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    before = list(sys.meta_path)
    sys.modules["gpu_check"] = mod  # dataclasses look their module up there
    try:
        spec.loader.exec_module(mod)
        yield mod
    finally:
        sys.meta_path[:] = before  # the script's checkout finder is for its own process
        sys.modules.pop("gpu_check", None)


@pytest.mark.long
def test_the_gpu_shape_is_qwen25_7b(gpu_check):
    """The GPU run's model built on the meta device (no memory): Qwen2.5-7B's published parameter count,
    an untied head on the fused log-prob path, and the 7B preset's LoRA on every projection."""
    from cope.train.logprobs import linear_head

    chat, _, _ = gpu_check.scaffold(gpu_check.QWEN25_7B["vocab_size"])
    settings = gpu_check.project_settings()
    policy = gpu_check.build_policy(gpu_check.QWEN25_7B, torch.device("meta"), settings, chat)
    n_train = sum(p.numel() for p in policy.trainable_parameters())
    assert n_train == gpu_check.expected_lora_params(gpu_check.QWEN25_7B, 32) == 80_740_352
    assert sum(p.numel() for p in policy.model.parameters()) - n_train == 7_615_616_512  # Qwen2.5-7B
    base = policy.model.get_base_model()
    assert base.lm_head.weight is not base.model.embed_tokens.weight and linear_head(policy.model) is not None
    assert {p.dtype for p in base.parameters() if not p.requires_grad} == {torch.bfloat16}
    assert base.config.rope_parameters["rope_theta"] == 1e6 and base.is_gradient_checkpointing


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (torch.cuda.is_available() is False)")
def test_full_run_on_cuda(tmp_path):
    """The prepared run itself: Qwen2.5-7B's shape, 16 x 8k tokens, batch-64 generation (minutes on one H200)."""
    summary = _summary(_run(["--json", str(tmp_path / "gpu_check.json")], cwd=tmp_path, timeout=900))
    _check(summary, smoke=False)
    assert summary["model"]["params"] > 7.6e9 and summary["sizes"]["episodes"] == 16
