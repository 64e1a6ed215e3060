"""Replays of finished study runs: the final evaluation of a run whose checkpoint is gone.

A test run recorded before the final evaluation existed, or whose checkpoint was lost before its evaluation finished,
has no adapter left to evaluate (:data:`bench.study.final_eval.GONE`). Training is deterministic given the commit,
the command and the thread count: every epoch's generators derive from (seed, rank, epoch), and a resumed run draws
what the uninterrupted one drew. So the record's own command (its ``done`` marker keeps it), run again from the
run's commit, rebuilds the same run. :func:`replay` runs it into a folder of its own and checks that the replay's
curves, metrics and per-task held-out outcomes are the record's row for row: wall-clock ``perf/*`` columns aside,
whole numbers (counts, outcomes) exactly, other numbers within :data:`RTOL` (float rounding differs between
machines). It compares while the replay trains and stops a replay at its first difference. Only a replay equal to
its record is evaluated (:func:`bench.study.final_eval.evaluate`, its last checkpoint) and its evaluation added to
the record, with ``replay.json`` saying where it came from. A replay that differs adds nothing: the seed stays
reported from its curve only, and the first difference is printed.

Run it with the interpreter and the worktree of the study's commit (study4: ``74c1025``; the records' ``done``
markers name the interpreter they ran under)::

    python -m bench.study.replay bench/results/study4/runs/smollm2/test/grpo/lr1e-3/seed0 ... \\
        --python ../study4-wt/.venv/bin/python --repo ../study4-wt --out outputs/study4_replay --jobs 2

Resumable: a replay stopped by SIGTERM resumes from its last epoch checkpoint (the command's ``ckpt_path=auto``), its
evaluation from its finished tasks; a record that already has a complete evaluation is skipped.
"""
from __future__ import annotations

import argparse
import csv
import json
import math
import os
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from bench.study import final_eval
from bench.study.records import MANIFEST
from bench.study.runs import STOPPED, stop_on_sigterm, stopping, tracked

RTOL = 1e-3  # a number that is not whole may differ by this much, relative (float rounding across machines)
COMPARED = ("csv/learning_curve.csv", "csv/learning_curve_train.csv", "csv/metrics.csv", "csv/val_episodes/*.csv")
REPLAY = "replay.json"
INCOMPLETE = final_eval.INCOMPLETE  # a replay or its evaluation stopped early: rerun to resume


def command(record: Path, python: str, repo: Path, out: Path) -> list[str]:
    """The record's training command (its ``done`` marker's), under ``python`` and ``repo``'s train.py, into ``out``."""
    cmd = json.loads((record / "done").read_text())["cmd"]
    if not cmd[1].endswith("train.py"):
        raise ValueError(f"{record}/done: not a train.py command: {cmd[:2]}")
    args = [a for a in cmd[2:] if not a.startswith("hydra.run.dir=")]
    return [python, str(repo / "train.py"), *args, f"hydra.run.dir={out}"]


def _rows(path: Path) -> list[dict[str, str]]:
    with open(path, newline="") as f:
        return [{k: v for k, v in r.items() if v not in ("", None) and not k.startswith("perf/")} for r in csv.DictReader(f)]


def _deviation(a: str | None, b: str | None) -> float:
    """How far apart two cells of a compared row are: 0 when equal; for two numbers that are not both whole, their
    relative difference (float rounding differs between machines: the same run's first held-out observation NLL was
    2.7487471 on the machine that recorded it and 2.7487466 on another, its 64 greedy episodes identical); infinite
    for text or whole numbers (counts, steps, outcomes) that differ, which must match exactly."""
    if a == b:
        return 0.0
    try:
        x, y = float(a), float(b)
    except (TypeError, ValueError):
        return math.inf
    if x.is_integer() and y.is_integer():
        return math.inf
    return abs(x - y) / max(1.0, abs(x), abs(y))


def compare(record: Path, run: Path, prefix: bool = False) -> tuple[str | None, float]:
    """(None, the largest relative deviation of a number) when every compared file of ``record`` (:data:`COMPARED`, as
    listed in its manifest) is in ``run`` with the same rows (``perf/*`` aside; cells as :func:`_deviation`); else (the
    first difference in words, 0). ``prefix``: only the rows the replay has written so far (a replay under way)."""
    listed = json.loads((record / MANIFEST).read_text())["files"]
    names = sorted({n for pattern in COMPARED for n in listed if Path(n).match(pattern)})
    if not names:
        return "the record lists none of the compared files", 0.0
    worst = 0.0
    for name in names:
        if not (run / name).is_file():
            if prefix:
                continue
            return f"{name}: missing from the replay", 0.0
        want, got = _rows(record / name), _rows(run / name)
        if prefix:  # a file being written: its last row may be half of one
            got = got[:-1]
        for i, (w, g) in enumerate(zip(want, got)):
            gaps = {k: _deviation(w.get(k), g.get(k)) for k in w.keys() | g.keys()}
            keys = sorted(k for k, gap in gaps.items() if gap > RTOL)
            if keys:
                return f"{name} row {i}: " + ", ".join(f"{k} {w.get(k)} (record) != {g.get(k)} (replay)" for k in keys[:4]), 0.0
            worst = max([worst, *gaps.values()])
        if len(want) != len(got) and not (prefix and len(got) < len(want)):
            return f"{name}: {len(want)} rows in the record, {len(got)} in the replay", 0.0
    return None, worst


