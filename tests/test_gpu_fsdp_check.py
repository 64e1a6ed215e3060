"""bench/gpu_fsdp_check.py, the prepared GPU check of sharded training: the CPU smoke of its four phases from a bare
checkout (the GPU image's condition: no editable install, no hydra-core or omegaconf) reports each one with the bytes
the rank holds equal to docs/sharding.md's formula, written out here from the shape (full fine-tuning: fp32 masters,
gradients and moments, a bf16 reference; LoRA: a bf16 base, fp32 adapter), each kind stored in that dtype and the
forward computing in bf16 (FSDP's mixed precision, on CPU too); full1.5b's step in 2 micro-batches (tied embeddings);
the frozen reference is the start (KL 0 before the first update) and is used (KL > 0 after); at the authors' lr 1e-6
the fp32 masters keep AdamW's updates; a phase that cannot run is recorded and fails the run; without CUDA the full
run refuses to start. The plan: the default phases fit the 80 GB card in about 5 minutes, full7b and lora32b name
the 141 GB card and are refused, before anything is built, on a GPU reporting less (a faked H100). The GPU shapes are
the published models' (built on the meta device), and each phase's card is what the script's own prediction needs."""
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
PHASES = ("full1.5b", "full7b", "lora14b", "lora32b")


def _run(args: list[str], cwd: Path, timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", BARE, str(SCRIPT), *args], cwd=cwd, env=_bare_env(), capture_output=True,
                          text=True, timeout=timeout)


