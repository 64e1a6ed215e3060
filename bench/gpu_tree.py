"""``bench/gpu_check.py --phase tree``: the tiles kernel of tree attention at Qwen2.5-7B's attention shape, with the
SDPA math kernel disabled, against the dense-mask reference.

What it runs: :func:`cope.train.packing.tree_attention.tree_attention_forward` (the tiles kernel, what training runs
on shared-prefix rows) forward + backward on one attention layer of 7B's shape (28 query heads, 4 key/value heads,
head dim 128; random bf16 q, k, v leaves, no projections) over packed rows with branches (:func:`layout`): row 0 a
CoPE-like transcript (a trunk with forecast branches anchored along it), row 1 a GRPO-like group (a prompt, then
continuations anchored at its end), row 1 shorter so its tail is padding. Everything runs inside
``torch.nn.attention.sdpa_kernel([FLASH_ATTENTION, EFFICIENT_ATTENTION])``, so a call that only the math kernel
could take raises. Each SDPA call the kernel makes is recorded with the autograd node it produced: on CUDA the
causal calls must have run on flash attention (``ScaledDotProductFlashAttentionBackward0``: grouped K/V heads,
``enable_gqa``) and the masked tile calls on the memory-efficient kernel
(``ScaledDotProductEfficientAttentionBackward0``: K/V repeated to the query heads, a boolean mask). On CPU both
kinds run on the CPU flash kernel, which takes any of them: there the check is the calls' form only, as
``tests/test_tree_attention.py`` checks it.

Reported: seconds per forward + backward (``reps`` timed after one warm-up, which also builds the kernel's plan,
timed apart), peak ``torch.cuda.max_memory_allocated`` over a timed one (inputs and their gradients included), the
calls per layer by kind and kernel, and the score cells (tree vs dense mask). Exactness on a smaller slice
(:data:`SLICE`): the output and the q, k, v gradients against SDPA with the tree's dense (N, 1, T, T) mask in fp32
(the math kernel, outside the restriction), as relative Frobenius errors, beside the same dense SDPA's own error in
bf16 for scale; the phase fails above :data:`TOLERANCE` (a wrong mask gives errors of order 1).
"""
from __future__ import annotations

import random
import time
import types
from dataclasses import dataclass

# on CUDA: which backend each kind of call must have run on (the autograd node SDPA leaves on its output)
CUDA_KERNELS = {"causal": "ScaledDotProductFlashAttentionBackward0", "masked": "ScaledDotProductEfficientAttentionBackward0"}
TOLERANCE = 3e-2  # relative Frobenius error of bf16 against fp32; bf16 rounding gives ~4e-3


class PhaseFailed(AssertionError):
    """A phase that ran but failed its checks; ``result`` holds what it measured (reported beside the error)."""

    def __init__(self, msg: str, result: dict):
        super().__init__(msg)
        self.result = result


@dataclass(frozen=True)
class TreeSizes:
    heads: int
    kv_heads: int
    dim: int
    trunk: int  # row 0: the transcript
    branches: int  # forecast branches along it, each branch_len +- 25%
    branch_len: int
    prompt: int  # row 1: the group's prompt
    continuations: int  # episodes continuing it, each cont_len +- 10%
    cont_len: int
    reps: int  # timed forward + backward passes, after one warm-up


# 7B's attention; rows of ~4.1k tokens: 3072 + 16 x ~64 (CoPE: K=3 segments of ~20-tokens actions, a 4k context) and
# 512 + 4 x ~880 (a GRPO group sharing its prompt)
GPU = TreeSizes(28, 4, 128, trunk=3072, branches=16, branch_len=64, prompt=512, continuations=4, cont_len=880, reps=3)
SLICE = TreeSizes(28, 4, 128, trunk=768, branches=6, branch_len=48, prompt=128, continuations=3, cont_len=256, reps=0)
SMOKE = TreeSizes(4, 2, 16, trunk=96, branches=4, branch_len=8, prompt=24, continuations=3, cont_len=24, reps=1)
SMOKE_SLICE = TreeSizes(4, 2, 16, trunk=48, branches=3, branch_len=6, prompt=12, continuations=2, cont_len=12, reps=0)


