"""GPU check of sharded training (``trainer=fsdp``) on one GPU: full fine-tuning with micro-batches at Qwen2.5-1.5B's
shape and at Qwen2.5-7B's width, LoRA at 14B's and 32B's; phase by phase (docs/gpu.md: the commands in order).

**One GPU is world size 1.** Every phase runs the trainer's sharding code on a one-process group, so the per-rank
shard is the whole model: what a phase measures is the per-rank memory formula's terms at ``W`` = 1 (the state, the
micro-batches' accumulated gradient, AdamW's temporary, the activations), not a saving from sharding. What the formula
gives per GPU at ``W`` = 2, 4, 8 is printed beside it as arithmetic (bench/fsdp_memory.py measures the 1/W split with
2 CPU ranks).

Each phase builds a randomly initialised Qwen2ForCausalLM of a real shape (no weights or tokenizer, no download) with
gradient checkpointing and sdpa (``conf/model/qwen2.5-7b.yaml``) and shards it with the trainer's own code:
:func:`cope.train.fsdp.sharding.configure_sharding` on a stand-in for the LightningModule (:func:`shard`), under
``FSDPStrategy(mixed_precision="bf16")`` (bf16 compute, fp32 gradient reduction: what ``auto`` gives on CUDA; forced
here so that the CPU smoke runs it too) on a one-process group (nccl; gloo on CPU) with the 1 x 1 ("data_parallel",
"tensor_parallel") mesh Lightning's ``ModelParallelStrategy`` makes at world ``W`` = 1. Then what the trainer runs per
batch on a synthetic one: the scoring pass on the gathered weights (:attr:`Policy.full_weights`: old log-probs, then
:meth:`Policy.reference`'s), then a sharded AdamW step through ``cope.train.logprobs.causal_lm_logprobs``: an
advantage-weighted log-likelihood plus ``cope.algos.grpo.kl_k3`` to the reference's log-probs (weight 0.001, the
authors'), backward over the phase's micro-batches (all but the last under ``FSDPStrategy.block_backward_sync``, the
trainer's switch: FSDP keeps their gradients unsharded, in fp32), the config's gradient clip, ``AdamW.step``. One
warm-up step, then ``--steps`` timed ones.

Phases (:data:`PHASES` the shapes, :data:`PLAN` the card each needs and its estimated minutes; ``--phase`` picks one
or several, default ``full1.5b lora14b``; ``--list``, ``--dry-run``; a phase whose card is larger than the GPU is
refused before anything is built, reading ``torch.cuda.get_device_properties``):

* ``full1.5b`` (the 80 GB card, an H100 or an H200): ``model.finetune=full`` at Qwen2.5-1.5B's shape (:data:`QWEN25_1_5B`,
  its 28 layers, tied embeddings) with **2 micro-batches** (2 rows of 4096 tokens each): the accumulated gradient's
  peak. Reported beside the per-parameter formula: fp32 weights 4 B + fp32 gradients 4 B + AdamW moments 8 B + the
  bf16 reference copy 2 B (the frozen KL reference, stored in the compute dtype; FSDP's bf16 compute copies of the
  weights are gathered one layer group at a time and freed, so they are not a per-parameter term), plus AdamW's
  temporary (4 B) and the activations; and the gradient the first micro-batch leaves accumulated
  (``torch.cuda.memory_allocated`` after it, less before it) against 4 B per parameter, the term that stays unsharded
  at any ``W`` (docs/sharding.md).
* ``full7b`` (**the 141 GB card, an H200**: 101 GiB predicted for a step): ``model.finetune=full`` as
  ``experiment=cope_authors_alfworld`` sets it: fp32 master weights (its ``model.dtype``, which
  :func:`cope.models.policy.check_finetune` accepts), lr 1e-6, at Qwen2.5-7B's width (hidden, intermediate, heads,
  vocab: :data:`bench.gpu_check.QWEN25_7B`) with 14 of its 28 decoder layers. Built in bf16 on the GPU, then cast to
  fp32: the hub's Qwen2.5 weights are bf16, so ``load_pretrained``'s fp32 masters start bf16-exact too, and the bf16
  reference equals them bit for bit (``updated_fraction`` counts the masters that differ from it).
  ``configure_sharding`` casts the frozen reference (:meth:`Policy.freeze_reference`'s copy) to the policy's bf16
  compute dtype and shards it in groups of its own; :class:`SwappedWeights` swaps it in for scoring. Why 14 layers:
  the step state is 18 B per parameter, 127.7 GiB for the whole 7.6B model at ``W`` = 1, and a step adds AdamW's
  temporary (torch's multi-tensor AdamW holds sqrt(v) for every trained tensor at once: 4 B per parameter) and the
  activations: more than one H200. At 14 layers (4.35B parameters) :func:`predicted` gives 101 GiB for a step. The
  whole 28-layer model's arithmetic per GPU at ``W`` = 1, 2, 4, 8 is printed beside it.
* ``lora14b`` (the 80 GB card: 59 GiB predicted for its scoring pass), ``lora32b`` (**the 141 GB card, an H200**:
  129 GiB predicted for its scoring pass, a whole bf16 32B model gathered on top of its shards): LoRA
  (``conf/model/qwen2.5-7b.yaml``'s: r=32, alpha 64, the seven projections, bf16 base) at Qwen2.5-14B's and -32B's
  shapes (:data:`QWEN25_14B`, :data:`QWEN25_32B`), lr from ``conf/config.yaml``; built on the meta device, sharded,
  then materialized on the GPU (``to_empty``) at random (weights N(0, 0.02), norms 1, biases and ``lora_B`` 0, rotary
  tables recomputed). peft keeps the adapter fp32; the reference is the adapter off.

Reported per phase: ``P`` and trained ``T``; the layers built of the shape's; the bytes the rank holds after a step,
counted as bench/fsdp_memory.py counts them (local shards of the policy's and the reference's parameters, gradients,
AdamW moments), against docs/sharding.md's formula at ``W`` = 1 (:func:`formula`), and each kind's dtypes; the dtype
the scoring pass computes in (a gathered parameter's); peak ``torch.cuda.max_memory_allocated`` over each step
(sharded; per micro-batch and for the optimizer step too) and each scoring pass (a whole gathered model on top of the
shards, as rollouts hold it) beside :func:`predicted`'s; step and scoring seconds, tokens/s; the KL of the policy's
scored log-probs to the reference's before the first update (0) and after each; ``updated_fraction`` (also without
the input embeddings); and per GPU at ``W`` = 1, 2, 4, 8 the formula for the whole model the phase stands for, plus
one whole bf16 model for rollouts (arithmetic). A table, then one JSON line, written to ``$OUT/gpu_fsdp_check.json``
(or ``--json``) after every phase. A failed phase is recorded with its error, the others still run, the exit status
is 1. ``--max-seconds`` stops timing more steps past it (one timed step at least) and starts no phase after it.

``--smoke``: the same code and lrs on CPU at tiny shapes (hidden 64; 2 layers, ``full7b`` 1 of 2) in seconds, what
tests/test_gpu_fsdp_check.py runs. Runs from a bare checkout (``bench/gpu_plan.py``'s import finder) without
hydra-core or omegaconf, as the GPU image has it; nothing carried. On the device tool, the default plan (an H100 or
an H200), then the H200's phases::

    run(command="set -o pipefail; PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True PYTHONUNBUFFERED=1 python3 "
                "bench/gpu_fsdp_check.py 2>&1 | tee $OUT/gpu_fsdp_check.log", timeout_s=420)
    run(command="... bench/gpu_fsdp_check.py --phase full7b lora32b ...", kind="nvidia-h200", timeout_s=420)
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # `python3 bench/gpu_fsdp_check.py` from a bare checkout: bench.* importable
    sys.path.insert(0, str(REPO))
from bench import gpu_check  # noqa: E402 - also installs its import finder for the checkout's `cope` packages
from bench.gpu_plan import PhaseSpec, add_plan_args, check_card, plan_only, selected  # noqa: E402

QWEN25_7B = gpu_check.QWEN25_7B
# Qwen/Qwen2.5-1.5B's config.json, the fields that differ from 7B's (tied embeddings; the -Instruct model has the same shape)
QWEN25_1_5B = {**QWEN25_7B, "vocab_size": 151936, "hidden_size": 1536, "intermediate_size": 8960, "num_hidden_layers": 28,
               "num_attention_heads": 12, "num_key_value_heads": 2, "max_window_layers": 21, "tie_word_embeddings": True}
# Qwen/Qwen2.5-14B's config.json, likewise
QWEN25_14B = {**QWEN25_7B, "hidden_size": 5120, "intermediate_size": 13824, "num_hidden_layers": 48, "num_attention_heads": 40,
              "num_key_value_heads": 8, "max_window_layers": 48, "rms_norm_eps": 1e-5}
# Qwen/Qwen2.5-32B's config.json, likewise
QWEN25_32B = {**QWEN25_14B, "intermediate_size": 27648, "num_hidden_layers": 64, "max_window_layers": 64}
KL_WEIGHT = 0.001  # the authors' KL coefficient (conf/experiment/cope_authors_alfworld.yaml)
TINY = {"vocab_size": 1024, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "max_window_layers": 2, "bos_token_id": 1002, "eos_token_id": 1001}
# beyond the counted state, estimates for 16k tokens at 7B's width: a step's activations under gradient checkpointing
# (one checkpoint per layer, one layer's recompute), the root group's gathered bf16 weights and its gradients (bf16,
# then fp32 for the reduce: 8 B x 1.09B); a scoring pass's (no gradients; the head in chunks)
STEP_MARGIN_GIB, SCORE_MARGIN_GIB = 12.0, 2.0


@dataclass(frozen=True)
class Phase:
    shape: dict
    finetune: str  # "full" (every weight, the reference a frozen copy) or "lora"
    meta: bool  # built on the meta device, materialized after sharding
    rows: int = 4
    tokens: int = 4096
    layers: int | None = None  # decoder layers built, of the shape's num_hidden_layers (None: all)
    microbatches: int = 1  # the rows cut into this many forward + backward passes per optimizer step
    step_margin_gib: float = STEP_MARGIN_GIB  # a step's activations and transients beyond the counted state (estimate)


PHASES = {"full1.5b": Phase(QWEN25_1_5B, "full", meta=False, microbatches=2, step_margin_gib=6.0),  # 8k tokens a pass at hidden 1536
          "full7b": Phase(QWEN25_7B, "full", meta=False, layers=14),  # 18 B a weight: 28 layers do not fit at W = 1
          "lora14b": Phase(QWEN25_14B, "lora", meta=True),
          "lora32b": Phase(QWEN25_32B, "lora", meta=True, rows=2)}  # 2 rows: its scoring pass holds ~129 GiB

# The card each phase needs (from :func:`predicted`, checked by tests/test_gpu_fsdp_check.py) and its minutes, estimated
# (no GPU has run this yet). Time: the build (random init on the GPU, seconds; 14B/32B on the meta device, then
# materialized), one warm-up and 2 timed steps, each with its scoring pass (2 forwards: the policy's, the reference's)
# and a last scoring pass. FLOPs a token: full fine-tuning ~8 x P (forward 2, backward 4, recompute 2), LoRA ~6 x P, a
# forward 2 x P; at an assumed 300 TFLOP/s sustained bf16 (38% of the ~790 measured on both lent cards).
SETUP = PhaseSpec("setup", "imports, a one-process NCCL group", "80GB", 0.4, "~15 s of cold imports, ~5 s CUDA and NCCL init")
PLAN = {p.name: p for p in (
    PhaseSpec("full1.5b", "full fine-tuning, Qwen2.5-1.5B, 2 micro-batches: the accumulated gradient's peak vs 18 B a weight",
              "80GB", 0.6, "16k tokens x 8 x 1.54B = 0.2 PFLOP a step (<1 s), AdamW over 1.54B fp32 (~0.1 s); the build "
              "and the frozen copy ~15 s; 4 scoring passes + 3 steps ~10 s"),
    PhaseSpec("lora14b", "LoRA at Qwen2.5-14B, built on the meta device", "80GB", 0.8,
              "16k tokens x 6 x 14.8B = 1.4 PFLOP a step (4.7 s) + scoring 2 x 0.47 PFLOP (3.2 s); x 3, plus a last "
              "scoring pass and ~15 s to materialize 30 GB"),
    PhaseSpec("full7b", "full fine-tuning at Qwen2.5-7B's width, 14 of 28 layers (fp32 masters)", "141GB", 0.8,
              "16k tokens x 8 x 4.35B = 0.56 PFLOP a step (1.9 s) + scoring 0.28 PFLOP (0.9 s); x 3; the build, fp32 "
              "cast and frozen copy ~25 s", default=False),
    PhaseSpec("lora32b", "LoRA at Qwen2.5-32B, built on the meta device", "141GB", 1.0,
              "8k tokens x 6 x 32.8B = 1.6 PFLOP a step (5.4 s) + scoring 2 x 0.54 PFLOP (3.6 s); x 3, plus a last "
              "scoring pass and ~20 s to materialize 66 GB", default=False),
)}


def log(msg: str) -> None:
    print(f"[gpu_fsdp_check {time.perf_counter() - _T0:6.1f}s] {msg}", file=sys.stderr, flush=True)


_T0 = time.perf_counter()


def shapes(phase: Phase, smoke: bool) -> tuple[dict, dict]:
    """(the model the phase stands for, the one it builds): the built one has ``phase.layers`` of its decoder layers
    (the smoke's, the same share of the tiny shape's, at least 1)."""
    whole = {**phase.shape, **TINY} if smoke else dict(phase.shape)
    n = whole["num_hidden_layers"]
    if phase.layers is not None:
        n = max(1, whole["num_hidden_layers"] * phase.layers // phase.shape["num_hidden_layers"])
    return whole, {**whole, "num_hidden_layers": n, "max_window_layers": n}


def count_params(shape: dict) -> int:
    """Parameters of a Qwen2ForCausalLM of ``shape``, built on the meta device (no memory)."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    with torch.device("meta"):
        return sum(p.numel() for p in Qwen2ForCausalLM(Qwen2Config(**shape)).parameters())


