"""Held-out forecast probes of a study's finished runs, after the fact: ``eval.py eval.probes=true`` on each run's
exported adapter, its reported panel and its training overrides.

Why: a run logs ``probe/*`` at every validation (``callbacks.probes``), but study4's runs (commit 74c1025, SmolLM2)
probed no chunk at all: the probe counted answers the projection read as invalid, and nearly every SmolLM2 answer
is read by it (fixed since: ``callbacks.probes.mask_projected``, false in ``experiment=smollm2_maze``). This script
measures what those probes would have said, at the end of training, on the final adapter (``csv/adapter``: kept in
the run folder, not in the committed records).

For each run: the greedy episodes of its reported panel (``data.val_offset``, ``data.val_tasks``), then the probe in
each ``--layouts`` (the CoPE arms in their own ``cope.layout``; GRPO in every layout, its baseline for each arm),
with ``callbacks.probes.mask_projected=false`` and every episode probed. One ``eval.py`` process per (run, layout):
``<run>/probe_eval/<layout>/summary.json``, reused when complete (resumable). The greedy success is printed beside
the last validation's (the same adapter and panel: they should agree).

Usage::

    OMP_NUM_THREADS=1 python -m bench.study.probes outputs/study4/smollm2/test --out bench/results/study4/forecast_probes.md
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from bench.study.markdown import write_table
from bench.study.report import run_curve

REPO = Path(__file__).resolve().parents[2]
KEEP = ("debug=", "algo=", "model", "experiment=", "env.", "cope.", "data.max_context", "data.sampling.")  # shapes the episodes


def run_overrides(run: Path) -> tuple[list[str], dict[str, str]]:
    """(the training overrides that shape the episodes and the probe, the run's ``key=value`` overrides)."""
    lines = [ln[2:].strip() for ln in (run / ".hydra" / "overrides.yaml").read_text().splitlines() if ln.startswith("- ")]
    kv = dict(ln.split("=", 1) for ln in lines if "=" in ln and not ln.startswith("~"))
    return [ln for ln in lines if ln.startswith(KEEP)], kv


def layouts_of(kv: dict[str, str], layouts: list[str]) -> list[str]:
    """A CoPE run is probed in its own layout; any other run in every layout asked for."""
    return [kv.get("cope.layout", "list")] if kv.get("algo", "").startswith("cope") else layouts


def probe(run: Path, layout: str, threads: int) -> dict:
    """The summary of ``eval.py`` with probes in ``layout`` on ``run``'s final adapter (reused when complete)."""
    out = run / "probe_eval" / layout
    summary = out / "summary.json"
    if summary.exists() and (s := json.loads(summary.read_text())).get("complete") and "probe/episodes" in s:
        return s
    keep, kv = run_overrides(run)
    count = kv.get("data.val_tasks", "64")
    args = [*keep, f"adapter={run / 'csv' / 'adapter'}", "eval.split=test", f"eval.start={kv.get('data.val_offset', '0')}",
            f"eval.count={count}", f"eval.batch_size={kv.get('data.val_batch_size', count)}", "eval.probes=true",
            "eval.progress=false", f"eval.out={out}", f"hydra.run.dir={out}", f"callbacks.probes.layout={layout}",
            "callbacks.probes.mask_projected=false", f"callbacks.probes.max_episodes={count}", "~logger"]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    done = subprocess.run([sys.executable, str(REPO / "eval.py"), *args], env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"eval.py failed on {run} ({layout}):\n{done.stderr[-3000:]}")
    return json.loads(summary.read_text())


def table(rows: list[dict]) -> str:
    """Per arm and layout: the mean over seeds (min-max) of the probe's numbers."""
    groups: dict[tuple[str, str], list[dict]] = {}
    for r in rows:
        groups.setdefault((r["arm"], r["layout"]), []).append(r)

    def cell(vals: list[float], fmt: str = ".3f") -> str:
        return f"{statistics.fmean(vals):{fmt}} ({min(vals):{fmt}}-{max(vals):{fmt}})" if len(vals) > 1 else f"{vals[0]:{fmt}}"

    out = ["| arm | probe layout | seeds | greedy success | runs whose greedy success is their last validation's "
           "| forecast action acc | forecast token acc | chunks probed | obs NLL |", "|---|---|---:|---|---:|---|---|---|---|"]
    for (arm, layout), rs in sorted(groups.items()):
        same = sum(r["last_val_success"] is not None and abs(r["success"] - r["last_val_success"]) < 1e-6 for r in rs)
        out.append(f"| {arm} | {layout} | {len(rs)} | {cell([r['success'] for r in rs])} | {same} of {len(rs)} "
                   f"| {cell([r['probe/forecast_action_acc'] for r in rs])} | {cell([r['probe/forecast_token_acc'] for r in rs])} "
                   f"| {cell([r['probe/forecast_chunks'] for r in rs], '.0f')} | {cell([r['probe/obs_nll'] for r in rs])} |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("root", type=Path, help="a study's test runs: <root>/<arm>/<setting>/seed<N> with a 'done' marker")
    p.add_argument("--layouts", nargs="+", default=["list", "turns"], choices=["list", "turns"])
    p.add_argument("--out", type=Path, required=True, help="the markdown table (a .json beside it holds every run's row)")
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)
    runs = sorted(d.parent for d in args.root.glob("*/*/seed*/done"))
    if not runs:
        p.error(f"no finished run under {args.root} (<arm>/<setting>/seed<N>/done)")
    rows = []
    for run in runs:
        if not (run / "csv" / "adapter").is_dir():
            print(f"skipped {run}: no csv/adapter (the final adapter is not in the committed records)", flush=True)
            continue
        _, kv = run_overrides(run)
        for layout in layouts_of(kv, args.layouts):
            s = probe(run, layout, args.threads)
            row = {"run": str(run.relative_to(args.root)), "arm": run.relative_to(args.root).parts[0], "layout": layout,
                   "success": s["success"], "last_val_success": run_curve(run)["final"],
                   **{k: v for k, v in s.items() if k.startswith("probe/")}}
            rows.append(row)
            print(f"{row['run']} [{layout}]: greedy success {row['success']:.3f} (last validation {row['last_val_success']}),"
                  f" forecast action acc {row['probe/forecast_action_acc']:.3f} over {row['probe/forecast_actions']:.0f}"
                  f" actions in {row['probe/forecast_chunks']:.0f} chunks", flush=True)
    head = (f"# Held-out forecast probes after training (`python -m bench.study.probes {args.root}`)\n\n"
            "Each run's final adapter, greedy on its reported panel, every episode probed; answers the projection "
            "read are probed (`callbacks.probes.mask_projected=false`). Mean over seeds (min-max).\n\n")
    write_table(args.out, rows, head, table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
