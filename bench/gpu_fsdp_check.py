"""GPU check of sharded training (``trainer=fsdp``): full fine-tuning at Qwen2.5-7B's shape, LoRA at 14B's and 32B's.

Each phase builds a randomly initialised Qwen2ForCausalLM of a real shape (no weights or tokenizer, no download) with
the 7B preset's dtype (bf16), gradient checkpointing and sdpa (``conf/model/qwen2.5-7b.yaml``), shards it as
``trainer=fsdp`` does (:func:`cope.train.sharding.shard_policy`, ``FSDPStrategy(mixed_precision="bf16").mp_policy()``:
bf16 compute, fp32 gradient reduction) on a one-process group (nccl; gloo on CPU) with a 1-device mesh (world ``W`` =
1), and runs what the trainer runs per batch on a synthetic one: the scoring pass on the gathered weights
(:attr:`Policy.full_weights`: old log-probs, then :meth:`Policy.reference`'s), then a sharded AdamW step through
``cope.train.logprobs.causal_lm_logprobs``: an advantage-weighted log-likelihood plus ``cope.algos.grpo.kl_k3`` to the
reference's log-probs (weight 0.001, the authors'), backward, the config's gradient clip, ``AdamW.step``. One warm-up
step, then ``--steps`` timed ones.

* ``full7b``: ``model.finetune=full`` at Qwen2.5-7B's shape (:data:`bench.gpu_check.QWEN25_7B`), built on the GPU;
  the KL reference is :meth:`Policy.freeze_reference`'s frozen copy, sharded in its own groups and swapped in by
  :class:`cope.train.sharding.SwappedWeights`; lr 1e-6 (``conf/experiment/cope_authors_alfworld.yaml``). **bf16
  parameters**, as ``load_pretrained`` gives them with ``model.dtype=bf16`` (full fine-tuning trains those tensors), so
  gradients and AdamW moments are bf16 too: 10 B per parameter (weights 2, reference 2, gradients 2, moments 4), 76 GB
  at 7.6B: it fits one 139 GiB H200 with room for a step. fp32 master weights (bf16 compute through the
  mixed-precision policy; ``freeze_reference`` deep-copies, so an fp32 reference) would need 20 B per parameter, 152
  GB (18 B, 137 GB, with a bf16 reference): more than one H200 before any activation, so ``W`` >= 2. bf16 weights
  also round small updates away (at lr 1e-6 an AdamW step is below half a bf16 ulp of any weight above ~5e-4):
  ``updated_fraction`` is the share of the weights the steps changed.
* ``lora14b``, ``lora32b``: LoRA (``conf/model/qwen2.5-7b.yaml``'s: r=32, alpha 64, the seven projections) at
  Qwen2.5-14B's and -32B's shapes (:data:`QWEN25_14B`, :data:`QWEN25_32B`), lr from ``conf/config.yaml``; built on the
  meta device, sharded, then materialized on the GPU (``to_empty``) at random (weights N(0, 0.02), norms 1, biases
  and ``lora_B`` 0, rotary tables recomputed). peft keeps the adapter fp32 over the bf16 base; the reference is the
  adapter switched off.

Reported per phase: ``P`` and trained ``T``; the bytes the rank holds after a step, counted as bench/fsdp_memory.py
counts them (local shards of the policy's and the reference's parameters, gradients, AdamW moments), against
docs/sharding.md's formula at ``W`` = 1 (:func:`formula`); peak ``torch.cuda.max_memory_allocated`` over each step
(sharded) and each scoring pass (a whole gathered model on top of the shards, as rollouts hold it); step and scoring
seconds, tokens/s; the KL of the policy's scored log-probs to the reference's before the first update (0) and after
each; ``updated_fraction``; and the formula per GPU at ``W`` = 1, 2, 4, 8 (arithmetic). A table, then one JSON line,
written to ``$OUT/gpu_fsdp_check.json`` (or ``--json``) after every phase. A failed phase is recorded with its error,
the others still run, the exit status is 1. ``--max-seconds`` stops timing more steps past it (one timed step at
least) and starts no phase after it.

``--smoke``: the same code on CPU at tiny shapes (2 layers, hidden 64, the same dtypes; lr 1e-3, so that bf16 weights
move in two steps) in seconds, what tests/test_gpu_fsdp_check.py runs. Runs from a bare checkout (bench/gpu_check.py's
import finder) without hydra-core or omegaconf, as the GPU image has it. On the device tool (carry nothing), one
command per phase (docs/sharding.md, "GPU check", has all three; not run on a GPU yet)::

    run(command="set -o pipefail; PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True PYTHONUNBUFFERED=1 python3 "
                "bench/gpu_fsdp_check.py --phase full7b --max-seconds 240 2>&1 | tee $OUT/gpu_fsdp_check.log", timeout_s=330)
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # `python3 bench/gpu_fsdp_check.py` from a bare checkout: bench.* importable
    sys.path.insert(0, str(REPO))
from bench import gpu_check  # noqa: E402 - also installs its import finder for the checkout's `cope` packages

QWEN25_7B = gpu_check.QWEN25_7B
# Qwen/Qwen2.5-14B's config.json, the fields that differ from 7B's (the -Instruct model has the same shape)
QWEN25_14B = {**QWEN25_7B, "hidden_size": 5120, "intermediate_size": 13824, "num_hidden_layers": 48, "num_attention_heads": 40,
              "num_key_value_heads": 8, "max_window_layers": 48, "rms_norm_eps": 1e-5}
# Qwen/Qwen2.5-32B's config.json, likewise
QWEN25_32B = {**QWEN25_14B, "intermediate_size": 27648, "num_hidden_layers": 64, "max_window_layers": 64}
KL_WEIGHT = 0.001  # the authors' KL coefficient (conf/experiment/cope_authors_alfworld.yaml)
SMOKE_LR = 1e-3
TINY = {"vocab_size": 1024, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "max_window_layers": 2, "bos_token_id": 1002, "eos_token_id": 1001}


@dataclass(frozen=True)
class Phase:
    shape: dict
    finetune: str  # "full" (every weight, the reference a frozen copy) or "lora"
    meta: bool  # built on the meta device, materialized after sharding
    rows: int = 4
    tokens: int = 4096


PHASES = {"full7b": Phase(QWEN25_7B, "full", meta=False), "lora14b": Phase(QWEN25_14B, "lora", meta=True),
          "lora32b": Phase(QWEN25_32B, "lora", meta=True, rows=2)}  # 2 rows: its scoring pass holds ~127 GiB


def log(msg: str) -> None:
    print(f"[gpu_fsdp_check {time.perf_counter() - _T0:6.1f}s] {msg}", file=sys.stderr, flush=True)


_T0 = time.perf_counter()


def formula(P: int, T: int, W: int, weight_bytes: int, trained_bytes: int, reference: bool) -> dict[str, float]:
    """docs/sharding.md's step state per rank, bytes: the policy's parameters (frozen ones in the model's dtype, trained
    ones in theirs) / W, the frozen reference / W (full fine-tuning with a KL term), T / W gradients and 2T / W AdamW
    moments in the trained tensors' dtype."""
    out = {"params": ((P - T) * weight_bytes + T * trained_bytes) / W, "reference": P * weight_bytes / W if reference else 0,
           "grads": T * trained_bytes / W, "optimizer": 2 * T * trained_bytes / W}
    out["total"] = sum(out.values())
    return out


