"""The default demo (`make train`: GRPO on the maze, 60 epochs) over several seeds: does any seed collapse?

The demo's collapse: a fresh clone's `make train` ended with every held-out action invalid (``westwestwest...``: the
policy stopped emitting the end-of-turn id). This runs ``python train.py seed=<s>`` at the defaults for each
seed (plus ``--overrides``, the same for every seed: e.g. ``algo.objectives.pg.agg=token-mean`` for the
defaults before the fix) and reports, per seed, the held-out success at the start and at the end, the
held-out invalid-action and multi-action rates at the end, the lowest end-of-turn probability after a complete
action on the held-out panel (``stop/prob_val``) and whether the seed collapsed (every held-out action invalid
at its last validation); then the mean curve with its min-max band.

Resumable like the study: ``<out>/<name>/seed<s>`` run folders (``done`` marks a finished one; an unfinished
one continues from its epoch checkpoint), and a checkpoint-free copy of each finished run in
``bench/results/demo_seeds/runs/<name>/seed<s>`` (committed; a fresh checkout restores it instead of rerunning).
Results in ``bench/results/demo_seeds``: ``<name>.md``, ``<name>.json``, ``<name>.png``.

Usage: ``python -m bench.demo_seeds`` (five seeds one after another, 2 threads each as ``make train`` runs on 2 cores:
about 7 minutes a seed);
``--name before --overrides algo.objectives.pg.agg=token-mean``; ``--report`` rebuilds from finished runs.
"""
from __future__ import annotations

import argparse
import csv
import json
import statistics
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from bench.study import records as study_records
from bench.study.runs import finished, stop_on_sigterm, train_one

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results" / "demo_seeds"
# a collapsing seed trains to its end (what this measures); the runs recorded before the rule existed ran without it
COMMON = ("data.progress=false", "callbacks.run_health.invalid_epochs=null")


def _rows(path: Path) -> list[dict]:
    with path.open() as f:
        return list(csv.DictReader(f))


def seed_summary(run: Path, seed: int) -> dict:
    """The per-seed row of the report, from a finished run's csv/metrics.csv."""
    rows = _rows(run / "csv" / "metrics.csv")
    val = [r for r in rows if r.get("val/success")]
    by_epoch: dict[int, dict] = {}
    for r in val:  # the last row of an epoch wins (the pre-fit validation shares epoch 0 with nothing else)
        by_epoch[int(float(r["epoch"]))] = r
    if len(val) > 1 and val[0].get("epoch") == val[1].get("epoch"):
        by_epoch[-1] = val[0]  # the pre-fit validation (episode 0)
    first, last = val[0], val[-1]
    episodes = {int(float(r["epoch"])): float(r["counters/episodes"]) for r in rows if r.get("counters/episodes")}
    curve = [(0.0, float(first["val/success"]))] + [(episodes.get(e, 0.0), float(r["val/success"]))
                                                     for e, r in sorted(by_epoch.items()) if e >= 0 and r is not first]
    stop_val = [float(r["stop/prob_val"]) for r in val if r.get("stop/prob_val")]
    rollout = [r for r in rows if r.get("rollout/invalid_rate")]
    # one row per policy step: a step the trust region dropped after its epoch stopped is not forwarded, so it logs
    # train/kl_stopped but no policy/approx_kl (runs recorded before that change measured it anyway)
    steps = [r for r in rows if r.get("policy/approx_kl") or r.get("train/kl_stopped")]
    worst = max((r for r in steps if r.get("policy/approx_kl")), key=lambda r: float(r["policy/approx_kl"]))
    dropped = [int(float(r["epoch"])) for r in steps if r.get("train/kl_stopped") == "1.0"]
    return {
        "seed": seed,
        "start_success": float(first["val/success"]),
        "final_success": float(last["val/success"]),
        "final_epoch": int(float(last["epoch"])),
        "final_invalid": float(last["val/invalid_rate"]),
        "final_multi_action": float(last.get("val/multi_action") or "nan"),
        "min_stop_prob_val": min(stop_val) if stop_val else None,
        "max_rollout_invalid": max(float(r["rollout/invalid_rate"]) for r in rollout),
        "collapsed": float(last["val/invalid_rate"]) >= 1.0,
        # the policy's largest move from its sampler that a step measured, and the trust region's dropped steps
        "max_approx_kl": float(worst["policy/approx_kl"]),
        "max_approx_kl_epoch": int(float(worst["epoch"])),
        "kl_stopped_steps": len(dropped) if any("train/kl_stopped" in r for r in steps) else None,
        "kl_stopped_epochs": sorted(set(dropped)),
        "curve": curve,
    }


