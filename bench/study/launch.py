"""The sample-efficiency study: GRPO, CoPE and ECHO, equally tuned, paired seeds, per regime.

What it runs (each run is one ``python train.py ...`` subprocess; see ``SPEC`` below for the exact
overrides, and bench/README.md for the decisions behind them):

1. Tuning, in regime ``prior`` only, on the *tuning* panel (held-out test mazes 500..755, never
   reported) with tuning seed 100: GRPO over its learning rate, then CoPE (weight, K, the gradient-norm
   normalization) and ECHO (lambda) over the same number of settings (3) at GRPO's chosen learning rate.
   Selection: the highest AUC. The other regimes reuse these settings.
2. Test runs, on the *reported* panel (test mazes 0..255) with seeds 0..4, the chosen setting of each
   arm; seed s is the same task stream and the same warm start in every arm (paired).

Regimes (``--regimes``, default ``prior random``): ``prior`` (b) warm-started by behaviour cloning on noisy
goal-directed walks (GRPO, CoPE, ECHO); ``random`` (a) the tiny model warm-started on uniform random walks
(GRPO vs ECHO; also reported per maze size: ECHO's maze claim, with the 1M model on mixed 6/7/8 mazes).
``echo6/7/8`` (ECHO's maze experiment with a ~10M-parameter model, one size each) are defined but not in the
default: too slow for this machine's budget (bench/README.md). ``cope``, ``cope_recheck`` (the tiny model) and
``smollm2`` (SmolLM2-135M-Instruct) compare GRPO with CoPE's variants and run on their own, each with
its own --out/--records/--results; a :class:`Regime` carries its own budget, panels, seeds and search. A
text-env regime (the plan's (c)) is not run. Every run logs the gradient diagnostics (``grad/*``) on the first
optimizer step of each epoch and every held-out task's outcome (``csv/val_episodes``). A regime with ``final_eval``
(``smollm2``: 256) also evaluates each test run's last checkpoint greedily on that many test tasks
(:mod:`bench.study.final_eval`). ``--arms`` runs a subset of each regime's arms (and GRPO's tuning, which they need).

Outputs: run folders ``<out>/<regime>/<phase>/<arm>/<setting>/seed<s>`` (``--out``, default ``outputs/study``;
``done`` marks a finished one; finished runs are reused, an unfinished one continues from its last epoch
checkpoint with ``ckpt_path=auto``, so an interrupted study resumes where it stopped; SIGTERM/Ctrl-C to this
launcher stops its running jobs and starts no new one); a checkpoint-free copy of each finished run goes to
``--records`` (default ``bench/results/study/runs``, committed), from which a fresh checkout restores it
instead of rerunning it (:mod:`bench.study.records`); and in ``--results`` (default ``bench/results/study``):
``study.md`` (the tables), ``study.json``, ``success_vs_episodes.png`` (mean and bootstrap 95% band per arm,
one panel per regime) and ``mechanism.png`` (cosine of each auxiliary gradient with the PG gradient, per step).

Usage: ``python -m bench.study --jobs 2`` (about 2 hours on 2 idle cores); ``--report`` only rebuilds the
tables and plots from finished runs; ``--smoke`` runs a minutes-long miniature (CI: tests/test_study.py).
"""
from __future__ import annotations

import argparse
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from bench.study import final_eval as study_eval
from bench.study import records as study_records
from bench.study import stages
from bench.study.regimes import ARM_ALGO, COMMON, DEFAULT_REGIMES, REPO, SMOKE_EVAL, SMOKE_PANEL, SPEC, Regime
from bench.study.report import EARLY_EPOCHS, _rows, early_forecast_samples, report, run_curve
from bench.study.runs import BUSY, STOPPED, finished, held, run_state, stop_on_sigterm, stopping, train_one


@dataclass
class Job:
    regime: str
    phase: str  # tune | test
    arm: str
    setting: str
    seed: int
    overrides: tuple[str, ...] = field(default=())
    final_eval: int = 0  # > 0: after training, the last checkpoint is evaluated on this many test tasks

    def dir(self, out: Path) -> Path:
        return out / self.regime / self.phase / self.arm / self.setting / f"seed{self.seed}"


def _overrides(regime: Regime, phase: str, arm: str, setting: tuple[str, ...], smoke: bool) -> tuple[str, ...]:
    tune_panel, test_panel = regime.panels
    return (*COMMON, *(regime.smoke if smoke else regime.budget), *(tune_panel if phase == "tune" else test_panel),
            *regime.overrides, *dict(regime.arm_overrides).get(arm, ()),
            f"callbacks.sample_efficiency.threshold={regime.threshold}", *setting, *(SMOKE_PANEL if smoke else ()))