def _local_bytes(t) -> int:
    if t is None:
        return 0
    local = t.to_local() if hasattr(t, "to_local") else t
    return local.numel() * local.element_size()


def held_bytes(policy, opt) -> dict[str, int]:
    """What this rank holds after a step: local shards of parameters, reference, gradients, AdamW moments."""
    ref = policy.reference_model
    out = {"params": sum(_local_bytes(p) for p in policy.model.parameters()),
           "reference": sum(_local_bytes(p) for p in ref.parameters()) if ref is not None else 0,
           "grads": sum(_local_bytes(p.grad) for p in policy.trainable_parameters()),
           "optimizer": sum(_local_bytes(v) for s in opt.state.values() for k, v in s.items() if k != "step")}
    out["total"] = sum(out.values())
    return out


def init_random(model, std: float) -> None:
    """Random weights for a model materialized by ``to_empty`` (each local shard on its own), rotary tables rebuilt."""
    import torch

    with torch.no_grad():
        for name, p in model.named_parameters():
            t = p.to_local() if hasattr(p, "to_local") else p
            if "lora_B" in name or name.endswith("bias"):
                t.zero_()
            elif "norm" in name:
                t.fill_(1.0)
            else:
                t.normal_(0.0, std)
        for m in model.modules():
            if hasattr(m, "inv_freq") and hasattr(m, "config"):  # non-persistent buffers: to_empty left them unset
                for n, b in type(m)(m.config).named_buffers():
                    getattr(m, n).copy_(b)


