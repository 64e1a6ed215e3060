"""Per-rank training-state memory and step time, ``trainer=fsdp`` against ``trainer=ddp``, side by side in one run.

At 2 ranks (gloo, CPU, fp32), on a model of Qwen2.5-0.5B's shape (its config, random weights: nothing is
downloaded), for LoRA (r=16 on the seven projections, as the 7B preset) and full fine-tuning: each rank builds the
model, wraps it as each strategy does (DDP: a whole copy, gradients all-reduced; FSDP: :func:`cope.train.fsdp.sharding.
shard_policy`, one group per decoder layer and the root), runs optimizer steps (AdamW) on a random batch through the
trainer's own log-prob path (:func:`cope.train.logprobs.causal_lm_logprobs`), and counts the bytes this rank holds of
parameters, gradients and optimizer moments after a step (sharded tensors: their local shard). Also the mean step time
(after one warm-up step) and the process's peak RSS.

The claim it backs (docs/sharding.md, "Memory per rank"): the step state per rank under FSDP is ~1/world of DDP's.
It does not measure what a rollout holds (the whole model on every rank under both).

Usage: ``python -m bench.fsdp_memory [--layers 24] [--tokens 128] [--steps 3] [--out bench/results/fsdp_memory.json]``
(at the full 24 layers, full fine-tuning under DDP holds ~8 GB per rank: 16 GB for the two ranks).
``--host-setup``: only the host RAM a full-fine-tuning rank takes while its model is built (the fp32 model and the
reference's deep copy), measured against the formula ``8P`` (:mod:`cope.train.fsdp.memory`), in seconds.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

# Qwen2.5-0.5B-Instruct's config.json (hub id Qwen/Qwen2.5-0.5B-Instruct), the fields that set the shapes
QWEN25_05B = dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                  num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=32768, tie_word_embeddings=True,
                  rope_theta=1000000.0, rms_norm_eps=1e-6)
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _local_bytes(t) -> int:
    if t is None:
        return 0
    local = t.to_local() if hasattr(t, "to_local") else t
    return local.numel() * local.element_size()


def _build(mode: str, layers: int):
    from peft import LoraConfig, get_peft_model
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(**{**QWEN25_05B, "num_hidden_layers": layers}))
    if mode == "lora":
        model.requires_grad_(False)
        model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, target_modules=LORA_TARGETS, task_type="CAUSAL_LM"))
    return model


class Scorer(torch.nn.Module):
    """The trainer's per-token log-probs of ``model`` as a module's forward (what DDP wraps)."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, ids, mask, pos):
        from cope.train.logprobs import causal_lm_logprobs

        return causal_lm_logprobs(self.model, ids, mask, pos)[0]


