"""Sample efficiency on the maze: GRPO, EMPG, ECHO, CoPE and CoPE+ECHO, several seeds, one budget.

What it measures: for each (algo, seed) one independent ``python train.py algo=<a> seed=<s> ...``
subprocess with the SAME shared overrides (identical budget and tuning; only ``algo=`` and ``seed=``
differ), then, from each run's ``csv/learning_curve.csv`` (held-out success after every validation)
and ``csv/learning_curve_train.csv`` (rollout success after every epoch):

* episodes and env steps spent before held-out success first reached ``--threshold`` (per seed, and
  their median over seeds; a seed that never reached it counts as infinite, so the median reads
  "not reached" when half of the seeds or more never got there);
* final held-out success, mean ± std over seeds; final rollout (training) success, mean;
* area under the held-out-success-vs-episodes curve (trapezoids), divided by the episodes spent:
  the average held-out success over the run, mean over seeds (higher = learned earlier/better);
* wall time per run (around the subprocess);
* CoPE forecast targets (``forecast/targets`` from ``csv/metrics.csv``) in the first epochs, mean
  over seeds: few targets early means CoPE had few successes to learn from (cold start).

Outputs in ``--out``: one folder per run (``<algo>/seed<s>``, with a ``done`` marker holding the
wall time), ``summary.md``, ``summary.json`` and ``success_vs_episodes.png`` (mean over seeds with a
min-max band). Finished runs are skipped unless ``--force``, so an interrupted study resumes;
unfinished run folders are wiped and rerun from scratch.

Usage: ``python bench/sample_efficiency.py --overrides trainer.max_epochs=20 [--jobs 2]``.
"""
from __future__ import annotations

import argparse
import csv
import json
import math
import os
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
NAMES = {"grpo": "GRPO", "empg": "EMPG", "echo": "ECHO", "cope": "CoPE", "cope_echo": "CoPE+ECHO"}
INF = float("inf")


def finished(run: Path) -> bool:
    """Whether a run folder holds a finished run (its `done` marker and its learning curve)."""
    return (run / "done").exists() and (run / "csv/learning_curve.csv").exists()


STOPPED = 128 + signal.SIGTERM  # a run's exit status after SIGTERM (train.py: newest epoch checkpoint kept)
_LIVE: set[subprocess.Popen] = set()  # the training subprocesses running now (any thread)
_STOPPING = threading.Event()


def stop_on_sigterm() -> None:
    """Install (main thread) a SIGTERM/SIGINT handler for a launcher: every running ``train.py`` gets SIGTERM
    (it stops after its current optimizer step, keeps its newest epoch checkpoint and exits 143, so the next
    launch resumes it) and no new run starts. Without it, killing the launcher left its runs training on."""
    def handle(signum, frame):
        if not _STOPPING.is_set():
            print(f"launcher: signal {signum}: stopping {len(_LIVE)} running job(s); rerun the same command to resume",
                  file=sys.stderr, flush=True)
        _STOPPING.set()
        for proc in list(_LIVE):
            proc.send_signal(signal.SIGTERM)

    signal.signal(signal.SIGTERM, handle)
    signal.signal(signal.SIGINT, handle)


def stopping() -> bool:
    """Whether the launcher got SIGTERM/SIGINT (see :func:`stop_on_sigterm`)."""
    return _STOPPING.is_set()


def run_state(r: dict) -> str:
    """One word or phrase for a finished job's line in a launcher's log."""
    if r["skipped"]:
        return "reused"
    if r["rc"] == 0:
        return "ok"
    if r["rc"] == STOPPED:
        return "stopped by SIGTERM; resumes on the next launch"
    return f"FAILED rc={r['rc']}, see {r['dir']}/bench.log"