def formula(P: int, T: int, W: int, frozen_bytes: int, trained_bytes: int, reference_bytes: int) -> dict[str, float]:
    """docs/sharding.md's step state per rank, bytes: the policy's parameters (frozen ones in the model's dtype, trained
    ones in theirs: fp32) / W, the frozen reference / W (full fine-tuning with a KL term: stored in the compute dtype,
    bf16), T / W gradients and 2T / W AdamW moments in the trained tensors' dtype."""
    out = {"params": ((P - T) * frozen_bytes + T * trained_bytes) / W, "reference": P * reference_bytes / W,
           "grads": T * trained_bytes / W, "optimizer": 2 * T * trained_bytes / W}
    out["total"] = sum(out.values())
    return out


def predicted(state: float, P: int, T: int, step_margin_gib: float = STEP_MARGIN_GIB) -> dict[str, float]:
    """Peak GiB at W = 1 beyond the counted ``state`` (bytes): a scoring pass holds one whole bf16 model on top of the
    shards; a step holds AdamW's temporary (sqrt of the second moments, every trained tensor at once: ``T`` x 4 B) and
    the activations. The margins are estimates (:data:`STEP_MARGIN_GIB`, a phase's ``step_margin_gib``)."""
    return {"score": round((state + 2 * P) / 2**30 + SCORE_MARGIN_GIB, 1),
            "step": round((state + 4 * T) / 2**30 + step_margin_gib, 1)}


