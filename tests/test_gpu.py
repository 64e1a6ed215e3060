"""GPU-only paths: bf16-mixed training, 4-bit QLoRA (bitsandbytes) on CUDA, NCCL DDP over 2 GPUs, the tree kernel
at 7B's attention on the flash and memory-efficient kernels (bench/gpu_tree.py).

Their CPU twins run in the default suite (fp32 training everywhere, ``tests/test_policy.py`` 4-bit on
CPU, ``tests/test_ddp.py`` gloo DDP with 2 CPU processes). These are marked ``gpu``, deselected by
default (pyproject's addopts) and skipped with a reason where no CUDA device is present; run them with
``make test ARGS="-m gpu"``. Models are tiny and built locally (``tests/tiny_fixtures.py``): no download.
"""
from __future__ import annotations

import importlib.util

import pytest
import torch
from tiny_fixtures import lora_config, save_tiny, tiny_policy

pytestmark = pytest.mark.gpu

N_GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
needs_cuda = pytest.mark.skipif(N_GPUS == 0, reason="needs a CUDA device (torch.cuda.is_available() is False)")
needs_bnb = pytest.mark.skipif(importlib.util.find_spec("bitsandbytes") is None,
                               reason="needs bitsandbytes (extra `quant`)")
needs_2_gpus = pytest.mark.skipif(N_GPUS < 2, reason=f"NCCL DDP needs 2 CUDA devices, found {N_GPUS}")

IDS = torch.tensor([[1, 290, 201, 30, 31, 2, 201, 1, 295, 201, 268, 2], [1, 294, 201, 40, 41, 42, 2, 201, 1, 295, 201, 263]])
EPOCHS, TASKS, GROUP = 2, 2, 4  # conf/debug/fast.yaml: trainer.max_epochs, data.tasks_per_epoch, data.group_size
# every episode a CoPE target source, invalid actions kept (as tests/test_algo_configs.py)
# the tiny Qwen2 saved by save_tiny, trained through a pretrained preset (as tests/test_model_configs.py)
PRESET_SMALL = ["trainer.max_epochs=1", "data.tasks_per_epoch=1", "data.group_size=2", "data.val_tasks=2",
                "data.max_context=1024", "data.progress=false", "trainer.enable_progress_bar=false"]


def _lm_step(model, opt, bf16_autocast: bool = False) -> torch.Tensor:
    ids = IDS.to(next(model.parameters()).device)
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=bf16_autocast):
        logits = model(input_ids=ids).logits  # (N, T, V)
    assert logits.dtype == (torch.bfloat16 if bf16_autocast else logits.dtype)
    loss = torch.nn.functional.cross_entropy(logits[:, :-1].float().transpose(1, 2), ids[:, 1:])
    opt.zero_grad()
    loss.backward()
    opt.step()
    return loss.detach()


def _report(proc) -> str:
    return f"exit {proc.returncode}\n--- stdout ---\n{proc.stdout[-3000:]}\n--- stderr ---\n{proc.stderr[-5000:]}"


def _trained_adapter(run_dir) -> dict[str, torch.Tensor]:
    """The checkpoint's state_dict: adapter weights only, all finite, and LoRA B moved off its zero init."""
    sd = torch.load(run_dir / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)["state_dict"]
    assert sd and all("lora_" in k for k in sd), [k for k in sd if "lora_" not in k][:5]
    assert all(torch.isfinite(v.float()).all() for v in sd.values())
    assert any(v.abs().sum() > 0 for k, v in sd.items() if "lora_B" in k), "LoRA B still zero: no update reached the adapter"
    return sd


@needs_cuda
def test_bf16_autocast_steps_train_lora_only():
    """bf16 autocast on CUDA (what `trainer.precision=bf16-mixed` runs): the logits are bf16, the loss
    stays finite, the fp32 LoRA weights change and the frozen base stays bit-identical."""
    model = tiny_policy(seed=0).model.cuda().train()
    base0 = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    lora0 = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    losses = [_lm_step(model, opt, bf16_autocast=True) for _ in range(3)]
    assert all(torch.isfinite(x) for x in losses), losses
    assert all(p.dtype == torch.float32 for n, p in model.named_parameters() if n in lora0)
    assert any(not torch.equal(p, lora0[n]) for n, p in model.named_parameters() if n in lora0)
    assert all(torch.equal(p, base0[n]) for n, p in model.named_parameters() if n in base0)


COPE_JOINT = ["algo=cope_echo", "cope.update=joint", "cope.gate=all", "model.warm_start_steps=150", "env.sizes=[5]", "env.min_distance=1"]


@needs_cuda
@pytest.mark.parametrize("algo", [["algo=echo"], COPE_JOINT],
                         ids=["echo", "cope_echo"])
def test_bf16_mixed_training_through_entry_point(train_script, read_metrics, tmp_path, algo):
    """`python train.py trainer=gpu` (one GPU, bf16-mixed) with the tiny model: rollouts, scoring, the PPO
    loss and CoPE's samples packed as segments (update=joint, a warm-started maze with wins) all run on CUDA. ECHO is on in both cases:
    the cold-start policy never succeeds, so its dense loss is what moves the adapter."""
    run_dir = tmp_path / "run"
    proc = train_script(["debug=fast", "trainer=gpu", *algo, f"hydra.run.dir={run_dir}"], tmp_path, timeout=600)
    assert proc.returncode == 0, _report(proc)
    assert "=== cope-trainer run summary ===" in proc.stdout and f"episodes {EPOCHS * TASKS * GROUP}," in proc.stdout
    _trained_adapter(run_dir)
    cols = read_metrics(run_dir / "csv" / "metrics.csv")
    assert cols["counters/episodes"] == [TASKS * GROUP * (e + 1) for e in range(EPOCHS)]
    losses = [k for k in cols if k.startswith("loss/") and not k.endswith("_weighted")]
    assert "loss/pg" in losses and all(all(v == v for v in cols[k]) for k in losses), {k: cols[k] for k in losses}
    assert cols["loss/echo"], sorted(cols)
    if "algo=cope_echo" in algo:
        assert max(cols["forecast/samples"]) > 0, cols["forecast/samples"]