def train_one(algo: str, seed: int, run: Path, shared: list[str], threads: int, force: bool, resume: bool = False) -> dict:
    """Run (or reuse) one training job; returns {algo, seed, dir, wall_s, rc, skipped}.

    ``resume``: an unfinished run with a checkpoint continues from it (``ckpt_path=auto``: the same epochs,
    task stream and curve as an uninterrupted run) instead of restarting; ``wall_s`` sums its attempts."""
    if finished(run) and not force:
        return {"algo": algo, "seed": seed, "dir": str(run), "rc": 0, "skipped": True,
                "wall_s": json.loads((run / "done").read_text())["wall_s"]}
    if _STOPPING.is_set():  # the launcher is stopping: do not start another run
        return {"algo": algo, "seed": seed, "dir": str(run), "rc": STOPPED, "skipped": False, "wall_s": 0.0}
    spent = run / "attempts.json"  # wall seconds of earlier, interrupted attempts
    if resume and not force and (run / "checkpoints/last.ckpt").exists():
        earlier = json.loads(spent.read_text()) if spent.exists() else []
    else:
        shutil.rmtree(run, ignore_errors=True)  # a half-finished run restarts from scratch
        earlier = []
    run.mkdir(parents=True, exist_ok=True)
    extra = ["ckpt_path=auto"] if resume else []
    cmd = [sys.executable, str(REPO / "train.py"), f"algo={algo}", f"seed={seed}", f"hydra.run.dir={run}", *shared, *extra]
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
    t0 = time.perf_counter()
    with (run / "bench.log").open("a" if earlier else "w") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
        _LIVE.add(proc)
        if _STOPPING.is_set():  # a stop that came while this one was starting
            proc.send_signal(signal.SIGTERM)
        try:
            rc = proc.wait()
        finally:  # interrupted (the study killed): record the time this attempt spent
            _LIVE.discard(proc)
            if proc.poll() is None:
                proc.kill()
            spent.write_text(json.dumps([*earlier, time.perf_counter() - t0]))
    wall = sum(json.loads(spent.read_text()))
    if rc == 0:
        (run / "done").write_text(json.dumps({"wall_s": wall, "cmd": cmd, "attempts": len(earlier) + 1}))
    return {"algo": algo, "seed": seed, "dir": str(run), "rc": rc, "skipped": False, "wall_s": wall}


def _rows(path: Path) -> list[dict]:
    if not path.exists():
        return []
    with path.open() as f:
        return [{k: (float(v) if v not in ("", None) else None) for k, v in r.items()} for r in csv.DictReader(f)]


def _early_targets(path: Path, epochs: int) -> list[float | None]:
    """CoPE's forecast targets of epochs 0..epochs-1 from a CSVLogger metrics.csv (None where absent):
    ``forecast/samples`` (``algo=cope``, the authors' samples) or ``forecast/targets`` (``algo=cope_continuation``)."""
    out: list[float | None] = [None] * epochs
    for r in _rows(path):
        e, t = r.get("epoch"), next((r[k] for k in ("forecast/samples", "forecast/targets") if r.get(k) is not None), None)
        if e is not None and t is not None and int(e) < epochs and out[int(e)] is None:
            out[int(e)] = t
    return out


def analyse(run: dict, threshold: float, early: int) -> dict:
    d = Path(run["dir"])
    val = [r for r in _rows(d / "csv/learning_curve.csv") if r.get("val_success") is not None]
    train = _rows(d / "csv/learning_curve_train.csv")
    hit = next((r for r in val if r["val_success"] >= threshold), None)
    xs, ys = [r["episodes"] for r in val], [r["val_success"] for r in val]
    area = sum((x1 - x0) * (y0 + y1) / 2 for x0, x1, y0, y1 in zip(xs, xs[1:], ys, ys[1:]))
    span = xs[-1] - xs[0] if len(xs) > 1 else 0.0
    return {**run, "episodes_to_threshold": hit["episodes"] if hit else INF,
            "env_steps_to_threshold": hit["env_steps"] if hit else INF,
            "final_val_success": ys[-1] if ys else None, "auc": area, "auc_norm": area / span if span else None,
            "final_rollout_success": train[-1]["rollout_success"] if train else None,
            "episodes": train[-1]["episodes"] if train else None,
            "forecast_targets_early": _early_targets(d / "csv/metrics.csv", early), "curve": [xs, ys]}


def _fmt(x: float | None, spec: str = ".0f") -> str:
    return "not reached" if x == INF else ("–" if x is None else format(x, spec))