def phase_prediction(name: str) -> dict[str, float]:
    """:func:`predicted` for the model ``name`` builds on the GPU (counted on the meta device, no memory): what
    :data:`PLAN`'s card for it rests on."""
    phase = PHASES[name]
    _, shape = shapes(phase, smoke=False)
    P = count_params(shape)
    full = phase.finetune == "full"
    T = P if full else gpu_check.expected_lora_params(shape, int(gpu_check.project_settings()["lora"]["r"]))
    P = P if full else P + T  # peft's adapter on top of the base
    state = formula(P, T, 1, 2, 4, 2 if full else 0)["total"]
    return predicted(state, P, T, phase.step_margin_gib)


def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t


def _local_bytes(t) -> int:
    return 0 if t is None else _local(t).numel() * _local(t).element_size()


def held_bytes(policy, opt) -> dict[str, int]:
    """What this rank holds after a step: local shards of parameters, reference, gradients, AdamW moments."""
    ref = policy.reference_model
    out = {"params": sum(_local_bytes(p) for p in policy.model.parameters()),
           "reference": sum(_local_bytes(p) for p in ref.parameters()) if ref is not None else 0,
           "grads": sum(_local_bytes(p.grad) for p in policy.trainable_parameters()),
           "optimizer": sum(_local_bytes(v) for s in opt.state.values() for k, v in s.items() if k != "step")}
    out["total"] = sum(out.values())
    return out


