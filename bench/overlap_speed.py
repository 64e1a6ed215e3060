"""Epoch wall time of one training run at ``data.max_lag`` 0, 1, 2, side by side in one invocation.

Each configuration is a real ``python train.py`` run (its own process, ``OMP_NUM_THREADS`` fixed) of the same
settings and seed, only ``data.max_lag`` differing. The runs go round-robin: round r runs every lag once, the order
rotated by r, so a load that drifts over the invocation falls on every lag alike. Per epoch the run logs
``bench/epoch_wall_seconds`` (:func:`epoch_clock`: from the previous epoch's end to this one's, validation excluded),
next to the trainer's own ``perf/rollout_seconds`` (the collection's duration), ``perf/rollout_wait_seconds`` (how
long training waited for it; lag >= 1), ``perf/epoch_seconds`` (the optimizer part) and ``perf/env_seconds``.

Reported per lag (:func:`summarize`): medians over the **steady epochs**, the same window for every lag: epoch 0
dropped (setup, and with lag the pipeline filling: the first collection is waited for whole) and the last max(lags)
epochs dropped (with lag L the last L epochs queue no collection, so they train alone: the pipeline draining). Also
the ratio of each lag's median epoch to lag 0's, episodes trained per second in the window and over the whole fit.

Two engine setups (:func:`engine_overrides`):

* ``hf``: the in-process engine, envs in ``--workers`` worker processes, the env :class:`SlowMaze` (the maze whose
  step and reset sleep ``--step-seconds``, only inside env workers), so that environment time can overlap training.
  Generation and training share the trainer's cores.
* ``vllm``: a managed vLLM CPU server (``rollout=vllm data.engine.max_loras=2``), pinned to ``--server-cores``
  (``data.engine.threads``), the trainer at ``OMP_NUM_THREADS=--threads``: the cores split between the two.

Then a **projection** (:func:`projection`), a model and not a measurement: from lag 0's rollout seconds R and the
rest of its epoch T, "sync epoch = R + T, lagged epoch = max(R, T) + s" (s: the lagged run's adapter sync seconds),
for this machine's R/T and for stated R/T ratios.

Usage: ``python -m bench.overlap_speed --engine hf|vllm [--lags 0 1 2] [--epochs 6] [--rounds 1]
[--overrides ...]``; results in ``bench/results/overlap_speed/<engine>.json`` and ``.md``.
"""
from __future__ import annotations

import argparse
import csv
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from cope.envs.maze import MazeEnv

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results" / "overlap_speed"
WALL = "bench/epoch_wall_seconds"
KEYS = (WALL, "perf/rollout_seconds", "perf/rollout_wait_seconds", "perf/epoch_seconds", "perf/env_seconds",
        "perf/adapter_sync_seconds", "rollout/lag_mean", "rollout/lag_max", "counters/episodes", "step")
# R/T ratios of the projection. verl reports +23-40% for one-step-off overlap (SOURCES), which this model gives at R/T
# of about 2.5-4.3 (rollout-bound) or 0.23-0.40 (training-bound).
RATIOS = (0.25, 0.5, 1.0, 2.0, 4.0)
# where the gains quoted beside the projection were published
SOURCES = ("verl's one-step-off and fully async recipes, https://verl.readthedocs.io/en/latest/advance/one_step_off.html "
           "and https://verl.readthedocs.io/en/latest/advance/fully_async.html; AReaL, arXiv 2505.24298; ROLL Flash, "
           "arXiv 2510.11345")
# debug=fast's sizes (8 episodes of <= 8 steps an epoch) with the tiny model's widths (hidden 128, 4 layers; vLLM CPU
# serves no head size 16) and 8 optimizer steps an epoch (minibatches of 2, two passes), so that training takes a
# share of the epoch comparable to the rollouts; no trust region, so that every epoch at every lag takes all 8 steps
# (stale batches stop an epoch's steps at another point than fresh ones: less work, not more speed)
SIZES = ("debug=fast", "model.hidden_size=128", "model.num_layers=4", "model.num_heads=4", "data.minibatch_size=2",
         "data.ppo_epochs=2", "module.max_approx_kl=null")