def _mean_std(xs: list) -> str:
    xs = [x for x in xs if x is not None]
    if not xs:
        return "–"
    return f"{statistics.mean(xs):.3f} ± {statistics.stdev(xs) if len(xs) > 1 else 0.0:.3f}"


def summarize(runs: list[dict], algos: list[str], threshold: float, early: int) -> tuple[dict, str]:
    table = {}
    for a in algos:
        rs = sorted((r for r in runs if r["algo"] == a), key=lambda r: r["seed"])
        if not rs:
            continue
        tg = [r["forecast_targets_early"] for r in rs]
        early_mean = [statistics.mean(v) if (v := [t[e] for t in tg if t[e] is not None]) else None for e in range(early)]
        table[a] = {"seeds": [r["seed"] for r in rs],
                    "episodes_to_threshold": [r["episodes_to_threshold"] for r in rs],
                    "env_steps_to_threshold": [r["env_steps_to_threshold"] for r in rs],
                    "median_episodes_to_threshold": statistics.median(r["episodes_to_threshold"] for r in rs),
                    "median_env_steps_to_threshold": statistics.median(r["env_steps_to_threshold"] for r in rs),
                    "final_val_success": [r["final_val_success"] for r in rs],
                    "auc_norm_mean": statistics.mean(v) if (v := [r["auc_norm"] for r in rs if r["auc_norm"] is not None]) else None,
                    "auc_mean": statistics.mean(r["auc"] for r in rs),
                    "final_rollout_success_mean": statistics.mean(v) if (v := [r["final_rollout_success"] for r in rs
                                                                              if r["final_rollout_success"] is not None]) else None,
                    "wall_s_mean": statistics.mean(r["wall_s"] for r in rs),
                    "forecast_targets_early_mean": early_mean if any(x is not None for x in early_mean) else None}
    lines = [f"| algo | seeds | episodes to {threshold:g} (median) | per seed | env steps to {threshold:g} (median) | per seed | "
             f"final val success | AUC / episodes | final rollout success | wall s / run | forecast targets, epochs 0-{early - 1} |",
             "|---|---:|---:|---|---:|---|---:|---:|---:|---:|---|"]
    for a, t in table.items():
        ft = t["forecast_targets_early_mean"]
        lines.append(" | ".join([
            f"| {NAMES.get(a, a)}", str(len(t["seeds"])), _fmt(t["median_episodes_to_threshold"]),
            ", ".join(_fmt(x) for x in t["episodes_to_threshold"]), _fmt(t["median_env_steps_to_threshold"]),
            ", ".join(_fmt(x) for x in t["env_steps_to_threshold"]), _mean_std(t["final_val_success"]),
            _fmt(t["auc_norm_mean"], ".3f"), _fmt(t["final_rollout_success_mean"], ".3f"), f"{t['wall_s_mean']:.0f}",
            " / ".join(_fmt(x, ".1f") for x in ft) if ft else "–"]) + " |")
    g = table.get("grpo", {}).get("median_episodes_to_threshold", INF)
    if g == INF:
        ratio = "episodes to threshold, relative to GRPO: n/a (GRPO did not reach the threshold)"
    else:
        ratio = "episodes to threshold, relative to GRPO: " + ", ".join(
            f"{NAMES.get(a, a)} {_fmt(t['median_episodes_to_threshold'] / g, '.2f')}" for a, t in table.items() if a != "grpo")
    return table, "\n".join([*lines, "", ratio])