def build(phase: Phase, shape: dict, settings: dict, device, mesh):
    """The policy of ``phase``, sharded as ``cope.train.sharding.configure_sharding`` shards it."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from cope.models.policy import DTYPES, Policy
    from cope.train.sharding import FSDPStrategy, SwappedWeights, WholeWeights, shard_policy

    config = Qwen2Config(**shape)
    with torch.device("meta" if phase.meta else device):
        model = Qwen2ForCausalLM._from_config(config, dtype=DTYPES[settings["dtype"]], attn_implementation=settings["attn_implementation"])
    model.requires_grad_(phase.finetune == "full")
    if settings["gradient_checkpointing"]:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.config.use_cache = False
    if phase.finetune == "lora":
        model = get_peft_model(model, LoraConfig(**settings["lora"]))
    policy = Policy(model=model, tokenizer=None, chat=None, source="random init", finetune=phase.finetune)
    policy.freeze_reference()  # full fine-tuning: the frozen copy of the starting weights; LoRA: nothing
    mp = FSDPStrategy(mixed_precision="bf16").mp_policy()
    counts = shard_policy(policy.model, mesh, mp)
    policy.full_weights = WholeWeights(policy.model)
    if policy.reference_model is not None:
        shard_policy(policy.reference_model, mesh, mp)
        policy.reference_weights = SwappedWeights(policy.full_weights, WholeWeights(policy.reference_model))
    if phase.meta:
        policy.model.to_empty(device=device)
        init_random(policy.model, shape.get("initializer_range", 0.02))
    return policy, counts


def updated_fraction(policy) -> float:
    """Share of the trained elements the steps changed: against the frozen reference (full), from lora_B's zeros (LoRA)."""
    import torch

    changed = total = 0
    if policy.reference_model is not None:
        pairs = zip(policy.model.parameters(), policy.reference_model.parameters())
    else:
        pairs = ((p, None) for n, p in policy.model.named_parameters() if "lora_B" in n)
    for p, r in pairs:
        a = p.detach().to_local() if hasattr(p, "to_local") else p.detach()
        b = torch.zeros_like(a) if r is None else (r.to_local() if hasattr(r, "to_local") else r)
        changed += int((a != b).sum())
        total += a.numel()
    return changed / total


def scored(policy, batch: dict) -> tuple:
    """The module's scoring pass on the gathered weights: the old log-probs, then the reference's (full fine-tuning:
    the policy sharded and the frozen copy gathered, :class:`SwappedWeights`; LoRA: the adapter off). (N, T) each."""
    import torch

    from cope.train.logprobs import causal_lm_logprobs

    with torch.no_grad(), policy.full_weights():
        old = causal_lm_logprobs(policy.model, batch["ids"], batch["mask"], batch["pos"])[0]
        with policy.reference() as ref:
            return old, causal_lm_logprobs(ref, batch["ids"], batch["mask"], batch["pos"])[0]