def attach(record: Path, run: Path, count: int, cmd: list[str], deviation: float) -> list[str]:
    """Copy the replay's complete evaluation (``eval<count>/summary.json``, ``episodes.csv``) into ``record``, with
    ``replay.json``, and list them in its manifest (so a restore brings them back); returns the added names."""
    manifest = json.loads((record / MANIFEST).read_text())
    added = []
    for name in (f"eval{count}/summary.json", f"eval{count}/episodes.csv"):
        (record / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(run / name, record / name)
        added.append(name)
    (record / REPLAY).write_text(json.dumps({
        "evaluated": "the final checkpoint of a replay of this run: its recorded command, run again from the same "
                     "commit; its curves, metrics and held-out outcomes equal this record's row for row (whole "
                     f"numbers exactly, others within {RTOL:g} relative)",
        "largest_relative_deviation": deviation, "cmd": cmd}, indent=1) + "\n")
    added.append(REPLAY)
    manifest["files"] = sorted(set(manifest["files"]) | set(added))
    (record / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    return added


def _watch(proc: subprocess.Popen, record: Path, out: Path, poll: float) -> str | None:
    """Wait for the replay's training, comparing the rows it has written with the record's every ``poll`` seconds;
    the first difference (the replay is then stopped: hours of training saved), or None once it exits."""
    while True:
        try:
            proc.wait(timeout=poll)
            return None
        except subprocess.TimeoutExpired:
            diff, _ = compare(record, out, prefix=True)
            if diff is not None:
                return diff


def replay(record: Path, out: Path, python: str, repo: Path, count: int, threads: int,
           poll: float = 60.0) -> tuple[int, str]:
    """Replay, compare, evaluate and attach one record; (exit status, what happened). The replay is compared with the
    record while it trains (every ``poll`` seconds) and stopped at its first difference."""
    if "success" in final_eval.read(record):
        return 0, "has a complete evaluation: skipped"
    if stopping():
        return STOPPED, "not started: the launcher is stopping"
    cmd = command(record, python, repo, out)
    out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
    if not (out / "done").exists():
        with (out / "bench.log").open("a") as log:
            proc = subprocess.Popen(cmd, cwd=repo, env=env, stdout=log, stderr=subprocess.STDOUT)
            try:
                with tracked(proc):  # the launcher's SIGTERM stops it at its step: the next launch resumes it
                    diff = _watch(proc, record, out, poll)
            finally:
                if proc.poll() is None:
                    proc.terminate()
                    proc.wait()
            rc = proc.returncode
        if diff is not None:  # stopped early: the rest of the run could not make it the record's
            return 1, f"the replay differs from the record, stopped, nothing attached: {diff}"
        if rc != 0:
            return rc, f"training exited {rc}: see {out}/bench.log (rerun to resume)"
        curve = "csv/learning_curve_train.csv"  # exit 0 before the last epoch: a SIGTERM'd run
        if not (out / curve).is_file() or len(_rows(out / curve)) < len(_rows(record / curve)):
            return INCOMPLETE, "training stopped before its last epoch (rerun to resume)"
        (out / "done").write_text(json.dumps({"cmd": cmd}) + "\n")
    diff, worst = compare(record, out)
    if diff is not None:
        return 1, f"the replay differs from the record, nothing attached: {diff}"
    args = [a for a in cmd[2:] if not a.startswith(("hydra.run.dir=", "ckpt_path="))]
    algo = next(a.split("=", 1)[1] for a in args if a.startswith("algo="))
    seed = int(next(a.split("=", 1)[1] for a in args if a.startswith("seed=")))
    overrides = tuple(a for a in args if not a.startswith(("algo=", "seed=")))
    rc = final_eval.evaluate(out, algo, seed, overrides, count, threads, repo, python=python)
    if rc != 0:
        return rc, f"evaluation exited {rc}: see {out}/eval.log (rerun to resume)"
    attach(record, out, count, cmd, worst)
    return 0, (f"the record's run (numbers within {worst:.1e}, relative); greedy success "
               f"{final_eval.read(out)['success']:.3f} on {count} tasks, attached")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("records", type=Path, nargs="+", help="record folders of test runs (bench/results/<study>/runs/...)")
    p.add_argument("--python", required=True, help="the interpreter of the study's commit (its worktree's venv)")
    p.add_argument("--repo", type=Path, required=True, help="the worktree at the study's commit")
    p.add_argument("--out", type=Path, required=True, help="replay folders (checkpoints: not committed)")
    p.add_argument("--count", type=int, default=256, help="test tasks of the final evaluation")
    p.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS: the study's own (1)")
    p.add_argument("--jobs", type=int, default=1, help="replays at once")
    args = p.parse_args(argv)
    repo, out_root = args.repo.resolve(), args.out.resolve()
    stop_on_sigterm()

    def one(record: Path) -> int:
        record = record.resolve()
        parts = record.parts
        out = out_root.joinpath(*parts[parts.index("runs") + 1:]) if "runs" in parts else out_root / record.name
        rc, what = replay(record, out, args.python, repo, args.count, args.threads)
        print(f"{record}: {what}", flush=True)
        return rc

    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        codes = list(pool.map(one, args.records))
    return 1 if any(codes) else 0


if __name__ == "__main__":
    sys.exit(main())