def _grid(regime: Regime, arm: str, smoke: bool) -> dict[str, tuple[str, ...]]:
    grid = regime.search(arm)
    return dict(list(grid.items())[: regime.smoke_size[0]]) if smoke else grid


def _final_eval(regime: Regime, smoke: bool) -> int:
    """How many test tasks each test run's last checkpoint is evaluated on (0: none)."""
    return min(regime.final_eval, SMOKE_EVAL) if smoke else regime.final_eval


def _seeds(regime: Regime, phase: str, smoke: bool) -> tuple[int, ...]:
    seeds = regime.seeds[0 if phase == "tune" else 1]
    return seeds[: 1 if phase == "tune" else regime.smoke_size[1]] if smoke else seeds


def run_jobs(jobs: list[Job], out: Path, jobs_at_once: int, threads: int, records: Path) -> list[dict]:
    """Runs (or reuses) the jobs; returns one result per job, in order, with its Job attached. A finished
    run is also kept in ``records`` (committed; :mod:`bench.study.records`), and a job with a record of the same
    overrides is restored from it instead of run, so the study resumes on a fresh checkout."""
    done: list[int] = []

    def one(job: Job) -> dict:
        d, rec = job.dir(out), job.dir(records)
        # a copy of a record (restored now or by an earlier launch) is never saved back over it: the record may hold
        # more than a run folder does (a reused run's reused.json)
        restored = (d / "restored_from").exists() or (not finished(d) and study_records.restore(rec, d, job.overrides))
        r = train_one(ARM_ALGO.get(job.arm, job.arm), job.seed, d, list(job.overrides), threads, force=False, resume=True)
        if r["rc"] == 0 and not _complete(d, job.overrides):  # exit 0 without the last epoch (a SIGTERM'd run)
            (d / "done").unlink(missing_ok=True)
            r = {**r, "rc": -15}
        # a record's copy (restored now or by an earlier launch) has no checkpoint to evaluate: the report names it
        if r["rc"] == 0 and job.final_eval and not (d / "restored_from").exists():
            with held(d) as lock:  # one launcher evaluates a run at a time (another one's evaluation: left to it)
                rc = BUSY if lock is None else study_eval.evaluate(d, ARM_ALGO.get(job.arm, job.arm), job.seed,
                                                                   job.overrides, job.final_eval, threads, REPO)
            r = {**r, "rc": rc, "skipped": r["skipped"] and rc == 0}
        if r["rc"] == 0 and not restored:  # also a reused run recorded before records existed
            study_records.save(d, rec, job.overrides)
        done.append(1)
        state = "restored from its record" if restored and r["skipped"] else run_state(r)
        print(f"[{len(done)}/{len(jobs)}] {job.regime} {job.phase} {job.arm} {job.setting} seed {job.seed}: "
              f"{r['wall_s']:.0f} s ({state}){_samples(d)}", flush=True)
        return {**r, "job": job}

    with ThreadPoolExecutor(max_workers=max(1, jobs_at_once)) as pool:
        results = list(pool.map(one, jobs))
    if stopping():  # SIGTERM/SIGINT: the running jobs checkpointed and stopped; the next launch resumes them
        print("study stopped by a signal: rerun the same command to resume", file=sys.stderr, flush=True)
        sys.exit(STOPPED)
    return results


def _restore(jobs: list[Job], out: Path, records: Path) -> None:
    """Puts each unfinished job's record (same overrides) back into its run folder."""
    for j in jobs:
        if not finished(j.dir(out)):
            study_records.restore(j.dir(records), j.dir(out), j.overrides)


def _existing(jobs: list[Job], out: Path, records: Path) -> list[dict]:
    """``--report``: the jobs' finished runs as results (rc 1 where none), restoring records where needed."""
    _restore(jobs, out, records)
    return [{"dir": str(j.dir(out)), "rc": 0 if finished(j.dir(out)) else 1, "job": j} for j in jobs]


def _samples(run: Path) -> str:
    """``; forecast samples 12.5/epoch in epochs 0-1`` for a run that builds forecast samples (a 0 there means the
    arm trained GRPO alone: e.g. every answer projected and counted invalid)."""
    n = early_forecast_samples(_rows(run / "csv/metrics.csv"))
    return "" if n is None else f"; forecast samples {n:.1f}/epoch in epochs 0-{EARLY_EPOCHS - 1}"