def report(name: str, summaries: list[dict], overrides: list[str]) -> str:
    lines = [f"# The default demo over {len(summaries)} seeds: `{name}`", "",
             f"`python train.py seed=<s> {' '.join([*COMMON, *overrides])}`", "",
             "| seed | held-out success start -> end | end: invalid | end: multi-action | min stop p (held-out) | "
             "max rollout invalid | largest measured step KL (epoch) | steps dropped (epochs) | collapsed |",
             "|---|---|---|---|---|---|---|---|---|"]
    for s in summaries:
        stop = f"{s['min_stop_prob_val']:.3f}" if s["min_stop_prob_val"] is not None else "-"
        n = s["kl_stopped_steps"]
        dropped = "- (off)" if n is None else f"{n} ({len(s['kl_stopped_epochs'])})"
        lines.append(f"| {s['seed']} | {s['start_success']:.3f} -> {s['final_success']:.3f} (epoch {s['final_epoch']}) | "
                     f"{s['final_invalid']:.3f} | {s['final_multi_action']:.3f} | {stop} | {s['max_rollout_invalid']:.3f} | "
                     f"{s['max_approx_kl']:.3f} ({s['max_approx_kl_epoch']}) | {dropped} | {'yes' if s['collapsed'] else 'no'} |")
    finals = [s["final_success"] for s in summaries]
    sd = statistics.stdev(finals) if len(finals) > 1 else 0.0
    lines += ["", f"Final held-out success: mean {statistics.mean(finals):.3f} (sd {sd:.3f}, min {min(finals):.3f}, "
              f"max {max(finals):.3f}); collapsed: {sum(s['collapsed'] for s in summaries)} of {len(summaries)}."]
    return "\n".join(lines) + "\n"


def plot(name: str, summaries: list[dict], path: Path) -> None:
    import numpy as np
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 4.2), dpi=110)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    xs = sorted({x for s in summaries for x, _ in s["curve"]})
    ys = np.array([[dict(s["curve"]).get(x, np.nan) for x in xs] for s in summaries])  # (seeds, points)
    for s in summaries:
        ax.plot(*zip(*s["curve"]), lw=0.7, alpha=0.5, label=f"seed {s['seed']}")
    ax.plot(xs, np.nanmean(ys, 0), "k-o", ms=3, lw=1.8, label=f"mean of {len(summaries)}")
    ax.fill_between(xs, np.nanmin(ys, 0), np.nanmax(ys, 0), color="k", alpha=0.1, lw=0, label="min-max")
    ax.set(xlabel="training episodes", ylabel="held-out success (64 mazes, greedy)", ylim=(-0.02, 1.02),
           title=f"make train over seeds ({name})")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="upper left")
    fig.savefig(path)


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--name", default="default")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    p.add_argument("--overrides", nargs="*", default=[])
    p.add_argument("--jobs", type=int, default=1, help="runs at once")
    p.add_argument("--threads", type=int, default=2, help="OMP_NUM_THREADS of each run (2, one at a time: as `make train` runs here)")
    p.add_argument("--out", type=Path, default=REPO / "outputs" / "demo_seeds")
    p.add_argument("--results", type=Path, default=RESULTS)
    p.add_argument("--report", action="store_true", help="only rebuild the report from finished runs")
    a = p.parse_args(argv)
    shared = [*COMMON, *a.overrides]
    runs = {s: a.out / a.name / f"seed{s}" for s in a.seeds}
    records = {s: a.results / "runs" / a.name / f"seed{s}" for s in a.seeds}
    for s, run in runs.items():
        if not finished(run):
            study_records.restore(records[s], run, [f"seed={s}", *shared])
    if not a.report:
        stop_on_sigterm()
        todo = [s for s in a.seeds if not finished(runs[s])]
        with ThreadPoolExecutor(max_workers=a.jobs) as pool:
            for r in pool.map(lambda s: train_one("grpo", s, runs[s], shared, threads=a.threads, force=False, resume=True), todo):
                print(f"seed {r['seed']}: rc {r['rc']}, {r['wall_s']:.0f} s", flush=True)
                if r["rc"] == 0:
                    study_records.save(runs[r["seed"]], records[r["seed"]], [f"seed={r['seed']}", *shared])
    summaries = [seed_summary(runs[s], s) for s in a.seeds if finished(runs[s])]
    if not summaries:
        print("no finished run", file=sys.stderr)
        return []
    a.results.mkdir(parents=True, exist_ok=True)
    text = report(a.name, summaries, a.overrides)
    (a.results / f"{a.name}.md").write_text(text)
    (a.results / f"{a.name}.json").write_text(json.dumps({"overrides": shared, "seeds": summaries}, indent=1) + "\n")
    plot(a.name, summaries, a.results / f"{a.name}.png")
    print(text)
    return summaries


if __name__ == "__main__":
    main()