def qwen2_params(s: dict) -> int:
    """Parameters of a Qwen2ForCausalLM of shape ``s`` (q, k, v with biases; the head untied unless the shape ties it)."""
    h, i, v = s["hidden_size"], s["intermediate_size"], s["vocab_size"]
    kv = s["num_key_value_heads"] * h // s["num_attention_heads"]
    layer = (h * h + h) + 2 * (h * kv + kv) + h * h + 3 * h * i + 2 * h  # q, k and v, o, gate/up/down, two norms
    heads = 1 if s.get("tie_word_embeddings") else 2
    return heads * v * h + s["num_hidden_layers"] * layer + h  # embeddings (and head), layers, final norm


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
    assert summary["mixed_precision"] == "bf16" and summary["settings"]["full_dtype"] == "fp32"
    for name in PHASES:
        r = summary[name]
        assert r["step_s"] > 0 and len(r["step_s_all"]) == 2 and r["score_s"] > 0 and r["finite"], (name, r)
        assert r["world"] == 1 and r["replicated"] == 0  # every parameter sharded (a DTensor), none left whole
        assert r["compute_dtypes"] == {"policy": ["bfloat16"], "reference": ["bfloat16"]}  # gathered by the mp policy
        P, T, arith = r["params"], r["trained"], r["per_gpu_arithmetic"]
        if r["finetune"] == "full":  # fp32 masters, gradients and moments; the frozen copy in bf16, sharded too
            assert P == T == qwen2_params(r["shape"]) and r["reference_replicated"] == 0
            want = {"params": 4 * P, "reference": 2 * P, "grads": 4 * P, "optimizer": 8 * P}
            dtypes = {"params": ["float32"], "reference": ["bfloat16"], "grads": ["float32"], "optimizer": ["float32"]}
            if name == "full7b":
                assert r["layers"] == "1 of 2" and r["shape"]["num_hidden_layers"] == 1  # the smoke's share of 14 of 28
                whole = qwen2_params({**r["shape"], "num_hidden_layers": 2})
                assert arith["params"] == whole and arith["layers"] == 2 and whole > P  # the whole model's, not the built one's
            else:  # full1.5b: every layer, the embeddings tied to the head, the step in 2 micro-batches
                assert r["layers"] == "2 of 2" and r["shape"]["tie_word_embeddings"] and r["microbatches"] == 2
                whole = P
                assert r["accumulated_grad_formula_gib"] == round(4 * P / 2**30, 3) and r["accumulated_grad_gib"] is None  # CPU
            assert arith["step_state"] == {str(w): 18 * whole // w for w in (1, 2, 4, 8)}
        else:  # bf16 base, peft's fp32 adapter: its gradients and moments in fp32; the reference is the adapter off
            assert T == lora_params(r["shape"], 32) == r["trained_expected"] and P == qwen2_params(r["shape"]) + T
            want = {"params": 2 * (P - T) + 4 * T, "reference": 0, "grads": 4 * T, "optimizer": 8 * T}
            dtypes = {"params": ["bfloat16", "float32"], "reference": [], "grads": ["float32"], "optimizer": ["float32"]}
            assert r["layers"] == "2 of 2" and arith["params"] == P and arith["layers"] == 2
            assert arith["step_state"] == {str(w): sum(want.values()) // w for w in (1, 2, 4, 8)}
        want["total"] = sum(want.values())
        assert r["held"] == want == r["formula"], name  # counted on the rank, exactly the formula at W = 1
        assert r["dtypes"] == dtypes, name
        assert arith["whole_bf16_model"] == 2 * arith["params"]
        # the reference is the starting weights (KL 0 before any update: the bf16 reference computes exactly as the
        # policy's bf16 copies of its bf16-exact masters) and stays there while the policy moves
        kl = r["kl_scored"]
        assert len(kl) == 4 and kl[0] == 0 and all(k > 0 for k in kl[1:]) and kl[-1] > kl[1], (name, kl)
        assert r["updated_fraction"] > 0.5 and r["updated_fraction_except_embeddings"] > 0.99, name
        assert r["peak_step_gib"] is None and r["peak_score_gib"] is None  # CPU: no CUDA allocator to read
    # at the authors' lr the fp32 masters keep the updates: measured 0.633 of all weights (0.634 at most: the input
    # embeddings' rows of the 962 tokens the batch does not hold get no gradient) and 1.0 of the rest; bf16 weights
    # trained in place kept 0.015 of all in 3 steps
    assert summary["full7b"]["lr"] == summary["settings"]["full_lr"] == 1e-6
    assert "| full7b | 1 of 2 |" in proc.stdout and "arithmetic, not measured" in proc.stdout
    assert "full1.5b: 2 micro-batches" in proc.stdout and "full1.5b: W = 1 (one GPU: the shard is the whole model)" in proc.stdout
    assert summary["full1.5b"]["microbatch_peak_gib"] is None and summary["lora14b"]["microbatches"] == 1


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


@pytest.mark.parametrize("name,params", [("full7b", 7_615_616_512), ("lora14b", 14_770_033_664), ("lora32b", 32_763_876_352),
                                         ("full1.5b", 1_543_714_304)])
def test_the_gpu_shapes_are_the_published_models(check, name, params):
    """Each phase's shape (full7b: the model it stands for) built on the meta device (no memory) has the published
    model's parameter count: its model.safetensors.index.json total_size / 2 (bf16) on the hub (the model cards round:
    7.61B, 14.7B, 32.5B); 1.5B's is this file's count of its config (the card says 1.54B), its head tied."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    whole, built = check.shapes(check.PHASES[name], smoke=False)
    with torch.device("meta"):
        model = Qwen2ForCausalLM(Qwen2Config(**whole))
    assert sum(p.numel() for p in model.parameters()) == qwen2_params(whole) == check.count_params(whole) == params
    tied = model.lm_head.weight is model.model.embed_tokens.weight
    assert tied is (name == "full1.5b")  # as each config.json says
    layers = 14 if name == "full7b" else whole["num_hidden_layers"]  # full7b: 7B's width, half its layers
    assert built == {**whole, "num_hidden_layers": layers, "max_window_layers": layers}


def test_full7b_fits_one_h200_where_the_whole_7b_does_not(check):
    """At 18 B a weight (fp32 masters, gradients, moments; bf16 reference) plus a step's AdamW temporary and
    activations, the whole 7.6B model is over one 139 GiB H200 at W = 1; the 14 layers built stay under 120 GiB in a
    step and in a scoring pass (a whole bf16 copy gathered). Arithmetic, the script's own, from the shapes."""
    whole, built = check.shapes(check.PHASES["full7b"], smoke=False)
    gib = {}
    for key, shape in (("whole", whole), ("built", built)):
        P = check.count_params(shape)
        state = check.formula(P, P, 1, 2, 4, 2)["total"]
        assert state == 18 * P
        gib[key] = check.predicted(state, P, P)
    assert gib["whole"]["step"] > 139 and 100 < gib["built"]["step"] <= 120 and gib["built"]["score"] <= 120, gib


def test_each_phase_names_the_card_its_prediction_needs(check):
    """The plan's card per phase rests on the script's own memory prediction for the model it builds: the 80 GB phases
    peak under what an H100 reports (79.6 GiB, less a margin), the 141 GB ones over it and under an H200's 140.4."""
    from bench.gpu_plan import CARD_MIN_GIB

    assert list(check.PLAN) == ["full1.5b", "lora14b", "full7b", "lora32b"] and set(check.PLAN) == set(check.PHASES)
    for name, spec in check.PLAN.items():
        peak = max(check.phase_prediction(name).values())
        if spec.card == "80GB":
            assert peak <= CARD_MIN_GIB["80GB"], (name, peak)
        else:
            assert CARD_MIN_GIB["80GB"] < peak <= CARD_MIN_GIB["141GB"], (name, peak)
    assert {n for n, p in check.PLAN.items() if p.card == "141GB"} == {"full7b", "lora32b"}
    default = [n for n, p in check.PLAN.items() if p.default]
    assert default == ["full1.5b", "lora14b"] and check.SETUP.minutes + sum(check.PLAN[n].minutes for n in default) <= 5.0


def test_plan_and_unknown_phase(tmp_path):
    proc = _run(["--dry-run"], cwd=tmp_path, timeout=60)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "| full1.5b | 80GB |" in proc.stdout and "| lora14b | 80GB |" in proc.stdout and "| full7b |" not in proc.stdout
    assert "on the 80 GB card (an H100; an H200 too)" in proc.stdout
    h200 = _run(["--dry-run", "--phase", "full7b", "lora32b"], cwd=tmp_path, timeout=60)
    assert h200.returncode == 0 and "| full7b | 141GB |" in h200.stdout and "on the 141 GB card (an H200)" in h200.stdout
    bad = _run(["--phase", "full70b"], cwd=tmp_path, timeout=60)
    assert bad.returncode == 2 and "invalid choice: 'full70b'" in bad.stderr and all(f"'{n}'" in bad.stderr for n in PHASES)


def test_a_141gb_phase_is_refused_on_an_80gb_card_before_anything_is_built(check, monkeypatch, capsys):
    """A faked H100 (79.6 GiB from get_device_properties): full7b and lora32b are refused naming the 141 GB card, the
    H200 and the phases that fit; nothing is built. The default plan passes the same check."""
    import types

    import torch.distributed as dist

    from bench import gpu_plan

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda i=0: types.SimpleNamespace(name="NVIDIA H100 80GB HBM3", total_memory=81559 * 2**20))
    built = []
    monkeypatch.setattr(check, "run_phase", lambda *a, **k: built.append(a))
    monkeypatch.setattr(dist, "init_process_group", lambda *a, **k: built.append("group"))
    assert check.main(["--phase", "lora14b", "full7b", "lora32b"]) == gpu_plan.EXIT_CARD_TOO_SMALL
    err = capsys.readouterr().err
    assert "full7b needs the 141 GB card (an H200)" in err and "lora32b needs the 141 GB card" in err
    assert "has 79.6 GiB" in err and "nvidia-h200" in err and "--phase lora14b" in err and built == []
    assert gpu_plan.check_card("gpu_fsdp_check", check.PLAN, ["full1.5b", "lora14b"]) is None  # the default plan fits
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda i=0: types.SimpleNamespace(name="NVIDIA H200", total_memory=143771 * 2**20))
    assert gpu_plan.check_card("gpu_fsdp_check", check.PLAN, list(check.PLAN)) is None
