"""Compare two A/B run folders written by scripts/ab_identity.sh: metrics rows (timing columns excepted) and the
exported adapters must be identical. Exit 1 on any difference."""
from __future__ import annotations

import csv
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file

TIMING = ("perf/", "grad/", "time")  # wall-clock columns, and grad/* (only where diagnostics are on)


def compare(a: Path, b: Path, algo: str) -> bool:
    ra = list(csv.DictReader(open(a / algo / "csv/metrics.csv")))
    rb = list(csv.DictReader(open(b / algo / "csv/metrics.csv")))
    keys = sorted(k for k in set(ra[0]) | set(rb[0]) if not any(s in k for s in TIMING))
    cells = [(i, k) for i, (x, y) in enumerate(zip(ra, rb)) for k in keys if x.get(k) != y.get(k)]
    adapters = sorted((a / algo / "csv").rglob("adapter_model.safetensors"))
    equal = []
    for p in adapters:
        ta, tb = load_file(p), load_file(b / algo / p.relative_to(a / algo))
        equal.append(ta.keys() == tb.keys() and all(torch.equal(ta[k], tb[k]) for k in ta))
    ok = len(ra) == len(rb) and not cells and bool(adapters) and all(equal)
    print(f"{algo}: {len(ra)} vs {len(rb)} metrics rows, {len(keys)} keys compared, {len(cells)} differing cells "
          f"{cells[:3]}, {len(adapters)} adapters bit-identical: {all(equal) and bool(adapters)}")
    return ok


if __name__ == "__main__":
    a, b = Path(sys.argv[1]), Path(sys.argv[2])
    sys.exit(0 if all([compare(a, b, algo) for algo in ("grpo", "cope", "empg")]) else 1)