def _complete(run: Path, overrides: tuple[str, ...]) -> bool:
    """Whether the run trained its last epoch (``trainer.max_epochs``) and validated after it."""
    epochs = int(next(o.split("=", 1)[1] for o in reversed(overrides) if o.startswith("trainer.max_epochs=")))
    train = _rows(run / "csv/learning_curve_train.csv")
    return bool(train) and int(train[-1]["epoch"]) == epochs - 1


def best_setting(results: list[dict], regime: str, arm: str, grid: dict[str, tuple[str, ...]]) -> str:
    """The setting with the highest mean AUC over the tuning seeds (ties: the first in GRID order)."""
    scores = {}
    for label in grid:
        aucs = [run_curve(Path(r["dir"]))["auc"] for r in results
                if r["rc"] == 0 and (r["job"].regime, r["job"].arm, r["job"].setting) == (regime, arm, label)]
        aucs = [a for a in aucs if a is not None]
        if aucs:
            scores[label] = sum(aucs) / len(aucs)
    if not scores:
        raise RuntimeError(f"no finished tuning run for {regime}/{arm}: see the bench.log files under {regime}/tune/{arm}")
    return max(scores, key=lambda k: (scores[k], -list(grid).index(k)))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--regimes", nargs="+", default=list(DEFAULT_REGIMES), choices=list(SPEC),
                   help="echo6/7/8 (the ~10M model) are not in the default: about 40 minutes a run here (bench/README.md)")
    p.add_argument("--out", type=Path, default=REPO / "outputs/study", help="run folders (checkpoints, logs; not committed)")
    p.add_argument("--records", type=Path, default=None,
                   help="committed copies of finished runs, restored on a fresh checkout (default: "
                        "bench/results/study/runs, or --out/records with --smoke)")
    p.add_argument("--results", type=Path, default=None,
                   help="where study.md/.json and the plots go (default: bench/results/study, or --out with --smoke)")
    p.add_argument("--jobs", type=int, default=2, help="training subprocesses in parallel")
    p.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS of each subprocess")
    p.add_argument("--arms", nargs="+", default=None, help="only these arms of each regime (default: all)")
    p.add_argument("--seeds", nargs="+", type=int, default=None,
                   help="only these test seeds (default: each regime's), e.g. the runs that fit one sitting; their "
                        "prerequisites only, and the report only of them")
    p.add_argument("--report", action="store_true", help="only rebuild the tables and plots from finished runs")
    p.add_argument("--smoke", action="store_true", help="a miniature of the whole study (seconds per run; CI)")
    args = p.parse_args(argv)
    out = args.out.resolve()
    records = (args.records or (out / "records" if args.smoke else REPO / "bench/results/study/runs")).resolve()
    stop_on_sigterm()
    regimes = [r for r in args.regimes if SPEC[r].tuned_in is None or SPEC[r].tuned_in in args.regimes]
    for r in set(args.regimes) - set(regimes):
        p.error(f"regime {r} reuses the tuning of {SPEC[r].tuned_in}: add it to --regimes")
    arms = {r: [a for a in SPEC[r].arms if not args.arms or a in args.arms] for r in regimes}  # --arms: their runs only
    for r in regimes:
        if args.seeds and not set(args.seeds) <= set(_seeds(SPEC[r], "test", args.smoke)):
            p.error(f"--seeds {args.seeds}: regime {r} has test seeds {list(_seeds(SPEC[r], 'test', args.smoke))}")
    # each regime's search per arm (GRPO's also with --arms without it: the other arms are tuned at its chosen lr)
    grids = {r: {a: _grid(SPEC[r], a, args.smoke) for a in SPEC[r].arms if a in arms[r] or a == "grpo"} for r in regimes}
    tuned = [r for r in regimes if SPEC[r].tuned_in is None and not SPEC[r].fixed]
    results: list[dict] = []
    untuned: list[str] = []  # --report: arms without a finished tuning run (left out, named, exit status 1)
    choice: dict[tuple[str, str], tuple[str, tuple[str, ...]]] = {}

    def tune(names: list[str], base: dict[str, tuple[str, ...]]) -> None:
        searched = [(r, a) for r in tuned for a in names if a in grids[r]]
        for r, a in searched:  # a single setting has nothing to choose between: no tuning run
            if len(grids[r][a]) == 1:
                label, ov = next(iter(grids[r][a].items()))
                choice[(r, a)] = (label, (*base.get(r, ()), *ov))
        searched = [(r, a) for r, a in searched if len(grids[r][a]) > 1]
        jobs = [Job(r, "tune", a, label, s, _overrides(SPEC[r], "tune", a, (*base.get(r, ()), *ov), args.smoke))
                for r, a in searched for label, ov in grids[r][a].items() for s in _seeds(SPEC[r], "tune", args.smoke)]
        done = [] if args.report or not jobs else run_jobs(jobs, out, args.jobs, args.threads, records)
        done = done or _existing(jobs, out, records)
        results.extend(done)
        for r, a in searched:
            try:
                label = best_setting(done, r, a, grids[r][a])
            except RuntimeError as e:  # --report while an arm's tuning has not finished: the other arms are reported
                if not args.report:
                    raise
                untuned.append(f"{r}/{a}")
                print(f"{e}: the arm is left out of this report", file=sys.stderr)
                continue
            choice[(r, a)] = (label, (*base.get(r, ()), *grids[r][a][label]))

    for r in regimes:  # settings fixed by an earlier tuning: GRPO's, and each other arm's on top of GRPO's lr
        fixed = dict(SPEC[r].fixed)
        base = SPEC[r].search("grpo")[fixed["grpo"]] if "grpo" in fixed else ()
        for a, label in fixed.items():
            choice[(r, a)] = (label, SPEC[r].search(a)[label] if a == "grpo" else (*base, *SPEC[r].search(a)[label]))
    tune(["grpo"], {})
    tune(["cope", "cope_authors", "cope_turns", "echo"], {r: choice[(r, "grpo")][1] for r in tuned})  # the aux arms at GRPO's chosen lr
    # seed by seed (every arm of a seed before the next seed): a study stopped half way has paired seeds
    tests = [Job(r, "test", a, choice[(SPEC[r].tuned_in or r, a)][0], s,
                 _overrides(SPEC[r], "test", a, choice[(SPEC[r].tuned_in or r, a)][1], args.smoke), _final_eval(SPEC[r], args.smoke))
             for r in regimes for s in _seeds(SPEC[r], "test", args.smoke) if not args.seeds or s in args.seeds for a in arms[r]
             if (SPEC[r].tuned_in or r, a) in choice]
    pre = stages.prerequisites(tests, Job, lambda r: _overrides(SPEC[r], "test", "pre", (), args.smoke), args.smoke)
    tests = stages.with_adapters(tests, pre, out)  # arms that start from another run's adapter (GRPO on SFT)
    if pre and not args.report:
        _restore(tests, out, records)  # a recorded run needs no prerequisite: a fresh checkout does not retrain its SFT
        failed_pre = [r for r in stages.run_prerequisites(pre, tests, out, args.threads) if r["rc"] != 0]
        if failed_pre:
            print(f"prerequisite runs failed: {[r['dir'] for r in failed_pre]}", file=sys.stderr)
            return 1
    done = [] if args.report else run_jobs(tests, out, args.jobs, args.threads, records)
    results.extend(done or _existing(tests, out, records))
    failed = [r for r in results if r["rc"] != 0]
    meta = {"regimes": {r: {"title": SPEC[r].title, "threshold": SPEC[r].threshold, "overrides": list(SPEC[r].overrides),
                            "arm_overrides": {a: list(ov) for a, ov in SPEC[r].arm_overrides},
                            "tuned_in": SPEC[r].tuned_in, "final_eval": _final_eval(SPEC[r], args.smoke),
                            "equal_env_steps": SPEC[r].equal_env_steps,
                            "by_size": list(SPEC[r].by_size) if SPEC[r].by_size else None,
                            "budget": list(SPEC[r].smoke if args.smoke else SPEC[r].budget),
                            "panels": {"tune": list(SPEC[r].panels[0]), "test": list(SPEC[r].panels[1])},
                            "seeds": {"tune": list(_seeds(SPEC[r], "tune", args.smoke)),
                                      "test": list(_seeds(SPEC[r], "test", args.smoke))}} for r in regimes},
            "choice": {f"{r}/{a}": {"setting": lab, "overrides": list(ov)} for (r, a), (lab, ov) in choice.items()},
            "grid": {r: {a: {k: list(v) for k, v in g.items()} for a, g in grids[r].items()} for r in regimes},
            "common": list(COMMON), "smoke": args.smoke}
    report(results, meta, (args.results or (out if args.smoke else REPO / "bench/results/study")).resolve())
    if untuned:
        print(f"not reported (no finished tuning run): {', '.join(untuned)}", file=sys.stderr)
    if failed:
        for r in failed[:5]:
            log = Path(r["dir"]) / "bench.log"
            tail = log.read_text().splitlines()[-15:] if log.exists() else ["(no log)"]
            print(f"--- failed: {r['dir']}\n" + "\n".join(tail), file=sys.stderr)
        return 1
    return 1 if untuned else 0


if __name__ == "__main__":
    sys.exit(main())