def plot(runs: list[dict], algos: list[str], threshold: float, path: Path) -> None:
    import numpy as np
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 4.5), dpi=110)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    for a in algos:
        curves = [r["curve"] for r in runs if r["algo"] == a and r["curve"][0]]
        if not curves:
            continue
        grid = np.unique(np.concatenate([c[0] for c in curves]))
        grid = grid[grid <= min(c[0][-1] for c in curves)]  # where every seed has data
        ys = np.stack([np.interp(grid, c[0], c[1]) for c in curves])  # (seeds, points)
        line, = ax.plot(grid, ys.mean(0), "o-", ms=3, label=f"{NAMES.get(a, a)} (n={len(curves)})")
        ax.fill_between(grid, ys.min(0), ys.max(0), color=line.get_color(), alpha=0.15, lw=0)
    ax.axhline(threshold, color="gray", ls="--", lw=0.8, label=f"threshold {threshold:g}")
    ax.set(xlabel="episodes", ylabel="held-out success", ylim=(-0.02, 1.02),
           title="held-out success vs episodes (mean over seeds, band = min-max)")
    ax.grid(alpha=0.3)
    ax.legend(loc="upper left", fontsize=8)
    fig.savefig(path)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--algos", nargs="+", default=list(NAMES), help="algo configs (conf/algo/*.yaml)")
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    p.add_argument("--overrides", nargs="*", default=[], help="hydra overrides shared by every run, e.g. trainer.max_epochs=20")
    p.add_argument("--threshold", type=float, default=0.5, help="held-out success threshold")
    p.add_argument("--out", type=Path, default=REPO / "bench/results/sample_efficiency")
    p.add_argument("--jobs", type=int, default=1, help="training subprocesses in parallel")
    p.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS of each subprocess")
    p.add_argument("--early-epochs", type=int, default=3, help="epochs whose CoPE forecast targets are reported")
    p.add_argument("--force", action="store_true", help="rerun finished runs too")
    args = p.parse_args(argv)
    for a in args.algos:
        if not (REPO / "conf/algo" / f"{a}.yaml").exists():
            p.error(f"unknown algo {a!r} (no conf/algo/{a}.yaml)")
    if any(o.split("=")[0].lstrip("+~") in ("algo", "seed", "hydra.run.dir") for o in args.overrides):
        p.error("--overrides must not set algo, seed or hydra.run.dir (the study sets them per run)")
    out = args.out.resolve()
    # The callback's own threshold follows ours; progress bars off (logs go to files). Later overrides win.
    shared = [f"callbacks.sample_efficiency.threshold={args.threshold}", "data.progress=false", *args.overrides]
    jobs = [(a, s, out / a / f"seed{s}") for a in args.algos for s in args.seeds]
    print(f"{len(jobs)} runs ({len(args.algos)} algos x {len(args.seeds)} seeds), {args.jobs} at a time; "
          f"shared overrides: {' '.join(shared)}", flush=True)
    done: list[dict] = []

    def one(job):
        r = train_one(*job, shared, args.threads, args.force)
        done.append(r)
        state = run_state(r)
        print(f"[{len(done)}/{len(jobs)}] {r['algo']} seed {r['seed']}: {r['wall_s']:.0f} s ({state})", flush=True)
        return r

    with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        results = list(pool.map(one, jobs))
    failed = [r for r in results if r["rc"] != 0]
    for r in failed:
        tail = (Path(r["dir"]) / "bench.log").read_text().splitlines()[-15:]
        print(f"--- {r['algo']} seed {r['seed']} failed; last lines of its log:\n" + "\n".join(tail))
    runs = [analyse(r, args.threshold, args.early_epochs) for r in results if r["rc"] == 0]
    table, text = summarize(runs, args.algos, args.threshold, args.early_epochs)
    head = (f"Sample efficiency on the maze, threshold {args.threshold:g}, seeds {' '.join(map(str, args.seeds))}; "
            f"shared overrides: {' '.join(shared)}" + (f"; {len(failed)} run(s) FAILED and are left out" if failed else ""))
    text = f"{head}\n\n{text}\n"
    print("\n" + text)
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.md").write_text(text)
    js = lambda x: None if isinstance(x, float) and math.isinf(x) else x  # noqa: E731  (JSON: not reached = null)
    algos = {a: {k: ([js(x) for x in v] if isinstance(v, list) else js(v)) for k, v in t.items()} for a, t in table.items()}
    report = {"threshold": args.threshold, "shared_overrides": shared, "algos": algos,
              "runs": [{k: js(v) for k, v in r.items()} for r in runs], "failed": failed}
    (out / "summary.json").write_text(json.dumps(report, indent=1))
    plot(runs, args.algos, args.threshold, out / "success_vs_episodes.png")
    print(f"wrote {out / 'summary.md'}, {out / 'summary.json'}, {out / 'success_vs_episodes.png'}")
    if failed:
        sys.exit(1)
    return report


if __name__ == "__main__":
    main()