COMMON = ("validate_before_fit=false", "trainer.check_val_every_n_epoch=1000", "data.progress=false",
          "+callbacks.epoch_clock._target_=bench.overlap_speed.EpochClock")


class SlowMaze(MazeEnv):
    """The maze whose every step and reset first sleeps ``step_seconds`` / ``reset_seconds`` inside an env worker
    process (``COPE_ENV_WORKER`` set), as an env whose calls wait on something (a sandbox, a game engine, a remote
    service). In the trainer's own process (the tiny model's warm start, probes) it is the plain maze. A sleep, not a
    busy loop: it holds no core, so it stands for latency, not for an env that burns CPU."""

    def __init__(self, step_seconds: float = 0.05, reset_seconds: float = 0.0, sizes: Sequence[int] = (6, 7, 8),
                 wall_density: float = 0.25, max_steps: int = 20, min_distance: int = 3, num_train_tasks: int = 100_000,
                 num_test_tasks: int = 1_000, name: str = "maze", compass: bool = True, action_parsing: str = "strict"):
        # MazeEnv's keys written out (not **kwargs), so that the config check refuses a mistyped one by name
        super().__init__(sizes=sizes, wall_density=wall_density, max_steps=max_steps, min_distance=min_distance,
                         num_train_tasks=num_train_tasks, num_test_tasks=num_test_tasks, name=name, compass=compass,
                         action_parsing=action_parsing)
        if step_seconds < 0 or reset_seconds < 0:
            raise ValueError(f"step_seconds and reset_seconds must be >= 0, got {step_seconds}, {reset_seconds}")
        active = os.environ.get("COPE_ENV_WORKER") == "1"
        self.step_seconds, self.reset_seconds = (step_seconds, reset_seconds) if active else (0.0, 0.0)

    def reset(self, task):
        time.sleep(self.reset_seconds)
        return super().reset(task)

    def step(self, action):
        time.sleep(self.step_seconds)
        return super().step(action)


def epoch_clock():
    """The callback class behind ``callbacks.epoch_clock`` (``EpochClock``): logs ``bench/epoch_wall_seconds``, the
    wall seconds from the previous training epoch's end (for epoch 0: the fit's start, after setup, before its first
    rollouts) to this one's, validation inside the fit excluded. Every per-epoch step (rollouts or the wait for them,
    scoring, the optimizer, the checkpoint) falls into exactly one interval, whatever the callbacks' order. Built on
    first use, so that env workers unpickling :class:`SlowMaze` from this module do not import Lightning."""
    from lightning.pytorch import Callback

    class EpochClock(Callback):
        def __init__(self):
            self._last, self._paused, self._val_start = 0.0, 0.0, None

        def on_fit_start(self, trainer, pl_module) -> None:  # after setup (a managed server started), before epoch 0's rollouts
            self._last, self._paused = time.perf_counter(), 0.0

        def on_validation_start(self, trainer, pl_module) -> None:
            if trainer.state.fn == "fit":  # the sanity check included
                self._val_start = time.perf_counter()

        def on_validation_end(self, trainer, pl_module) -> None:
            if self._val_start is not None:
                self._paused += time.perf_counter() - self._val_start
                self._val_start = None

        def on_train_epoch_end(self, trainer, pl_module) -> None:
            now = time.perf_counter()
            pl_module.log(WALL, now - self._last - self._paused, on_step=False, on_epoch=True, batch_size=1)
            self._last, self._paused = now, 0.0

    return EpochClock


def __getattr__(name: str):  # `bench.overlap_speed.EpochClock`, the config's _target_
    if name == "EpochClock":
        return epoch_clock()
    raise AttributeError(name)


def engine_overrides(engine: str, workers: int, step_seconds: float, server_cores: str) -> list[str]:
    """The overrides that set up an engine (the same for every lag)."""
    if engine == "hf":
        return ["env._target_=bench.overlap_speed.SlowMaze", f"+env.step_seconds={step_seconds}",
                f"data.env_runtime.workers={workers}"]
    if engine == "vllm":
        return ["rollout=vllm", "data.engine.max_loras=2", f"data.engine.threads='{server_cores}'"]
    raise ValueError(f"--engine: hf or vllm, got {engine!r}")


