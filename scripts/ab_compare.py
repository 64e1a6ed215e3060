"""Compare two A/B run folders written by scripts/ab_identity.sh: metrics rows (timing columns excepted) and the
exported adapters must be identical. Exit 1 on any difference.

    python scripts/ab_compare.py <before> <after> [run ...]   (runs: the sub-folders to compare; default: every one)"""
from __future__ import annotations

import csv
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file

TIMING = ("perf/", "grad/", "time")  # wall-clock columns, and grad/* (only where diagnostics are on)


def compare(a: Path, b: Path, run: str) -> bool:
    ra = list(csv.DictReader(open(a / run / "csv/metrics.csv")))
    rb = list(csv.DictReader(open(b / run / "csv/metrics.csv")))
    keys = sorted(k for k in set(ra[0]) | set(rb[0]) if not any(s in k for s in TIMING))
    cells = [(i, k) for i, (x, y) in enumerate(zip(ra, rb)) for k in keys if x.get(k) != y.get(k)]
    adapters = sorted((a / run / "csv").rglob("adapter_model.safetensors"))
    equal = []
    for p in adapters:
        ta, tb = load_file(p), load_file(b / run / p.relative_to(a / run))
        equal.append(ta.keys() == tb.keys() and all(torch.equal(ta[k], tb[k]) for k in ta))
    ok = len(ra) == len(rb) and not cells and bool(adapters) and all(equal)
    print(f"{run}: {len(ra)} vs {len(rb)} metrics rows, {len(keys)} keys compared, {len(cells)} differing cells "
          f"{cells[:3]}, {len(adapters)} adapters bit-identical: {all(equal) and bool(adapters)}")
    return ok


if __name__ == "__main__":
    a, b = Path(sys.argv[1]), Path(sys.argv[2])
    runs = sys.argv[3:] or sorted(p.parent.parent.name for p in a.glob("*/csv/metrics.csv"))
    sys.exit(0 if runs and all([compare(a, b, run) for run in runs]) else 1)