def train_step(policy, opt, batch: dict, ref_lp, clip: float | None) -> float:
    """One optimizer step on the sharded weights (each group gathered for its forward and backward)."""
    import torch

    from cope.algos.grpo import kl_k3
    from cope.train.logprobs import causal_lm_logprobs

    opt.zero_grad(set_to_none=True)
    lp = causal_lm_logprobs(policy.model, batch["ids"], batch["mask"], batch["pos"])[0]  # (N, T)
    act = batch["act"]
    loss = -(batch["adv"][:, None] * lp * act).sum() / act.sum() + KL_WEIGHT * kl_k3(lp, ref_lp, act)[0]
    loss.backward()
    if clip is not None:
        torch.nn.utils.clip_grad_norm_(policy.trainable_parameters(), clip)
    opt.step()
    return float(loss.detach())


def run_phase(name: str, phase: Phase, args, settings: dict, device, mesh, deadline: float) -> dict:
    import torch

    from cope.algos.grpo import kl_k3
    from cope.models.policy import DTYPES
    from cope.train.sharding import parameter_counts

    shape = {**phase.shape, **TINY} if args.smoke else phase.shape
    rows, tokens = (2, 32) if args.smoke else (phase.rows, phase.tokens)
    lr = args.lr or (SMOKE_LR if args.smoke else settings["full_lr"] if phase.finetune == "full" else settings["lr"])
    t0 = time.perf_counter()
    policy, counts = build(phase, shape, settings, device, mesh)
    _sync(device)
    P, T, ref = counts["full"], sum(p.numel() for p in policy.trainable_parameters()), policy.reference_model
    res: dict = {"finetune": phase.finetune, "shape": {k: v for k, v in shape.items() if k != "rope_parameters"}, "world": 1,
                 "params": P, "trained": T, "replicated": counts["replicated"], "rows": rows, "tokens_per_row": tokens, "lr": lr,
                 "reference_replicated": parameter_counts(ref)["replicated"] if ref is not None else None,
                 "build_s": round(time.perf_counter() - t0, 2), "build_peak_gib": _gib(device)}
    if phase.finetune == "lora":
        res["trained_expected"] = gpu_check.expected_lora_params(shape, int(settings["lora"]["r"]))
    log(f"{name}: {P / 1e9:.3f}B params, {T / 1e6:.1f}M trained, built in {res['build_s']}s")
    ids = torch.randint(0, shape["vocab_size"], (rows, tokens), generator=torch.Generator().manual_seed(0)).to(device)  # (N, T)
    act = torch.arange(tokens, device=device).expand(rows, -1) >= tokens // 4  # (N, T): the scored ("action") tokens
    batch = {"ids": ids, "mask": torch.ones_like(ids), "pos": torch.arange(tokens, device=device).expand(rows, -1), "act": act,
             "adv": (torch.arange(rows, device=device) % 2 * 2 - 1).float()}  # adv (N,): +-1
    opt = torch.optim.AdamW(policy.trainable_parameters(), lr=lr, weight_decay=settings["weight_decay"])
    times, score_times, step_peaks, score_peaks, kls, losses = [], [], [], [], [], []
    for i in range(1 + args.steps):
        if i > 1 and time.perf_counter() + times[-1] + score_times[-1] > deadline:
            log(f"{name}: stopping after {len(times)} timed step(s) (--max-seconds)")
            break
        _reset(device)
        t0 = time.perf_counter()
        old, ref_lp = scored(policy, batch)
        _sync(device)
        score_s, score_peak = time.perf_counter() - t0, _gib(device)
        kls.append(float(kl_k3(old, ref_lp, act)[0]))  # the policy's scored log-probs against the reference's
        _reset(device)
        t0 = time.perf_counter()
        losses.append(train_step(policy, opt, batch, ref_lp, settings["gradient_clip_val"]))
        _sync(device)
        dt = time.perf_counter() - t0
        log(f"{name}: step {i} {'timed' if i else 'warm-up'} {dt:.2f}s (scoring {score_s:.2f}s) loss {losses[-1]:.4f} "
            f"kl {kls[-1]:.3g} peak {_gib(device)} GiB (scoring {score_peak})")
        if i:
            times.append(dt)
            score_times.append(score_s)
            step_peaks.append(_gib(device))
            score_peaks.append(score_peak)
    kls.append(float(kl_k3(*scored(policy, batch), act)[0]))  # after the last update
    wbytes = DTYPES[settings["dtype"]].itemsize  # the preset's dtype (bf16: 2), declared, not read off the tensors
    tbytes = wbytes if phase.finetune == "full" else 4  # full: the bf16 weights themselves; LoRA: peft's fp32 adapter
    held = held_bytes(policy, opt)
    want = formula(P, T, 1, wbytes, tbytes, reference=ref is not None)
    step_s = sum(times) / len(times)
    res.update(step_s_all=[round(t, 3) for t in times], step_s=round(step_s, 3), score_s=round(sum(score_times) / len(score_times), 3),
               tokens_per_s=round(rows * tokens / step_s, 1), loss=losses, finite=all(abs(x) < float("inf") for x in losses),
               kl_scored=kls, updated_fraction=updated_fraction(policy), held=held, formula={k: int(v) for k, v in want.items()},
               held_equals_formula=all(held[k] == want[k] for k in held),
               whole_model_bytes=P * wbytes,  # one gathered copy (rollouts, scoring): bf16 compute
               peak_step_gib=max(step_peaks) if device.type == "cuda" else None,
               peak_score_gib=max(score_peaks) if device.type == "cuda" else None,
               per_gpu_arithmetic={w: int(formula(P, T, w, wbytes, tbytes, ref is not None)["total"]) for w in (1, 2, 4, 8)})
    if device.type == "cuda":  # what the step and the scoring pass hold beyond the counted state
        res["step_over_state_gib"] = round(res["peak_step_gib"] - held["total"] / 2**30, 2)
        res["score_over_state_gib"] = round(res["peak_score_gib"] - held["total"] / 2**30, 2)
    del policy, opt, ref
    return res


