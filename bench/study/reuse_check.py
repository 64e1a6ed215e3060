"""Whether a finished study run can be reused by a later study: rerun its recorded command from today's commit and
compare what it logs with the record while it trains, for its first epochs.

A later study whose arm runs exactly as an earlier study's (the same overrides and seeds: study5's GRPO and ECHO are
study4's) may reuse the earlier records instead of rerunning them, if the code path is unchanged. Training is
deterministic given the commit, the command and the thread count (:mod:`bench.study.replay`), so a rerun that logs
the record's numbers, row for row, has taken the same path. This check runs the record's command (its ``done``
marker's) with ``--python`` and ``--repo`` (today's worktree) and compares every ``--every`` seconds the rows written
so far with the record's (:func:`bench.study.replay.compare`'s rule: whole numbers exactly, others within
:data:`bench.study.replay.RTOL`; ``perf/*`` aside) on the record's own columns: columns added since are listed, not
compared, and ``--ignore`` prefixes (diagnostics that training never reads, e.g. ``probe/``) are left out. It stops
at the first difference, or once ``--rows`` rows of ``csv/metrics.csv`` have been compared (the first epoch and the
next one's first step take 5 on study4's SmolLM2 runs), and prints what it compared.

Usage::

    python -m bench.study.reuse_check bench/results/study4/runs/smollm2/test/grpo/lr1e-3/seed0 \\
        --python .venv/bin/python --repo . --out outputs/reuse_check/grpo0 --rows 5 --ignore probe/

Exit status 0: the compared rows are equal; 1: a difference (printed); 2: the run ended before ``--rows`` rows.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

from bench.study import replay

FILES = ("csv/metrics.csv", "csv/learning_curve_train.csv", "csv/learning_curve.csv")


def compare(record: Path, run: Path, ignore: tuple[str, ...]) -> tuple[str | None, dict[str, int], set[str]]:
    """(the first difference or None, complete rows compared per file, columns the run has and the record lacks)."""
    compared, added = {}, set()
    for name in FILES:
        if not (run / name).is_file():
            continue
        want, got = replay._rows(record / name), replay._rows(run / name)[:-1]  # the last row may be half written
        for i, (w, g) in enumerate(zip(want, got)):
            keys = [k for k in w if not k.startswith(ignore) and replay._deviation(w.get(k), g.get(k)) > replay.RTOL]
            if keys:
                return (f"{name} row {i}: " + ", ".join(f"{k} {w.get(k)} (record) != {g.get(k)} (rerun)" for k in keys[:4]),
                        compared, added)
            added |= {k for k in g if k not in w}
        compared[name] = min(len(want), len(got))
    return None, compared, added


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("record", type=Path, help="a finished run's record folder (bench/results/<study>/runs/...)")
    p.add_argument("--python", required=True, help="the interpreter of today's worktree")
    p.add_argument("--repo", type=Path, required=True, help="today's worktree")
    p.add_argument("--out", type=Path, required=True, help="the rerun's folder (checkpoints: not committed)")
    p.add_argument("--rows", type=int, default=5, help="rows of csv/metrics.csv to compare before stopping")
    p.add_argument("--ignore", nargs="*", default=[], help="column prefixes not compared (diagnostics)")
    p.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS: the study's own (1)")
    p.add_argument("--every", type=float, default=30.0, help="seconds between comparisons")
    args = p.parse_args(argv)
    cmd = replay.command(args.record, args.python, args.repo.resolve(), args.out.resolve())
    args.out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), MKL_NUM_THREADS=str(args.threads))
    ignore = ("perf/", *args.ignore)
    with (args.out / "bench.log").open("a") as log:
        proc = subprocess.Popen(cmd, cwd=args.repo, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        while True:
            done = proc.poll() is not None
            diff, compared, added = compare(args.record, args.out, ignore)
            if diff is not None:
                print(f"{args.record}: differs: {diff}")
                return 1
            if compared.get("csv/metrics.csv", 0) >= args.rows:
                print(f"{args.record}: equal on the rows compared {compared} (ignored: {list(ignore)}; "
                      f"columns the rerun adds: {sorted(added)})")
                return 0
            if done:
                print(f"{args.record}: the rerun exited {proc.returncode} after {compared}; see {args.out}/bench.log")
                return 2
            time.sleep(args.every)
    finally:
        if proc.poll() is None:
            proc.terminate()
            proc.wait()


if __name__ == "__main__":
    sys.exit(main())