def held_dtypes(policy, opt) -> dict[str, list[str]]:
    """The dtypes of what :func:`held_bytes` counts, each kind's stored shards."""
    def names(ts) -> list[str]:
        return sorted({str(_local(t).dtype).removeprefix("torch.") for t in ts if t is not None})

    ref = policy.reference_model
    return {"params": names(policy.model.parameters()), "reference": names(ref.parameters()) if ref is not None else [],
            "grads": names(p.grad for p in policy.trainable_parameters()),
            "optimizer": names(v for s in opt.state.values() for k, v in s.items() if k != "step")}


def init_random(model, std: float) -> None:
    """Random weights for a model materialized by ``to_empty`` (each local shard on its own), rotary tables rebuilt."""
    import torch

    with torch.no_grad():
        for name, p in model.named_parameters():
            t = _local(p)
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


def shard(policy, strategy) -> None:
    """:func:`cope.train.fsdp.sharding.configure_sharding` itself, on a stand-in for the LightningModule (the attributes it
    reads): the policy sharded, its ``full_weights`` set; full fine-tuning's reference cast to the mixed-precision
    policy's param dtype, sharded in its own groups and swapped in by its ``reference_weights``."""
    from cope.train.fsdp.sharding import configure_sharding

    module = SimpleNamespace(trainer=SimpleNamespace(strategy=strategy), policy=policy, model=policy.model)
    if configure_sharding(module) is None:
        raise RuntimeError("configure_sharding did not shard: the strategy is not cope's FSDPStrategy")


