"""bench/gpu_fsdp_check.py, the prepared GPU check of sharded training: the CPU smoke of its three phases from a bare
checkout (the GPU image's condition: no editable install, no hydra-core or omegaconf) reports each one with the bytes
the rank holds equal to docs/sharding.md's formula, written out here from the shape; the frozen reference is the
start (KL 0 before the first update) and is used (KL > 0 after); a phase that cannot run is recorded and fails the
run; without CUDA the full run refuses to start. The GPU shapes are the published models' (built on the meta
device)."""
from __future__ import annotations

import importlib
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

# the GPU image's interpreter (no editable install of cope, hydra / omegaconf absent), as tests/test_gpu_check.py makes it
from test_gpu_check import BARE, _bare_env

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "bench" / "gpu_fsdp_check.py"
PHASES = ("full7b", "lora14b", "lora32b")


def _run(args: list[str], cwd: Path, timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", BARE, str(SCRIPT), *args], cwd=cwd, env=_bare_env(), capture_output=True,
                          text=True, timeout=timeout)


def qwen2_params(s: dict) -> int:
    """Parameters of a Qwen2ForCausalLM of shape ``s`` (untied head; q, k, v with biases)."""
    h, i, v = s["hidden_size"], s["intermediate_size"], s["vocab_size"]
    kv = s["num_key_value_heads"] * h // s["num_attention_heads"]
    layer = (h * h + h) + 2 * (h * kv + kv) + h * h + 3 * h * i + 2 * h  # q, k and v, o, gate/up/down, two norms
    return 2 * v * h + s["num_hidden_layers"] * layer + h  # embeddings, head, layers, final norm


def lora_params(s: dict, r: int) -> int:
    """r x (in + out) for each of the seven projections of every layer."""
    h, i = s["hidden_size"], s["intermediate_size"]
    kv = s["num_key_value_heads"] * h // s["num_attention_heads"]
    return s["num_hidden_layers"] * r * (2 * (h + h) + 2 * (h + kv) + 3 * (h + i))


@pytest.mark.long
def test_smoke_of_every_phase(tmp_path):
    out = tmp_path / "gpu_fsdp_check.json"
    proc = _run(["--smoke", "--phase", *PHASES, "--json", str(out)], cwd=tmp_path, timeout=180)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    summary = json.loads([ln for ln in proc.stdout.splitlines() if ln.startswith("{")][-1])
    assert json.loads(out.read_text()) == summary
    assert summary["ok"] and summary["smoke"] and summary["imported_hydra_or_omegaconf"] == []
    assert summary["cope_path"] == str(REPO / "src" / "cope")  # this checkout, through the script's own finder
    for name in PHASES:
        r = summary[name]
        assert r["step_s"] > 0 and len(r["step_s_all"]) == 2 and r["score_s"] > 0 and r["finite"], (name, r)
        assert r["world"] == 1 and r["replicated"] == 0  # every parameter sharded (a DTensor), none left whole
        P, T = r["params"], r["trained"]
        if r["finetune"] == "full":  # bf16 weights trained as they are: gradients and moments in bf16; the frozen copy
            assert P == T == qwen2_params(r["shape"]) and r["reference_replicated"] == 0  # the frozen copy sharded too
            want = {"params": 2 * P, "reference": 2 * P, "grads": 2 * P, "optimizer": 4 * P}
        else:  # bf16 base, peft's fp32 adapter: its gradients and moments in fp32; the reference is the adapter off
            assert T == lora_params(r["shape"], 32) == r["trained_expected"] and P == qwen2_params(r["shape"]) + T
            want = {"params": 2 * (P - T) + 4 * T, "reference": 0, "grads": 4 * T, "optimizer": 8 * T}
        want["total"] = sum(want.values())
        assert r["held"] == want == r["formula"], name  # counted on the rank, exactly the formula at W = 1
        assert r["per_gpu_arithmetic"] == {str(w): want["total"] // w for w in (1, 2, 4, 8)}
        # the reference is the starting weights (KL 0 before any update) and stays there while the policy moves
        kl = r["kl_scored"]
        assert len(kl) == 4 and kl[0] == 0 and all(k > 0 for k in kl[1:]) and kl[-1] > kl[1], (name, kl)
        assert r["updated_fraction"] > 0.5
        assert r["peak_step_gib"] is None and r["peak_score_gib"] is None  # CPU: no CUDA allocator to read
    assert summary["full7b"]["shape"]["num_hidden_layers"] == 2 and summary["full7b"]["lr"] == 1e-3
    assert summary["settings"]["full_lr"] == 1e-6  # what the GPU phase trains with (the authors' lr)
    assert "| full7b |" in proc.stdout and "arithmetic, not measured" in proc.stdout


@pytest.mark.long
def test_a_phase_that_cannot_run_is_recorded_and_fails_the_run(tmp_path):
    out = tmp_path / "gpu_fsdp_check.json"
    proc = _run(["--smoke", "--phase", "lora14b", "--max-seconds", "0", "--json", str(out)], cwd=tmp_path, timeout=120)
    assert proc.returncode == 1, proc.stderr[-3000:]
    summary = json.loads(out.read_text())
    assert not summary["ok"] and "--max-seconds" in summary["lora14b"]["error"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_full_run_needs_cuda(tmp_path):
    proc = _run(["--phase", "full7b"], cwd=tmp_path, timeout=120)
    assert proc.returncode == 2 and "no CUDA device" in proc.stderr and "--smoke" in proc.stderr


@pytest.fixture
def check():
    before = list(sys.meta_path)
    try:
        yield importlib.import_module("bench.gpu_fsdp_check")
    finally:
        sys.meta_path[:] = before  # the script's checkout finder is for its own process


@pytest.mark.parametrize("name,params", [("full7b", 7_615_616_512), ("lora14b", 14_770_033_664), ("lora32b", 32_763_876_352)])
def test_the_gpu_shapes_are_the_published_models(check, name, params):
    """Each phase's shape built on the meta device (no memory) has the published model's parameter count: its
    model.safetensors.index.json total_size / 2 (bf16) on the hub (the model cards round: 7.61B, 14.7B, 32.5B)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    shape = check.PHASES[name].shape
    with torch.device("meta"):
        model = Qwen2ForCausalLM(Qwen2Config(**shape))
    assert sum(p.numel() for p in model.parameters()) == qwen2_params(shape) == params
    assert model.lm_head.weight is not model.model.embed_tokens.weight  # untied, as config.json says
