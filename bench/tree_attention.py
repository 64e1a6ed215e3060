"""Seconds per forward+backward of one attention op: tree attention vs dense-masked SDPA vs the unshared sequences.

What it measures: the attention op alone (random fp32 q/k/v leaf tensors, one layer, no projections) on one
packed row of a ``--trunk``-token transcript with ``--branches`` branches of about ``--branch-len`` tokens anchored
evenly across it (the shape of CoPE's forecast samples), for two head shapes: the tiny test model (4 heads,
2 kv heads, head dim 16) and SmolLM2-135M (9 heads, 3 kv heads, head dim 64). Variants:

* ``tree``: :func:`cope.train.packing.tree_attention.tree_attention_forward` (the tiles kernel).
* ``dense``: SDPA with the layout's dense (1, 1, T, T) bool mask (today's path).
* ``unshared 1x1``: each sequence of :meth:`PrefixTree.unshared` (the trunk, then each anchor-prefix + branch)
  alone, causal SDPA, one call each; the trunk is included because the packed row computes it too.
* ``unshared padded``: the same sequences right-padded into one batch, one causal SDPA call.

Variants are interleaved (A B C D A B C D ...) after ``--warmup`` rounds so that drift hits them alike; the
median is printed with its ratio to ``dense``. Score cells: what each variant's kernel computes (causal calls
counted as triangles, masked calls as full rectangles). The tree kernel's one-off plan (index tensors, built once
per layout and shared by all layers) is timed apart, with the number of SDPA calls it makes per layer, and one
profiled tree call splits its time into SDPA kernels vs everything else (wall time under the profiler).

Usage: ``python bench/tree_attention.py [--trunk 1500] [--branches 20] [--branch-len 40] [--reps 5] [--threads 1]``.
"""
from __future__ import annotations

import argparse
import statistics
import time
import types

import torch
import torch.nn.functional as F

from cope.train.packing.prefix_tree import PrefixTree
from cope.train.packing.tree_attention import tree_attention_forward

SHAPES = {"tiny (4 heads, 2 kv, d16)": (4, 2, 16), "SmolLM2-135M (9 heads, 3 kv, d64)": (9, 3, 64)}


def make_layout(trunk: int, branches: int, branch_len: int, seed: int = 0) -> PrefixTree:
    """A ``trunk``-token root, then ``branches`` branches of branch_len +- 25% tokens anchored evenly across it."""
    g = torch.Generator().manual_seed(seed)
    nodes, start = [(0, trunk, -1, 0)], trunk
    for i in range(branches):
        size = int(branch_len * (0.75 + 0.5 * torch.rand((), generator=g).item()))
        nodes.append((start, start + size, 0, round((i + 1) * trunk / branches)))
        start += size
    return PrefixTree.from_lists([nodes])


def leaf(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, requires_grad=True)


def variants(layout: PrefixTree, heads: int, kv_heads: int, dim: int) -> dict[str, tuple[callable, int]]:
    """name -> (one forward+backward, score cells)."""
    T, gqa = layout.length, heads != kv_heads
    module = types.SimpleNamespace(num_key_value_groups=heads // kv_heads)
    q, k, v = leaf(1, heads, T, dim), leaf(1, kv_heads, T, dim), leaf(1, kv_heads, T, dim)
    mask = layout.dense_mask()  # (1, 1, T, T)
    seqs = [len(s) for s in layout.unshared()[0]]
    alone = [(leaf(1, heads, n, dim), leaf(1, kv_heads, n, dim), leaf(1, kv_heads, n, dim)) for n in seqs]
    L = max(seqs)
    padded = leaf(len(seqs), heads, L, dim), leaf(len(seqs), kv_heads, L, dim), leaf(len(seqs), kv_heads, L, dim)

    def tree():
        tree_attention_forward(module, q, k, v, None, prefix_tree=layout)[0].sum().backward()

    def dense():
        F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa).sum().backward()

    def one_by_one():
        for a, b, c in alone:
            F.scaled_dot_product_attention(a, b, c, is_causal=True, enable_gqa=gqa).sum().backward()

    def batched():
        F.scaled_dot_product_attention(*padded, is_causal=True, enable_gqa=gqa).sum().backward()

    tri = sum(n * (n + 1) // 2 for n in seqs)
    return {"tree": (tree, layout.score_cells().tree), "dense": (dense, T * T), "unshared 1x1": (one_by_one, tri),
            "unshared padded": (batched, len(seqs) * L * (L + 1) // 2)}


def run(layout: PrefixTree, heads: int, kv_heads: int, dim: int, reps: int, warmup: int) -> dict[str, float]:
    fns = variants(layout, heads, kv_heads, dim)
    times: dict[str, list[float]] = {name: [] for name in fns}
    for rep in range(warmup + reps):
        for name, (fn, _) in fns.items():
            t0 = time.perf_counter()
            fn()
            if rep >= warmup:
                times[name].append(time.perf_counter() - t0)
    med = {name: statistics.median(ts) for name, ts in times.items()}
    for name, (_, cells) in fns.items():
        print(f"  {name:16s} {med[name] * 1e3:9.2f} ms   x{med[name] / med['dense']:5.2f} of dense   "
              f"cells {cells:>10,d}  x{cells / fns['dense'][1]:5.2f}")
    kernel, wall = kernel_time(fns["tree"][0])
    print(f"  tree breakdown: {kernel * 1e3:.2f} ms in SDPA kernels (forward+backward) of {wall * 1e3:.2f} ms wall; "
          f"the rest ({(wall - kernel) / wall:.0%}) is gathers, the output scatter, autograd and Python")
    return med


def kernel_time(fn: callable) -> tuple[float, float]:
    """(seconds inside SDPA kernels, wall seconds) of one profiled call of ``fn``."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        fn()
        wall = time.perf_counter() - t0
    kernels = sum(e.self_cpu_time_total for e in prof.key_averages() if e.key.startswith("aten::_scaled_dot_product"))
    return kernels / 1e6, wall


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--trunk", type=int, default=1500)
    p.add_argument("--branches", type=int, default=20)
    p.add_argument("--branch-len", type=int, default=40)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    layout = make_layout(args.trunk, args.branches, args.branch_len)
    t0 = time.perf_counter()
    plan = layout.plan()
    tree_attention_forward(types.SimpleNamespace(), *(torch.zeros(1, 1, layout.length, 8) for _ in range(3)), None, prefix_tree=layout)
    built = time.perf_counter() - t0
    cells = layout.score_cells()
    print(f"packed row: T={layout.length} (trunk {args.trunk} + {args.branches} branches, {layout.length - args.trunk} tokens), "
          f"torch {torch.__version__}, {args.threads} thread(s)")
    print(f"tree plan: {len(plan.causal)} causal call(s) + {len(plan.groups)} tile group(s) = "
          f"{len(plan.causal) + len(plan.groups)} SDPA calls per layer; built once per layout in {built * 1e3:.1f} ms")
    print(f"score cells: tree {cells.tree:,d}, visible {cells.visible:,d}, dense {cells.dense:,d}")
    for label, (h, kv, d) in SHAPES.items():
        print(f"{label}: forward+backward, median of {args.reps}")
        run(layout, h, kv, d, args.reps, args.warmup)


if __name__ == "__main__":
    main()
