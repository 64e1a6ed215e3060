"""bench/gpu_check.py, the prepared GPU check: its plan (phases by name, the card each needs, estimated minutes; the
default plan within about 5 minutes; an unknown phase refused naming the valid ones), its CPU smoke run from a bare
checkout (no editable install, hydra-core and omegaconf absent, as on the GPU image) reporting every phase, the
training phases through a Lightning Trainer in trainer=gpu's bf16-mixed precision (on CPU), the tree phase's checks of
the kernel's calls and of its exactness (each shown to fail on a broken kernel); it refuses to start without CUDA. The
full run (Qwen2.5-7B's shape) is marked ``gpu``."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bench import gpu_tree

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
    """Every phase the run names reported what it measured; the comparisons between phases where both ran."""
    assert summary["ok"] and summary["smoke"] is smoke
    assert summary["cope_path"] == str(REPO / "src" / "cope")  # this checkout, through the script's own finder
    assert summary["imported_hydra_or_omegaconf"] == []
    ran = set(summary["phases"])
    model = summary["model"]
    assert model["trainable"] == model["trainable_expected"] and model["lora_targets_complete"]
    for name in ran & {"grpo", "cope", "cope_tree", "grpo_shared"}:
        r = summary[name]
        assert PHASE_KEYS <= r.keys(), (name, r)
        assert r["finite"] and r["adapter_moved"] and r["step_s"] > 0 and r["tokens_per_s"] > 0
        assert len(r["step_s_all"]) >= 1 and r["microbatches"] >= 2  # the token budget split the minibatch
        assert (r["peak_mem_gib"] is None) is smoke
        assert r["precision"] == "bf16-mixed" and r["adapter_dtype"] == ["float32"]  # trainer=gpu's autocast, peft's fp32 adapter
        assert len(r["loss"]) == summary["sizes"]["warmup"] + len(r["step_s_all"])  # the Trainer ran warm-up + timed steps
    if {"grpo", "cope"} <= ran:
        assert summary["cope"]["chunks"] > 0 and summary["cope"]["width"] > summary["grpo"]["width"]  # forecast segments appended
        assert summary["cope"]["tokens"] == summary["grpo"]["tokens"] == sum(summary["episode_tokens"])
        assert summary["forecast_overhead"] == pytest.approx(summary["cope"]["step_s"] / summary["grpo"]["step_s"], rel=1e-2)
    if {"cope", "cope_tree", "grpo", "grpo_shared"} <= ran:  # the shared-prefix rows: same transcripts, prompts forwarded once
        assert summary["cope_tree"]["shared"] and summary["cope_tree"]["width"] == summary["cope"]["width"]
        assert summary["grpo_shared"]["tokens_forwarded"] < summary["grpo"]["tokens"] == summary["grpo_shared"]["tokens"]
        assert summary["cope_tree_vs_cope"] > 0 and summary["grpo_shared_vs_grpo"] > 0
    if "tree" in ran:
        t = summary["tree"]
        assert t["checks_ok"] and t["exactness"]["exact"] and t["step_s"] > 0
        assert t["calls_per_layer"]["causal"] > 0 and t["calls_per_layer"]["masked"] > 0
        assert (t["heads"], t["kv_heads"]) == ((4, 2) if smoke else (28, 4)) and (t["peak_mem_gib"] is None) is smoke
        if not smoke:
            assert t["kernels"] == {"causal": [gpu_tree.CUDA_KERNELS["causal"]], "masked": [gpu_tree.CUDA_KERNELS["masked"]]}
    if "generation" in ran:
        gen = summary["generation"]
        assert GEN_KEYS <= gen.keys() and gen["new_tokens"] > 0 and gen["tokens_per_s"] > 0
        assert (gen["peak_mem_gib"] is None) is smoke


ALL = ["grpo", "cope", "cope_tree", "grpo_shared", "tree", "generation"]


@pytest.mark.long
def test_smoke_run_from_a_bare_checkout(tmp_path):
    proc = _run(["--smoke", "--phase", *ALL], cwd=tmp_path, timeout=180, OUT=str(tmp_path))
    summary = _summary(proc)
    assert summary["phases"] == ALL
    _check(summary, smoke=True)
    assert summary["sizes"]["episodes"] == 4 and summary["settings"]["lora"]["r"] == 32  # the 7B preset's LoRA, tiny shapes
    assert summary["settings"]["trainer"]["precision"] == "bf16-mixed"  # conf/trainer/gpu.yaml's, read without hydra
    assert json.loads((tmp_path / "gpu_check.json").read_text()) == summary  # $OUT/gpu_check.json
    assert "| grpo |" in proc.stdout and "forecast overhead" in proc.stdout and "| tree kernel" in proc.stdout
    assert proc.stdout.index("gpu_check: plan") < proc.stdout.index("| grpo |")  # the plan printed first


def test_plan_lists_phases_cards_and_estimates_and_exits(tmp_path):
    proc = _run(["--dry-run"], cwd=tmp_path, timeout=60)
    assert proc.returncode == 0, proc.stderr[-3000:]
    default = [n for n, p in gpu_check_phases().items() if p.default]
    assert default == ["grpo", "cope", "tree", "generation"]
    for name in default:
        assert f"| {name} | 80GB |" in proc.stdout and "est." in proc.stdout
    assert "| cope_tree |" not in proc.stdout and "total: 3.9 min estimated, on the 80 GB card" in proc.stdout
    listed = _run(["--list"], cwd=tmp_path, timeout=60)
    assert listed.returncode == 0 and all(f"| {n} |" in listed.stdout for n in ALL)
    one = _run(["--dry-run", "--phase", "tree"], cwd=tmp_path, timeout=60)  # the tree phase alone builds no model
    assert one.returncode == 0 and "| tree |" in one.stdout and "imports, CUDA init (no model)" in one.stdout


def test_default_plan_fits_about_five_minutes_on_the_80gb_card():
    from bench.gpu_plan import CARD_MIN_GIB

    phases = gpu_check_phases()
    from bench.gpu_check import SETUP

    total = SETUP.minutes + sum(p.minutes for p in phases.values() if p.default)
    assert total <= 5.0 and all(p.card == "80GB" for p in phases.values()), total
    assert CARD_MIN_GIB["80GB"] < 79.6 < CARD_MIN_GIB["141GB"] < 140.4  # an H100 reports 79.6 GiB, an H200 140.4
    assert all(p.basis and p.measured is None for p in phases.values())  # estimates, each with its arithmetic


def test_an_unknown_phase_is_refused_naming_the_valid_ones(tmp_path):
    proc = _run(["--phase", "grpo", "warp"], cwd=tmp_path, timeout=60)
    assert proc.returncode == 2 and "invalid choice: 'warp'" in proc.stderr
    assert all(f"'{n}'" in proc.stderr for n in ALL)


def gpu_check_phases():
    before = list(sys.meta_path)
    try:
        from bench.gpu_check import PHASES
    finally:
        sys.meta_path[:] = before  # the script's checkout finder is for its own process
    return PHASES


def test_the_tree_phase_flags_calls_the_cuda_kernels_would_refuse():
    """The kernel-choice rules, on recorded calls: a masked call keeping grouped heads (enable_gqa: only the math kernel
    takes it on CUDA) and, on CUDA, a call that ran on another kernel are each reported."""
    good = [{"kind": "causal", "is_causal": True, "gqa": True, "heads": (28, 4, 4), "dtypes": ["torch.bfloat16"], "mask": None,
             "kernel": gpu_tree.CUDA_KERNELS["causal"]},
            {"kind": "masked", "is_causal": False, "gqa": False, "heads": (28, 28, 28), "dtypes": ["torch.bfloat16"],
             "mask": "torch.bool", "kernel": gpu_tree.CUDA_KERNELS["masked"]}]
    assert gpu_tree.kernel_problems(good, cuda=True) == []
    gqa = {**good[1], "gqa": True, "heads": (28, 4, 4)}
    assert "memory-efficient kernel's form" in " ".join(gpu_tree.kernel_problems([good[0], gqa], cuda=False))
    math = {**good[1], "kernel": "BmmBackward0"}
    assert "masked calls ran on ['BmmBackward0']" in " ".join(gpu_tree.kernel_problems([good[0], math], cuda=True))
    assert gpu_tree.kernel_problems([good[0], math], cuda=False) == []  # CPU: the form only
    assert "both causal and masked" in " ".join(gpu_tree.kernel_problems(good[:1], cuda=False))


def test_the_tree_phase_runs_on_cpu_and_fails_on_a_kernel_off_the_reference(monkeypatch):
    from cope.train.packing import tree_attention

    res = gpu_tree.run_tree(torch.device("cpu"), smoke=True)
    assert res["checks_ok"] and res["calls_per_layer"]["masked"] > 0 and res["cells"]["tree"] < res["cells"]["dense"]
    errs = res["exactness"]["tiles_bf16_rel_err"]
    assert max(errs.values()) < 0.02 and max(errs.values()) <= 2 * max(res["exactness"]["dense_bf16_rel_err"].values())
    original = tree_attention._tile_groups
    monkeypatch.setattr(tree_attention, "_tile_groups", lambda *a: original(*a) * 1.1)  # tile outputs 10% off
    with pytest.raises(gpu_tree.PhaseFailed, match="off the dense fp32 reference") as caught:
        gpu_tree.run_tree(torch.device("cpu"), smoke=True)
    assert not caught.value.result["exactness"]["exact"] and caught.value.result["step_s"] > 0  # what it measured, kept


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
    """The prepared run itself, every phase: Qwen2.5-7B's shape, 16 x 8k tokens, the tree kernel at 7B's attention,
    batch-64 generation (about 7 minutes estimated on one H100 or H200)."""
    summary = _summary(_run(["--phase", *ALL, "--max-seconds", "800", "--json", str(tmp_path / "gpu_check.json")], cwd=tmp_path,
                            timeout=900))
    _check(summary, smoke=False)
    assert summary["model"]["params"] > 7.6e9 and summary["sizes"]["episodes"] == 16