@needs_cuda
@needs_bnb
def test_4bit_qlora_loads_on_cuda_and_trains(tmp_path):
    """QLoRA on CUDA: the base's linear layers are nf4 on the GPU, the trainable count is LoRA's alone,
    a cached rollout forward and a bf16 training step run, and only the adapter changes."""
    import bitsandbytes as bnb

    from cope.models.policy import load_pretrained
    from cope.rollout.hf_actor import CachedSamplingActor

    policy = load_pretrained(str(save_tiny(tmp_path / "base")), lora=lora_config(), dtype="bf16", quantization="4bit")
    model = policy.model.eval()
    q = [m for m in model.modules() if isinstance(m, bnb.nn.Linear4bit)]
    assert len(q) == 7  # q, k, v, o, gate, up, down of the single layer
    assert all(m.weight.device.type == "cuda" and m.weight.dtype == torch.uint8 for m in q)  # packed nf4
    assert sum(p.numel() for p in model.parameters() if p.requires_grad) == 2048  # tests/test_policy.py's hand count
    packed0 = [m.weight.detach().clone() for m in q]

    actor = CachedSamplingActor(model, policy.pad_id, policy.chat.stop_id, max_new_tokens=3, temperature=1.0, seed=0)
    actions = actor([IDS[0].tolist(), IDS[1, :7].tolist()])
    assert all(1 <= len(a) <= 3 for a in actions)

    lora0 = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    model.train()
    loss = _lm_step(model, opt)
    assert torch.isfinite(loss)
    assert any(not torch.equal(p, lora0[n]) for n, p in model.named_parameters() if p.requires_grad)
    assert all(torch.equal(m.weight, w) for m, w in zip(q, packed0))


@needs_cuda
@needs_bnb
def test_4bit_qlora_through_entry_point(train_script, tmp_path):
    """`python train.py model=qwen2.5-7b model.quantization=4bit trainer=gpu`, the README's QLoRA command,
    on a tiny Qwen2 saved locally in place of the 7B checkpoint; ECHO's dense loss moves the adapter (the
    random tiny model never succeeds, so GRPO alone has zero advantages)."""
    run_dir = tmp_path / "run"
    proc = train_script(["model=qwen2.5-7b", f"model.path={save_tiny(tmp_path / 'base')}", "model.quantization=4bit",
                         "trainer=gpu", "algo=echo", *PRESET_SMALL, f"hydra.run.dir={run_dir}"], tmp_path, timeout=600)
    assert proc.returncode == 0, _report(proc)
    assert "=== cope-trainer run summary ===" in proc.stdout
    _trained_adapter(run_dir)
    assert (run_dir / "csv" / "adapter" / "adapter_model.safetensors").is_file()


@needs_2_gpus
def test_ddp_two_gpus_nccl(train_script, read_metrics, tmp_path):
    """`python train.py trainer=ddp trainer.accelerator=gpu` on 2 GPUs: NCCL, one process per device, each
    rank collecting its own groups; counters summed over ranks, one checkpoint and export."""
    run_dir = tmp_path / "run"
    proc = train_script(["debug=fast", "trainer=ddp", "trainer.devices=2", "trainer.accelerator=gpu",
                         "trainer.precision=bf16-mixed", f"hydra.run.dir={run_dir}"], tmp_path, timeout=600)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, _report(proc)
    assert "distributed_backend=nccl" in out and "Starting with 2 processes" in out, _report(proc)
    _trained_adapter(run_dir)
    assert (run_dir / "csv" / "adapter" / "adapter_model.safetensors").is_file()
    cols = read_metrics(run_dir / "csv" / "metrics.csv")
    assert cols["counters/episodes"] == [2 * TASKS * GROUP * (e + 1) for e in range(EPOCHS)], _report(proc)
    assert proc.stdout.count("=== cope-trainer run summary ===") == 1, _report(proc)


@needs_cuda
def test_tree_kernel_at_7b_attention_runs_without_the_math_kernel():
    """bench/gpu_check.py's `tree` phase on CUDA (seconds): the tiles kernel at Qwen2.5-7B's attention (28 query heads,
    4 key/value heads, head dim 128, bf16) inside sdpa_kernel([FLASH_ATTENTION, EFFICIENT_ATTENTION]): its causal calls
    ran on flash attention, its masked tile calls on the memory-efficient kernel, and its output and gradients are
    within bf16 rounding of the dense-mask SDPA in fp32."""
    from bench import gpu_tree

    res = gpu_tree.run_tree(torch.device("cuda", 0), smoke=False)
    assert res["checks_ok"] and res["exactness"]["exact"], res
    assert res["kernels"] == {"causal": [gpu_tree.CUDA_KERNELS["causal"]], "masked": [gpu_tree.CUDA_KERNELS["masked"]]}
    assert (res["heads"], res["kv_heads"], res["head_dim"]) == (28, 4, 128) and res["peak_mem_gib"] > 0
