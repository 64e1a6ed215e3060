"""Replays of finished study runs: the final evaluation of a run whose checkpoint is gone.

A test run recorded before the final evaluation existed, or whose checkpoint was lost before its evaluation finished,
has no adapter left to evaluate (:data:`bench.study.final_eval.GONE`). Training is deterministic given the commit,
the command and the thread count: every epoch's generators derive from (seed, rank, epoch), and a resumed run draws
what the uninterrupted one drew. So the record's own command (its ``done`` marker keeps it), run again from the
run's commit, rebuilds the same adapter. :func:`replay` runs it into a folder of its own, checks that the replay's
curves, metrics and per-task held-out outcomes are the record's row for row (wall-clock ``perf/*`` columns aside),
and only then evaluates the replay's last checkpoint (:func:`bench.study.final_eval.evaluate`) and adds that
evaluation to the record, with ``replay.json`` saying where it came from. A replay that differs adds nothing: the
seed stays reported from its curve only, and the first difference is printed.

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
import os
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from bench.study import final_eval
from bench.study.records import MANIFEST

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


def difference(record: Path, run: Path) -> str | None:
    """None when every compared file of ``record`` (:data:`COMPARED`, as listed in its manifest) is in ``run`` with
    the same rows (``perf/*`` aside); else the first difference, in words."""
    listed = json.loads((record / MANIFEST).read_text())["files"]
    names = sorted({n for pattern in COMPARED for n in listed if Path(n).match(pattern)})
    if not names:
        return "the record lists none of the compared files"
    for name in names:
        if not (run / name).is_file():
            return f"{name}: missing from the replay"
        want, got = _rows(record / name), _rows(run / name)
        for i, (w, g) in enumerate(zip(want, got)):
            if w != g:
                keys = sorted(k for k in w.keys() | g.keys() if w.get(k) != g.get(k))
                return f"{name} row {i}: " + ", ".join(f"{k} {w.get(k)} (record) != {g.get(k)} (replay)" for k in keys[:4])
        if len(want) != len(got):
            return f"{name}: {len(want)} rows in the record, {len(got)} in the replay"
    return None


def attach(record: Path, run: Path, count: int, cmd: list[str]) -> list[str]:
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
                     "commit; its curves, metrics and held-out outcomes equal this record's row for row",
        "cmd": cmd}, indent=1) + "\n")
    added.append(REPLAY)
    manifest["files"] = sorted(set(manifest["files"]) | set(added))
    (record / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    return added


def replay(record: Path, out: Path, python: str, repo: Path, count: int, threads: int) -> tuple[int, str]:
    """Replay, compare, evaluate and attach one record; (exit status, what happened)."""
    if "success" in final_eval.read(record):
        return 0, "has a complete evaluation: skipped"
    cmd = command(record, python, repo, out)
    out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
    if not (out / "done").exists():
        with (out / "bench.log").open("a") as log:
            rc = subprocess.run(cmd, cwd=repo, env=env, stdout=log, stderr=subprocess.STDOUT).returncode
        if rc != 0:
            return rc, f"training exited {rc}: see {out}/bench.log (rerun to resume)"
        curve = "csv/learning_curve_train.csv"  # exit 0 before the last epoch: a SIGTERM'd run
        if not (out / curve).is_file() or len(_rows(out / curve)) < len(_rows(record / curve)):
            return INCOMPLETE, "training stopped before its last epoch (rerun to resume)"
        (out / "done").write_text(json.dumps({"cmd": cmd}) + "\n")
    diff = difference(record, out)
    if diff is not None:
        return 1, f"the replay differs from the record, nothing attached: {diff}"
    args = [a for a in cmd[2:] if not a.startswith(("hydra.run.dir=", "ckpt_path="))]
    algo = next(a.split("=", 1)[1] for a in args if a.startswith("algo="))
    seed = int(next(a.split("=", 1)[1] for a in args if a.startswith("seed=")))
    overrides = tuple(a for a in args if not a.startswith(("algo=", "seed=")))
    rc = final_eval.evaluate(out, algo, seed, overrides, count, threads, repo, python=python)
    if rc != 0:
        return rc, f"evaluation exited {rc}: see {out}/eval.log (rerun to resume)"
    attach(record, out, count, cmd)
    return 0, f"identical to the record; greedy success {final_eval.read(out)['success']:.3f} on {count} tasks, attached"


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