def build(phase: Phase, shape: dict, settings: dict, device, strategy):
    """The policy of ``phase``, sharded by :func:`shard`."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from cope.models.policy import DTYPES, Policy, check_finetune

    config = Qwen2Config(**shape)
    with torch.device("meta" if phase.meta else device):  # bf16, as the hub's weights are; full: cast to fp32 below
        model = Qwen2ForCausalLM._from_config(config, dtype=DTYPES[settings["dtype"]], attn_implementation=settings["attn_implementation"])
    if phase.finetune == "full":
        check_finetune("full", dtype=settings["full_dtype"])  # the config check's rule: fp32 master weights
        model.to(DTYPES[settings["full_dtype"]])  # bf16-exact fp32 masters, as load_pretrained(dtype=fp32) upcasts them
    model.requires_grad_(phase.finetune == "full")
    if settings["gradient_checkpointing"]:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.config.use_cache = False
    if phase.finetune == "lora":
        model = get_peft_model(model, LoraConfig(**settings["lora"]))
    policy = Policy(model=model, tokenizer=None, chat=None, source="random init", finetune=phase.finetune)
    policy.freeze_reference()  # full fine-tuning: the frozen copy of the starting weights; LoRA: nothing
    shard(policy, strategy)
    if phase.meta:
        policy.model.to_empty(device=device)
        init_random(policy.model, shape.get("initializer_range", 0.02))
    return policy


def updated_fraction(policy) -> tuple[float, float]:
    """Share of the trained elements the steps changed, of all and of all but the input embeddings (whose rows for
    tokens absent from the batch get no gradient): the fp32 masters against the bf16 reference, which equals the
    starting masters (bf16-exact; compared in fp32) (full); lora_B against its starting zeros (LoRA)."""
    import torch

    embed = policy.model.get_input_embeddings().weight
    if policy.reference_model is not None:
        pairs = zip(policy.model.parameters(), policy.reference_model.parameters())
    else:
        pairs = ((p, None) for n, p in policy.model.named_parameters() if "lora_B" in n)
    changed, total = [0, 0], [0, 0]  # [the input embeddings, the rest]
    for p, r in pairs:
        a = _local(p.detach())
        b = torch.zeros_like(a) if r is None else _local(r)
        changed[p is not embed] += int((a != b).sum())
        total[p is not embed] += a.numel()
    return sum(changed) / sum(total), changed[1] / total[1]


def _dtypes(model) -> list[str]:
    return sorted({str(p.dtype).removeprefix("torch.") for p in model.parameters()})


def scored(policy, batch: dict, seen: dict | None = None) -> tuple:
    """The module's scoring pass on the gathered weights: the old log-probs, then the reference's (full fine-tuning:
    the policy sharded and the frozen copy gathered, :class:`SwappedWeights`; LoRA: the adapter off). (N, T) each.
    ``seen`` gets the dtypes of the gathered parameters each forward computes with."""
    import torch

    from cope.train.logprobs import causal_lm_logprobs

    seen = {} if seen is None else seen
    with torch.no_grad(), policy.full_weights():
        seen["policy"] = _dtypes(policy.model)
        old = causal_lm_logprobs(policy.model, batch["ids"], batch["mask"], batch["pos"])[0]
        with policy.reference() as ref:
            seen["reference"] = _dtypes(ref)
            return old, causal_lm_logprobs(ref, batch["ids"], batch["mask"], batch["pos"])[0]


def train_step(policy, opt, batch: dict, ref_lp, clip: float | None, strategy, microbatches: int, device) -> tuple[float, dict]:
    """One optimizer step on the sharded weights (each group gathered for its forward and backward), the rows cut into
    ``microbatches`` forward + backward passes, every one's backward but the last's under the trainer's
    ``FSDPStrategy.block_backward_sync`` (FSDP keeps their gradients unsharded, fp32, and reduce-scatters once at the
    last): the loss is the whole batch's, each micro-batch's term normalized by the whole batch's action tokens. Returns
    (loss, memory): on CUDA the peak GiB of each micro-batch and of the clip + optimizer step, and the bytes the first
    micro-batch left allocated (the accumulated gradient, when more follow); None on CPU."""
    import torch

    from cope.algos.grpo import kl_k3
    from cope.train.logprobs import causal_lm_logprobs

    opt.zero_grad(set_to_none=True)
    act = batch["act"]
    n_act = act.sum()
    parts = torch.arange(act.shape[0], device=act.device).chunk(microbatches)
    total, mem = 0.0, {"microbatch_peak_gib": [], "accumulated_bytes": None}
    for j, r in enumerate(parts):
        before = _allocated(device)
        _reset(device)
        lp = causal_lm_logprobs(policy.model, batch["ids"][r], batch["mask"][r], batch["pos"][r])[0]  # (n, T)
        a = act[r]
        loss = -(batch["adv"][r][:, None] * lp * a).sum() / n_act + KL_WEIGHT * kl_k3(lp, ref_lp[r], a)[0] * (a.sum() / n_act)
        with strategy.block_backward_sync() if j < len(parts) - 1 else contextlib.nullcontext():
            loss.backward()
        total += float(loss.detach())
        mem["microbatch_peak_gib"].append(_gib(device))
        if j == 0 and len(parts) > 1 and before is not None:
            mem["accumulated_bytes"] = _allocated(device) - before
        del lp, loss
    _reset(device)
    if clip is not None:
        torch.nn.utils.clip_grad_norm_(policy.trainable_parameters(), clip)
    opt.step()
    mem["optimizer_peak_gib"] = _gib(device)
    return total, mem


def run_phase(name: str, phase: Phase, args, settings: dict, device, strategy, deadline: float) -> dict:
    import torch

    from cope.algos.grpo import kl_k3
    from cope.train.fsdp.sharding import parameter_counts

    whole, shape = shapes(phase, args.smoke)
    rows, tokens = (2, 32) if args.smoke else (phase.rows, phase.tokens)
    full = phase.finetune == "full"
    lr = args.lr or (settings["full_lr"] if full else settings["lr"])
    t0 = time.perf_counter()
    policy = build(phase, shape, settings, device, strategy)
    _sync(device)
    counts, ref = parameter_counts(policy.model), policy.reference_model
    P, T = counts["full"], sum(p.numel() for p in policy.trainable_parameters())
    res: dict = {"finetune": phase.finetune, "shape": {k: v for k, v in shape.items() if k != "rope_parameters"}, "world": 1,
                 "layers": f"{shape['num_hidden_layers']} of {whole['num_hidden_layers']}",
                 "params": P, "trained": T, "replicated": counts["replicated"], "rows": rows, "tokens_per_row": tokens, "lr": lr,
                 "reference_replicated": parameter_counts(ref)["replicated"] if ref is not None else None,
                 "build_s": round(time.perf_counter() - t0, 2), "build_peak_gib": _gib(device)}
    if not full:
        res["trained_expected"] = gpu_check.expected_lora_params(shape, int(settings["lora"]["r"]))
    log(f"{name}: {P / 1e9:.3f}B params ({res['layers']} layers), {T / 1e6:.1f}M trained, built in {res['build_s']}s")
    ids = torch.randint(0, shape["vocab_size"], (rows, tokens), generator=torch.Generator().manual_seed(0)).to(device)  # (N, T)
    act = torch.arange(tokens, device=device).expand(rows, -1) >= tokens // 4  # (N, T): the scored ("action") tokens
    batch = {"ids": ids, "mask": torch.ones_like(ids), "pos": torch.arange(tokens, device=device).expand(rows, -1), "act": act,
             "adv": (torch.arange(rows, device=device) % 2 * 2 - 1).float()}  # adv (N,): +-1
    opt = torch.optim.AdamW(policy.trainable_parameters(), lr=lr, weight_decay=settings["weight_decay"])
    strategy.connect(policy.model)  # block_backward_sync's FSDP roots: the policy's model stands for the LightningModule
    times, score_times, step_peaks, score_peaks, kls, losses, compute, mems = [], [], [], [], [], [], {}, []
    for i in range(1 + args.steps):
        if i > 1 and time.perf_counter() + times[-1] + score_times[-1] > deadline:
            log(f"{name}: stopping after {len(times)} timed step(s) (--max-seconds)")
            break
        _reset(device)
        t0 = time.perf_counter()
        old, ref_lp = scored(policy, batch, compute)
        _sync(device)
        score_s, score_peak = time.perf_counter() - t0, _gib(device)
        kls.append(float(kl_k3(old, ref_lp, act)[0]))  # the policy's scored log-probs against the reference's
        _reset(device)
        t0 = time.perf_counter()
        loss, mem = train_step(policy, opt, batch, ref_lp, settings["gradient_clip_val"], strategy, phase.microbatches, device)
        losses.append(loss)
        _sync(device)
        dt = time.perf_counter() - t0
        log(f"{name}: step {i} {'timed' if i else 'warm-up'} {dt:.2f}s (scoring {score_s:.2f}s) loss {losses[-1]:.4f} "
            f"kl {kls[-1]:.3g} peak per micro-batch {mem['microbatch_peak_gib']}, optimizer {mem['optimizer_peak_gib']} GiB "
            f"(scoring {score_peak})")
        if i:
            times.append(dt)
            score_times.append(score_s)
            step_peaks.append(max(mem["microbatch_peak_gib"] + [mem["optimizer_peak_gib"]]) if device.type == "cuda" else None)
            score_peaks.append(score_peak)
            mems.append(mem)
    kls.append(float(kl_k3(*scored(policy, batch), act)[0]))  # after the last update
    # bytes a weight, declared (the presets' dtypes), not read off the tensors: frozen base bf16; trained fp32 (full
    # fine-tuning's masters, peft's adapter); the full reference in the bf16 compute dtype
    frozen_b, trained_b, ref_b = 2, 4, 2 if full else 0
    held, want = held_bytes(policy, opt), formula(P, T, 1, frozen_b, trained_b, ref_b)
    P_whole = P if whole == shape else count_params(whole)  # the model the phase stands for (full7b: all 28 layers)
    T_whole = P_whole if full else T
    step_s = sum(times) / len(times)
    res["updated_fraction"], res["updated_fraction_except_embeddings"] = updated_fraction(policy)
    res.update(step_s_all=[round(t, 3) for t in times], step_s=round(step_s, 3), score_s=round(sum(score_times) / len(score_times), 3),
               tokens_per_s=round(rows * tokens / step_s, 1), loss=losses, finite=all(abs(x) < float("inf") for x in losses),
               kl_scored=kls, held=held, dtypes=held_dtypes(policy, opt),
               compute_dtypes=compute, formula={k: int(v) for k, v in want.items()},
               held_equals_formula=all(held[k] == want[k] for k in held),
               predicted_gib=predicted(want["total"], P, T, phase.step_margin_gib), microbatches=phase.microbatches,
               microbatch_peak_gib=mems[-1]["microbatch_peak_gib"] if device.type == "cuda" else None,
               optimizer_peak_gib=mems[-1]["optimizer_peak_gib"] if device.type == "cuda" else None,
               peak_step_gib=max(step_peaks) if device.type == "cuda" else None,
               peak_score_gib=max(score_peaks) if device.type == "cuda" else None,
               per_gpu_arithmetic={"params": P_whole, "layers": whole["num_hidden_layers"], "whole_bf16_model": 2 * P_whole,
                                   "step_state": {w: int(formula(P_whole, T_whole, w, frozen_b, trained_b, ref_b)["total"])
                                                  for w in (1, 2, 4, 8)}})
    if phase.microbatches > 1:  # the gradient accumulated over the micro-batches: fp32 (FSDP's reduce dtype), unsharded
        res["accumulated_grad_formula_gib"] = round(trained_b * T / 2**30, 3)
        acc = mems[-1]["accumulated_bytes"]
        res["accumulated_grad_gib"] = round(acc / 2**30, 3) if acc is not None else None
    if device.type == "cuda":  # what the step and the scoring pass hold beyond the counted state
        res["step_over_state_gib"] = round(res["peak_step_gib"] - held["total"] / 2**30, 2)
        res["score_over_state_gib"] = round(res["peak_score_gib"] - held["total"] / 2**30, 2)
        # the step's peak less the state and AdamW's temporary (4 B x T): the activations and transients
        res["activations_gib"] = round(res["peak_step_gib"] - (held["total"] + 4 * T) / 2**30, 2)
    strategy.connect(None)
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


def _allocated(device) -> int | None:
    import torch

    return torch.cuda.memory_allocated(device) if device.type == "cuda" else None


def _gib(device) -> float | None:
    import torch

    return round(torch.cuda.max_memory_allocated(device) / 2**30, 2) if device.type == "cuda" else None


def table(summary: dict) -> str:
    def f(x, spec="{:.2f}"):
        return "-" if x is None else spec.format(x)

    lines = ["| phase | layers | P (B) | trained (M) | step s | tokens/s | score s | state GiB | formula GiB | peak step GiB "
             "(predicted) | peak score GiB (predicted) | KL before / after | updated (except embeddings) |",
             "|---" * 13 + "|"]
    arith, notes = [], []
    for name in PHASES:
        r = summary.get(name)
        if r is None:
            continue
        if "error" in r:
            lines.append(f"| {name} | failed: {r['error'].splitlines()[-1][:120]} |" + " |" * 11)
            continue
        pred = r["predicted_gib"]
        lines.append(f"| {name} | {r['layers']} | {r['params'] / 1e9:.3f} | {r['trained'] / 1e6:.1f} | {r['step_s']:.3f} | "
                     f"{r['tokens_per_s']:,.0f} | {r['score_s']:.3f} | {r['held']['total'] / 2**30:.3f} | "
                     f"{r['formula']['total'] / 2**30:.3f} | {f(r['peak_step_gib'])} ({pred['step']}) | "
                     f"{f(r['peak_score_gib'])} ({pred['score']}) | {r['kl_scored'][0]:.2g} / {r['kl_scored'][-1]:.2g} | "
                     f"{r['updated_fraction']:.3g} ({r['updated_fraction_except_embeddings']:.3g}) |")
        if r.get("microbatches", 1) > 1:
            notes.append(f"{name}: {r['microbatches']} micro-batches; the gradient the first left accumulated (fp32, unsharded): "
                         f"{f(r['accumulated_grad_gib'], '{:.3f}')} GiB measured, {r['accumulated_grad_formula_gib']:.3f} GiB by "
                         f"the formula (4 B x {r['trained'] / 1e9:.3f}B); peaks per micro-batch {r['microbatch_peak_gib']}, "
                         f"optimizer step {r['optimizer_peak_gib']} GiB")
        if r["finetune"] == "full":
            P = r["params"]
            notes.append(f"{name}: W = 1 (one GPU: the shard is the whole model). Formula per parameter: fp32 weights 4 B + "
                         f"fp32 gradients 4 B + AdamW 8 B + bf16 reference 2 B = 18 B x {P / 1e9:.3f}B = {18 * P / 2**30:.2f} GiB "
                         f"(held: {r['held']['total'] / 2**30:.2f}); + AdamW's temporary 4 B = {22 * P / 2**30:.2f} GiB; peak step "
                         f"{f(r['peak_step_gib'])} GiB, so activations and transients {f(r.get('activations_gib'))} GiB")
        a = r["per_gpu_arithmetic"]
        arith.append(f"| {name} | {a['layers']} | {a['params'] / 1e9:.3f} | " + " | ".join(
            f"{s / 2**30:.1f} ({(s + a['whole_bf16_model']) / 2**30:.1f})" for s in a["step_state"].values()) + " |")
    return "\n".join(lines + [""] + notes + [
                              "", "Per GPU for the whole model each phase stands for, by docs/sharding.md's formula: arithmetic, "
                              "not measured. Step state GiB at W ranks (with one whole bf16 model gathered for rollouts and "
                              "scoring); activations, AdamW's temporary and the KV cache come on top:",
                              "| phase | layers | P (B) | W=1 | W=2 | W=4 | W=8 |", "|---" * 7 + "|"] + arith)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    add_plan_args(ap, PLAN)
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny shapes, seconds (the test's run)")
    ap.add_argument("--steps", type=int, default=2, help="timed steps per phase, after one warm-up")
    ap.add_argument("--lr", type=float, help="AdamW lr for every phase (default: the configs': full 1e-6, LoRA 1e-3)")
    ap.add_argument("--max-seconds", type=float, default=330.0,
                    help="no phase starts past this, and no more steps are timed past it (after one timed step)")
    ap.add_argument("--json", type=Path, help="write the JSON here (default $OUT/gpu_fsdp_check.json when OUT is set)")
    args = ap.parse_args(argv)
    if args.steps < 1:
        ap.error("--steps must be >= 1")
    names = selected(args, PLAN)
    if plan_only(args, "gpu_fsdp_check", PLAN, SETUP):
        return 0

    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    if not args.smoke and not torch.cuda.is_available():
        print("gpu_fsdp_check: no CUDA device (torch.cuda.is_available() is False). This script is for an NVIDIA GPU; "
              "run `python bench/gpu_fsdp_check.py --smoke [--phase ...]` for the CPU smoke run, `--dry-run` for the plan.",
              file=sys.stderr)
        return 2
    if not args.smoke and (refused := check_card("gpu_fsdp_check", PLAN, names)) is not None:
        return refused
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
    settings["full_dtype"] = authors["model"]["dtype"]
    import peft
    import transformers

    import cope
    from cope.train.fsdp.strategy import FSDPStrategy

    cuda = device.type == "cuda"
    summary: dict = {"smoke": args.smoke, "device": torch.cuda.get_device_name(device) if cuda else "cpu",
                     "device_gib": round(torch.cuda.get_device_properties(device).total_memory / 2**30, 1) if cuda else None,
                     "versions": {"torch": torch.__version__, "transformers": transformers.__version__, "peft": peft.__version__},
                     "cope_path": str(Path(cope.__file__).resolve().parent), "phases": names, "kl_weight": KL_WEIGHT,
                     "mixed_precision": "bf16", "settings": settings}
    failed = False
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("nccl" if cuda else "gloo", init_method=f"file://{tmp}/rendezvous", rank=0, world_size=1,
                                **({"device_id": device} if cuda else {}))
        try:
            strategy = FSDPStrategy(mixed_precision="bf16")  # = "auto" on CUDA; forced so that the CPU smoke runs it too
            # the mesh ModelParallelStrategy.setup_environment makes (lightning's _setup_device_mesh) at W = 1
            strategy._device_mesh = init_device_mesh(device.type, (1, 1), mesh_dim_names=("data_parallel", "tensor_parallel"))
            for name in names:
                log(f"{name}: start (estimate {PLAN[name].minutes} min on {PLAN[name].card})")
                try:
                    if time.perf_counter() > deadline:
                        raise TimeoutError("not started: --max-seconds had passed")
                    summary[name] = run_phase(name, PHASES[name], args, settings, device, strategy, deadline)
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