def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _reset(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def _gib(device) -> float | None:
    import torch

    return round(torch.cuda.max_memory_allocated(device) / 2**30, 2) if device.type == "cuda" else None


def table(summary: dict) -> str:
    def f(x, spec="{:.2f}"):
        return "-" if x is None else spec.format(x)

    lines = ["| phase | P (B) | trained (M) | step s | tokens/s | score s | state GiB | formula GiB | peak step GiB | "
             "peak score GiB | KL before / after | updated |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    arith = []
    for name in PHASES:
        r = summary.get(name)
        if r is None:
            continue
        if "error" in r:
            lines.append(f"| {name} | failed: {r['error'].splitlines()[-1][:120]} |" + " |" * 10)
            continue
        lines.append(f"| {name} | {r['params'] / 1e9:.3f} | {r['trained'] / 1e6:.1f} | {r['step_s']:.3f} | {r['tokens_per_s']:,.0f} | "
                     f"{r['score_s']:.3f} | {r['held']['total'] / 2**30:.3f} | {r['formula']['total'] / 2**30:.3f} | "
                     f"{f(r['peak_step_gib'])} | {f(r['peak_score_gib'])} | {r['kl_scored'][0]:.2g} / {r['kl_scored'][-1]:.2g} | "
                     f"{r['updated_fraction']:.3g} |")
        arith.append(f"| {name} | " + " | ".join(f"{b / 2**30:.1f}" for b in r["per_gpu_arithmetic"].values())
                     + f" | {r['whole_model_bytes'] / 2**30:.1f} |")
    return "\n".join(lines + ["", "Per GPU by docs/sharding.md's formula: arithmetic, not measured (step state GiB at W ranks; "
                              "plus activations and one gathered layer; rollouts and scoring add one whole bf16 model and the KV cache):",
                              "| phase | W=1 | W=2 | W=4 | W=8 | whole model |", "|---|---|---|---|---|---|"] + arith)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--phase", nargs="+", choices=sorted(PHASES), required=True, help="one or more phases, in order")
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny shapes, seconds (the test's run)")
    ap.add_argument("--steps", type=int, default=2, help="timed steps per phase, after one warm-up")
    ap.add_argument("--lr", type=float, help="AdamW lr for every phase (default: the configs'; smoke 1e-3)")
    ap.add_argument("--max-seconds", type=float, default=420.0, help="stop timing more steps past this (after one timed step)")
    ap.add_argument("--json", type=Path, help="write the JSON here (default $OUT/gpu_fsdp_check.json when OUT is set)")
    args = ap.parse_args(argv)
    if args.steps < 1:
        ap.error("--steps must be >= 1")

    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    if not args.smoke and not torch.cuda.is_available():
        print("gpu_fsdp_check: no CUDA device (torch.cuda.is_available() is False). This script is for an NVIDIA GPU; "
              "run `python bench/gpu_fsdp_check.py --smoke --phase ...` for the CPU smoke run.", file=sys.stderr)
        return 2
    device = torch.device("cpu" if args.smoke else "cuda", None if args.smoke else 0)
    out = args.json or (Path(os.environ["OUT"]) / "gpu_fsdp_check.json" if os.environ.get("OUT") else None)
    if args.smoke:
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    else:
        torch.cuda.set_device(device)
    torch.manual_seed(0)
    deadline = _T0 + args.max_seconds

    import yaml

    settings = gpu_check.project_settings()
    authors = yaml.safe_load((REPO / "conf/experiment/cope_authors_alfworld.yaml").read_text())
    settings["full_lr"] = float(authors["module"]["optimizer"]["lr"])
    import peft
    import transformers

    import cope

    cuda = device.type == "cuda"
    summary: dict = {"smoke": args.smoke, "device": torch.cuda.get_device_name(device) if cuda else "cpu",
                     "device_gib": round(torch.cuda.get_device_properties(device).total_memory / 2**30, 1) if cuda else None,
                     "versions": {"torch": torch.__version__, "transformers": transformers.__version__, "peft": peft.__version__},
                     "cope_path": str(Path(cope.__file__).resolve().parent), "phases": args.phase, "kl_weight": KL_WEIGHT,
                     "settings": settings}
    failed = False
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("nccl" if cuda else "gloo", init_method=f"file://{tmp}/rendezvous", rank=0, world_size=1,
                                **({"device_id": device} if cuda else {}))
        try:
            mesh = init_device_mesh(device.type, (1,))
            for name in args.phase:
                log(f"{name}: start")
                try:
                    if time.perf_counter() > deadline:
                        raise TimeoutError("not started: --max-seconds had passed")
                    summary[name] = run_phase(name, PHASES[name], args, settings, device, mesh, deadline)
                except Exception as e:  # noqa: BLE001 - a failed phase is reported, the others still run
                    failed = True
                    summary[name] = {"error": "".join(traceback.format_exception_only(type(e), e)).strip()}
                    traceback.print_exc()
                gc.collect()
                if cuda:
                    torch.cuda.empty_cache()
                gpu_check.write(summary, out)  # after every phase: a run cut short keeps what it measured
        finally:
            dist.destroy_process_group()
    summary.update(imported_hydra_or_omegaconf=sorted({m.split(".")[0] for m in sys.modules} & {"hydra", "omegaconf"}),
                   total_s=round(time.perf_counter() - _T0, 1), ok=not failed)
    gpu_check.write(summary, out)
    print(table(summary), json.dumps(summary), sep="\n")
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