def plan(lags: list[int], rounds: int) -> list[tuple[int, int]]:
    """(round, lag) in run order: every lag once a round, the order rotated by the round."""
    return [(r, lags[(r + i) % len(lags)]) for r in range(rounds) for i in range(len(lags))]


def run_one(run: Path, overrides: list[str], threads: int, timeout: float) -> dict:
    """``python train.py <overrides>`` into the folder ``run`` (started over; the log ``bench.log``), with ``threads``
    OMP threads and this checkout on PYTHONPATH (the trainer and env workers import this module); its folder, return
    code (124: past ``timeout``), wall seconds, command and the 1-minute load average at its end, also written to
    ``<run>/bench.json``."""
    shutil.rmtree(run, ignore_errors=True)
    run.mkdir(parents=True)
    cmd = [sys.executable, str(REPO / "train.py"), f"hydra.run.dir={run}", *overrides]
    full = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads),
            "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    t0 = time.perf_counter()
    with (run / "bench.log").open("w") as log:
        try:
            rc = subprocess.run(cmd, cwd=REPO, env=full, stdout=log, stderr=subprocess.STDOUT, timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            rc = 124
    result = {"dir": str(run), "rc": rc, "wall_s": round(time.perf_counter() - t0, 2), "cmd": cmd, "loadavg_1min": os.getloadavg()[0]}
    (run / "bench.json").write_text(json.dumps(result) + "\n")  # what --report reads back
    return result


def epoch_table(metrics_csv: Path) -> list[dict[str, float]]:
    """One dict per training epoch of a run's ``csv/metrics.csv``: the last non-empty value of each of :data:`KEYS`
    logged with that epoch, plus ``episodes`` (this epoch's, from the cumulative counter) and ``steps`` (its optimizer
    steps, from the logged step)."""
    with Path(metrics_csv).open(newline="") as f:
        rows = list(csv.DictReader(f))
    by_epoch: dict[int, dict[str, float]] = {}
    for r in rows:
        if r.get("epoch") in (None, ""):
            continue
        e = int(float(r["epoch"]))
        for k in KEYS:
            if r.get(k) not in (None, ""):
                by_epoch.setdefault(e, {})[k] = float(r[k])
    out, before, step = [], 0.0, -1.0
    for e in sorted(k for k in by_epoch if WALL in by_epoch[k]):
        m = {"epoch": float(e), **by_epoch[e]}
        m["episodes"] = m.get("counters/episodes", before) - before
        m["steps"] = m.get("step", step) - step  # optimizer steps (the logged step is the last one's index)
        before, step = m.get("counters/episodes", before), m.get("step", step)
        out.append(m)
    return out


def _median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def summarize(runs: dict[int, list[list[dict[str, float]]]], drop_first: int = 1, drop_last: int | None = None) -> dict:
    """Per lag (``runs[lag]``: each round's :func:`epoch_table`): medians over the steady epochs, pooled over rounds
    (epochs ``drop_first`` .. n - 1 - ``drop_last``; ``drop_last`` default max(lags)), ratios to lag 0 (or to the
    smallest lag), episodes per second in the window and over the whole fit."""
    drop_last = max(runs) if drop_last is None else drop_last
    rows = {}
    for lag, tables in sorted(runs.items()):
        steady = [m for t in tables for m in t[drop_first: len(t) - drop_last]]
        every = [m for t in tables for m in t]
        col = lambda k, ms=steady: [m[k] for m in ms if k in m]  # noqa: E731
        wall = _median(col(WALL))
        rows[lag] = {"steady_epochs": len(steady), "epoch_s": wall, "rollout_s": _median(col("perf/rollout_seconds")),
                     "wait_s": _median(col("perf/rollout_wait_seconds")), "train_s": _median(col("perf/epoch_seconds")),
                     "env_s": _median(col("perf/env_seconds")), "sync_s": _median(col("perf/adapter_sync_seconds")),
                     "lag_mean": _median(col("rollout/lag_mean")), "steps": _median(col("steps")),
                     "episodes_per_s": sum(col("episodes")) / sum(col(WALL)) if steady else None,
                     "episodes_per_s_fit": sum(col("episodes", every)) / sum(col(WALL, every)) if every else None}
    base = rows[min(rows)]["epoch_s"]
    for r in rows.values():
        r["ratio"] = r["epoch_s"] / base if r["epoch_s"] and base else None
        r["speedup"] = base / r["epoch_s"] if r["epoch_s"] and base else None
    return rows


def projection(rollout_s: float, rest_s: float, sync_s: float = 0.0, ratios=RATIOS) -> dict:
    """The model "sync epoch = R + T, lagged epoch = max(R, T) + s" (any lag >= 1 in steady state): this machine's
    R (lag 0's rollout seconds) and T (the rest of lag 0's epoch), then each R/T of ``ratios`` at T = 1, with ``s``
    as a share of this machine's T. A model, not a measurement."""
    def row(r: float, t: float, s: float) -> dict:
        return {"R_over_T": r / t, "sync": r + t, "lagged": max(r, t) + s, "speedup": (r + t) / (max(r, t) + s)}

    here = row(rollout_s, rest_s, sync_s)
    return {"here": {**here, "R": rollout_s, "T": rest_s, "s": sync_s},
            "ratios": [row(x, 1.0, sync_s / rest_s if rest_s else 0.0) for x in ratios]}


def _f(x, spec="{:.2f}") -> str:
    return "-" if x is None else spec.format(x)


def render(result: dict) -> str:
    s, p = result["summary"], result["projection"]
    lines = [f"# Overlapped rollouts: epoch wall time by data.max_lag ({result['engine']})", "",
             f"{result['caveat']}", "",
             "| max_lag | steady epochs | epoch s (median) | vs lag 0 | rollout s | wait s | train s | env s | steps | lag mean | "
             "episodes/s (steady) | episodes/s (whole fit) |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for lag, r in sorted(s.items(), key=lambda kv: int(kv[0])):
        lines.append(f"| {lag} | {r['steady_epochs']} | {_f(r['epoch_s'])} | {_f(r['ratio'], '{:.2f}x')} | {_f(r['rollout_s'])} | "
                     f"{_f(r['wait_s'])} | {_f(r['train_s'])} | {_f(r['env_s'])} | {_f(r['steps'], '{:.0f}')} | {_f(r['lag_mean'])} | "
                     f"{_f(r['episodes_per_s'], '{:.3f}')} | {_f(r['episodes_per_s_fit'], '{:.3f}')} |")
    h = p["here"]
    lines += ["", "## Projection (a model, not a measurement)", "",
              "sync epoch = R + T, lagged epoch = max(R, T) + s, for any lag >= 1 in steady state (a larger lag only absorbs "
              "epoch-to-epoch variation). R: lag 0's rollout seconds; T: the rest of lag 0's epoch (scoring, optimizer, "
              "checkpoint); s: the lagged run's adapter sync seconds.", "",
              f"This machine: R = {h['R']:.2f} s, T = {h['T']:.2f} s (R/T = {h['R_over_T']:.2f}), s = {h['s']:.2f} s: "
              f"model {h['sync']:.2f} s -> {h['lagged']:.2f} s, {h['speedup']:.2f}x. Measured: the table. The model assumes the "
              "two sides do not slow each other; here they share cores with each other and with other jobs.", "",
              "| R/T | sync epoch (T = 1) | lagged epoch | speedup |", "|---|---|---|---|"]
    for r in p["ratios"]:
        lines.append(f"| {r['R_over_T']:.2f} | {r['sync']:.2f} | {r['lagged']:.2f} | {r['speedup']:.2f}x |")
    lines += ["", "R/T on a GPU node is not measured here. For scale: verl reports +23-40% from one-step-off overlap, "
              "which this model gives at R/T of about 2.5-4.3 (or 0.23-0.40); its fully asynchronous 2.35-2.67x at 128 GPUs "
              "(AReaL up to 2.77x) exceeds the model's bound of 2x, because those systems also give generation its own GPUs "
              f"(sources: {SOURCES}).", "",
              f"Settings: {' '.join(result['overrides'])}; OMP_NUM_THREADS={result['threads']}; {result['rounds']} round(s), "
              f"{result['epochs']} epochs per run, order {result['order']}."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engine", choices=("hf", "vllm"), default="hf")
    ap.add_argument("--lags", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--epochs", type=int, default=6)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--threads", type=int, default=1, help="the trainer's OMP_NUM_THREADS")
    ap.add_argument("--workers", type=int, default=2, help="hf: env worker processes")
    ap.add_argument("--step-seconds", type=float, default=0.05, help="hf: SlowMaze's sleep per env step")
    ap.add_argument("--server-cores", default="1", help="vllm: the server's cores (data.engine.threads)")
    ap.add_argument("--overrides", nargs="*", default=list(SIZES),
                    help="train.py overrides shared by every run (default: SIZES)")
    ap.add_argument("--timeout", type=float, default=900, help="seconds per run")
    ap.add_argument("--workdir", type=Path, default=REPO / "outputs" / "overlap_speed")
    ap.add_argument("--out", type=Path, default=None, help="results stem (default bench/results/overlap_speed/<engine>)")
    ap.add_argument("--report", action="store_true", help="rebuild the report from the run folders of --workdir, run nothing")
    ap.add_argument("--caveat", default="Measured on a 2-core machine shared with other training jobs (loaded): compare "
                                         "the lags with each other, not with other tables.")
    args = ap.parse_args(argv)
    if 0 not in args.lags or min(args.lags) < 0 or args.epochs < max(args.lags) + 2:
        ap.error("--lags must include 0 (the baseline) and be >= 0; --epochs at least max(lags) + 2 (a steady epoch)")
    shared = [*COMMON, *args.overrides, f"trainer.max_epochs={args.epochs}",
              *engine_overrides(args.engine, args.workers, args.step_seconds, args.server_cores)]
    order = plan(args.lags, args.rounds)
    tables: dict[int, list] = {lag: [] for lag in args.lags}
    runs = []
    for r, lag in order:
        folder = args.workdir / args.engine / f"lag{lag}" / f"round{r}"
        if args.report:
            run = json.loads((folder / "bench.json").read_text()) if (folder / "bench.json").exists() else {"dir": str(folder), "rc": 0}
        else:
            run = run_one(folder, [*shared, f"data.max_lag={lag}"], args.threads, args.timeout)
        runs.append({**run, "lag": lag, "round": r})
        print(f"lag {lag} round {r}: rc {run['rc']}, {run.get('wall_s', '-')} s ({run['dir']})", flush=True)
        if run["rc"] != 0:
            print((folder / "bench.log").read_text()[-3000:], file=sys.stderr)
            return 1
        tables[lag].append(epoch_table(folder / "csv" / "metrics.csv"))
    loads = [r["loadavg_1min"] for r in runs if "loadavg_1min" in r]
    load = f" Load average (1 min) at the end of each run: {min(loads):.1f} to {max(loads):.1f}." if loads else ""
    settings = {"caveat": args.caveat + load,
                "epochs": args.epochs, "rounds": args.rounds, "threads": args.threads, "order": [lag for _, lag in order],
                "overrides": shared, "cpu_count": os.cpu_count()}
    write(report(args.engine, tables, runs, settings), args.out or RESULTS / args.engine)
    return 0


def report(engine: str, tables: dict[int, list], runs: list[dict], settings: dict) -> dict:
    """The result: the settings, :func:`summarize` of the runs' epoch tables, and :func:`projection` from lag 0's R and
    T with the first lagged run's adapter sync seconds as s."""
    summary = summarize(tables)
    base = summary[0]
    sync = next((summary[lag]["sync_s"] for lag in sorted(summary) if lag > 0 and summary[lag]["sync_s"] is not None), 0.0)
    return {"engine": engine, "lags": sorted(tables), **settings, "summary": summary, "runs": runs, "epochs_by_lag": tables,
            "projection": projection(base["rollout_s"], base["epoch_s"] - base["rollout_s"], sync)}


def write(result: dict, out: Path) -> None:
    """``<out>.json`` and ``<out>.md`` (:func:`render`), which is also printed."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
    out.with_suffix(".md").write_text(render(result))
    print(render(result))


if __name__ == "__main__":
    sys.exit(main())