def _worker(rank: int, world: int, init: str, args, results) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    from cope.train.fsdp.sharding import shard_policy

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    out = {}
    try:
        for mode in ("lora", "full"):
            for strategy in ("ddp", "fsdp"):
                model = _build(mode, args.layers)
                runner = Scorer(model)  # the log-probs inside a module's forward, as the LightningModule runs them
                if strategy == "fsdp":
                    shard_policy(model, init_device_mesh("cpu", (world,)))
                else:
                    runner = torch.nn.parallel.DistributedDataParallel(runner)
                params = [p for p in model.parameters() if p.requires_grad]
                opt = torch.optim.AdamW(params, lr=1e-5)
                g = torch.Generator().manual_seed(rank)
                ids = torch.randint(0, QWEN25_05B["vocab_size"], (2, args.tokens), generator=g)
                mask, pos = torch.ones_like(ids), torch.arange(args.tokens).expand(2, -1)
                times = []
                for step in range(args.steps + 1):
                    t0 = time.perf_counter()
                    opt.zero_grad()
                    (-runner(ids, mask, pos).mean()).backward()
                    opt.step()
                    if step:
                        times.append(time.perf_counter() - t0)
                held = {"params": sum(_local_bytes(p) for p in model.parameters()),
                        "grads": sum(_local_bytes(p.grad) for p in params),
                        "optimizer": sum(_local_bytes(v) for s in opt.state.values() for k, v in s.items() if k != "step")}
                held["total"] = sum(held.values())
                out[f"{mode}/{strategy}"] = {**held, "step_s": sum(times) / len(times),
                                             "trainable": sum(p.numel() for p in model.parameters() if p.requires_grad)
                                             if strategy == "ddp" else None}
                del model, runner, opt, params
                dist.barrier()
        out["peak_rss_gb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
        results[rank] = out
    finally:
        dist.destroy_process_group()


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def host_setup(layers: int) -> dict:
    """Host RAM a full-fine-tuning rank takes while its model is built, measured in this process (RSS), against
    :meth:`cope.train.fsdp.memory.MemoryPlan.host_setup`: the fp32 model (``4P``), then the reference's deep copy
    (``4P`` more), as :meth:`cope.models.policy.Policy.freeze_reference` makes it before sharding."""
    import copy

    from cope.train.fsdp.memory import MemoryPlan, ModelShape

    cfg = {**QWEN25_05B, "num_hidden_layers": layers}
    shape = ModelShape(vocab=cfg["vocab_size"], hidden=cfg["hidden_size"], intermediate=cfg["intermediate_size"],
                       layers=layers, heads=cfg["num_attention_heads"], kv_heads=cfg["num_key_value_heads"], tied=True)
    before = _rss_bytes()
    model = _build("full", layers)
    built = _rss_bytes()
    reference = copy.deepcopy(model).requires_grad_(False)
    copied = _rss_bytes()
    predicted = MemoryPlan(shape, finetune="full", kl=True).host_setup()["per_rank"]
    measured = copied - before
    del model, reference
    return {"params": shape.params(), "model_bytes": built - before, "reference_bytes": copied - built,
            "measured_bytes": measured, "predicted_bytes": predicted, "ratio": measured / predicted}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=24, help="decoder layers (Qwen2.5-0.5B has 24)")
    p.add_argument("--tokens", type=int, default=128, help="tokens per row (2 rows per rank)")
    p.add_argument("--steps", type=int, default=3, help="timed optimizer steps (after one warm-up)")
    p.add_argument("--out", type=Path, default=None, help="JSON of the results (default: print only)")
    p.add_argument("--host-setup", action="store_true", help="only the host RAM of a full-fine-tuning setup, against "
                   "the formula (seconds; no ranks)")
    args = p.parse_args(argv)
    if args.host_setup:
        got = host_setup(args.layers)
        print(f"host RAM at setup, full fine-tuning, Qwen2.5-0.5B shape ({args.layers} layers, P = {got['params']:,}): "
              f"measured {got['measured_bytes'] / 2**30:.3f} GiB (model {got['model_bytes'] / 2**30:.3f}, reference "
              f"copy {got['reference_bytes'] / 2**30:.3f}), formula 8P = {got['predicted_bytes'] / 2**30:.3f} GiB, "
              f"ratio {got['ratio']:.3f}")
        return got
    world = 2
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    with tempfile.TemporaryDirectory() as tmp, mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(_worker, args=(world, f"file://{tmp}/rendezvous", args, results), nprocs=world, join=True)
        per_rank = [dict(results[r]) for r in range(world)]
    report = {"model": {**QWEN25_05B, "num_hidden_layers": args.layers}, "world": world, "tokens_per_rank": 2 * args.tokens,
              "per_rank": per_rank}
    print(f"Qwen2.5-0.5B shape ({args.layers} layers), {world} gloo ranks, fp32; bytes per rank (rank 0), FSDP / DDP:")
    print(f"{'mode':6} {'state':10} {'DDP GB':>8} {'FSDP GB':>8} {'ratio':>6}")
    r0 = per_rank[0]
    for mode in ("lora", "full"):
        d, f = r0[f"{mode}/ddp"], r0[f"{mode}/fsdp"]
        for key in ("params", "grads", "optimizer", "total"):
            ratio = f[key] / d[key] if d[key] else float("nan")
            print(f"{mode:6} {key:10} {d[key] / 2**30:8.3f} {f[key] / 2**30:8.3f} {ratio:6.3f}")
        print(f"{mode:6} {'step s':10} {d['step_s']:8.2f} {f['step_s']:8.2f} {f['step_s'] / d['step_s']:6.2f}")
        report[f"{mode}/ratio_total"] = f["total"] / d["total"]
        report[f"{mode}/ratio_step_time"] = f["step_s"] / d["step_s"]
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1) + "\n")
    return report


if __name__ == "__main__":
    main()