def layout(s: TreeSizes, seed: int = 0):
    """Two packed rows (see the module docstring) as a :class:`~cope.train.packing.prefix_tree.PrefixTree`, padded to
    the longer row; recompute off, as the 7B preset's checkpointed layers run it (``attention_kwargs``)."""
    from cope.train.packing.prefix_tree import PrefixTree

    rng = random.Random(seed)
    row0, start = [(0, s.trunk, -1, 0)], s.trunk
    for i in range(s.branches):
        size = max(1, int(s.branch_len * rng.uniform(0.75, 1.25)))
        row0.append((start, start + size, 0, round((i + 1) * s.trunk / (s.branches + 1))))
        start += size
    row1, start = [(0, s.prompt, -1, 0)], s.prompt
    for _ in range(s.continuations):
        size = max(1, int(s.cont_len * rng.uniform(0.9, 1.1)))
        row1.append((start, start + size, 0, s.prompt))
        start += size
    length = max(n[1] for n in row0 + row1) + 8  # a few padding tokens at the end of both rows
    return PrefixTree.from_lists([row0, row1], length=length).replace(recompute=False)


def _recording(calls: list):
    """F.scaled_dot_product_attention, recording each call's form and the autograd node of its output."""
    import torch.nn.functional as F

    original = F.scaled_dot_product_attention

    def sdpa(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        out = original(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale, enable_gqa=enable_gqa)
        calls.append({"kind": "causal" if attn_mask is None else "masked", "is_causal": is_causal, "gqa": enable_gqa,
                      "heads": (q.shape[1], k.shape[1], v.shape[1]), "dtypes": sorted({str(x.dtype) for x in (q, k, v)}),
                      "mask": None if attn_mask is None else str(attn_mask.dtype),
                      "kernel": type(out.grad_fn).__name__ if out.grad_fn is not None else None})
        return out

    return original, sdpa


def _leaves(tree, s: TreeSizes, device, dtype, seed: int):
    import torch

    g = torch.Generator(device="cpu").manual_seed(seed)
    N, T = len(tree.rows), tree.length
    shapes = ((N, s.heads, T, s.dim), (N, s.kv_heads, T, s.dim), (N, s.kv_heads, T, s.dim))
    return [torch.randn(sh, generator=g).to(device, dtype).requires_grad_(True) for sh in shapes]


def _tiles(tree, q, k, v, grad):
    """One forward + backward of the tiles kernel; (N, T, H, D) output."""
    from cope.train.packing.tree_attention import tree_attention_forward

    module = types.SimpleNamespace(num_key_value_groups=q.shape[1] // k.shape[1])
    out = tree_attention_forward(module, q, k, v, None, prefix_tree=tree)[0]  # (N, T, H, D)
    out.backward(grad)
    return out


def _rel(a, b) -> float:
    a, b = a.detach().float(), b.detach().float()
    return float((a - b).norm() / b.norm().clamp_min(1e-12))


def exactness(s: TreeSizes, device) -> dict:
    """The tiles kernel in bf16 (math kernel disabled) against the dense-mask SDPA in fp32 on ``s``'s layout: relative
    errors of the output and the q, k, v gradients, and the dense SDPA's own in bf16 beside them."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    tree = layout(s, seed=1)
    ref_in = _leaves(tree, s, device, torch.float32, seed=1)
    grad = torch.randn(len(tree.rows), tree.length, s.heads, s.dim, generator=torch.Generator().manual_seed(2)).to(device)
    mask = tree.dense_mask(device)  # (N, 1, T, T)

    def dense(q, k, v):
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True).transpose(1, 2)  # (N, T, H, D)
        out.backward(grad.to(out.dtype))
        return out

    ref_out = dense(*ref_in)
    bf_dense = [x.detach().to(torch.bfloat16).requires_grad_(True) for x in ref_in]
    dense_out = dense(*bf_dense)
    bf = [x.detach().to(torch.bfloat16).requires_grad_(True) for x in ref_in]
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]):
        out = _tiles(tree, *bf, grad.to(torch.bfloat16))
    errs = {"out": _rel(out, ref_out), **{f"grad_{n}": _rel(x.grad, r.grad) for n, x, r in zip("qkv", bf, ref_in)}}
    dense_errs = {"out": _rel(dense_out, ref_out), **{f"grad_{n}": _rel(x.grad, r.grad) for n, x, r in zip("qkv", bf_dense, ref_in)}}
    return {"rows": len(tree.rows), "length": tree.length, "tiles_bf16_rel_err": {k: round(v, 5) for k, v in errs.items()},
            "dense_bf16_rel_err": {k: round(v, 5) for k, v in dense_errs.items()}, "tolerance": TOLERANCE,
            "exact": all(v <= TOLERANCE for v in errs.values())}


def kernel_problems(calls: list[dict], cuda: bool) -> list[str]:
    """What is wrong with the recorded SDPA calls (none: nothing): both kinds present; causal calls unmasked and
    causal (flash's form); masked calls with K/V repeated to the query heads, a bool mask and one dtype, no
    ``enable_gqa`` (the memory-efficient kernel's form); on CUDA each kind on its kernel (:data:`CUDA_KERNELS`)."""
    kinds = {kind: [c for c in calls if c["kind"] == kind] for kind in ("causal", "masked")}
    problems = []
    if not kinds["causal"] or not kinds["masked"]:
        problems.append(f"expected both causal and masked calls, got { {k: len(v) for k, v in kinds.items()} }")
    for c in kinds["causal"]:
        if not c["is_causal"] or c["mask"] is not None:
            problems.append(f"causal call not in flash's form: {c}")
    for c in kinds["masked"]:
        if c["gqa"] or len(set(c["heads"])) != 1 or c["mask"] != "torch.bool" or len(c["dtypes"]) != 1:
            problems.append(f"masked call not in the memory-efficient kernel's form (K/V repeated, bool mask, one dtype): {c}")
    if cuda:
        for kind, want in CUDA_KERNELS.items():
            wrong = sorted({c["kernel"] for c in kinds[kind] if c["kernel"] != want}, key=str)
            if wrong:
                problems.append(f"{kind} calls ran on {wrong}, expected {want}")
    return problems


def run_tree(device, smoke: bool) -> dict:
    """The phase (see the module docstring). Raises when a call ran on an unexpected kernel or the slice is off."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    s, check = (SMOKE, SMOKE_SLICE) if smoke else (GPU, SLICE)
    cuda = device.type == "cuda"
    tree = layout(s)
    cells = tree.score_cells()
    res: dict = {"heads": s.heads, "kv_heads": s.kv_heads, "head_dim": s.dim, "dtype": "bfloat16", "rows": len(tree.rows),
                 "length": tree.length, "real_tokens": sum(n.end - n.start for r in tree.rows for n in r),
                 "nodes": [len(r) for r in tree.rows], "cells": {"tree": cells.tree, "visible": cells.visible, "dense": cells.dense},
                 "backends_allowed": ["FLASH_ATTENTION", "EFFICIENT_ATTENTION"]}
    q, k, v = _leaves(tree, s, device, torch.bfloat16, seed=0)
    grad = torch.randn(len(tree.rows), tree.length, s.heads, s.dim, generator=torch.Generator().manual_seed(3)).to(device, torch.bfloat16)
    calls: list = []
    original, recording = _recording(calls)
    F.scaled_dot_product_attention = recording  # the kernel binds F's function at each call
    times = []
    try:
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]):
            for i in range(1 + s.reps):
                for x in (q, k, v):
                    x.grad = None
                if cuda:
                    torch.cuda.synchronize(device)
                    torch.cuda.reset_peak_memory_stats(device)
                t0 = time.perf_counter()
                _tiles(tree, q, k, v, grad)
                if cuda:
                    torch.cuda.synchronize(device)
                times.append(time.perf_counter() - t0)
                if i == 0:
                    per_layer = list(calls)  # one layer's calls (one forward; recompute is off)
    finally:
        F.scaled_dot_product_attention = original
    res["first_s"] = round(times[0], 4)  # the warm-up: the plan and its index tensors built, kernels' first calls
    res["step_s_all"] = [round(t, 5) for t in times[1:]]
    res["step_s"] = round(sum(times[1:]) / len(times[1:]), 5)
    res["peak_mem_gib"] = round(torch.cuda.max_memory_allocated(device) / 2**30, 3) if cuda else None
    res["dense_probs_gib_arith"] = round(len(tree.rows) * s.heads * tree.length**2 * 4 / 2**30, 2)  # math kernel's fp32 (N, H, T, T)
    kinds = {kind: [c for c in per_layer if c["kind"] == kind] for kind in ("causal", "masked")}
    res["calls_per_layer"] = {kind: len(cs) for kind, cs in kinds.items()}
    res["kernels"] = {kind: sorted({c["kernel"] for c in cs}, key=str) for kind, cs in kinds.items()}
    res["calls_total"] = len(calls)
    problems = kernel_problems(calls, cuda)
    res["exactness"] = exactness(check, device)
    if not res["exactness"]["exact"]:
        problems.append(f"tiles kernel off the dense fp32 reference: {res['exactness']['tiles_bf16_rel_err']} > {TOLERANCE}")
    res["checks_ok"] = not problems
    if problems:
        raise PhaseFailed("tree phase: " + "; ".join(problems), res)
    return res
