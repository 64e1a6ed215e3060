"""The study's final evaluation: each test run's last checkpoint, greedy, on a larger panel of test tasks.

A regime with ``final_eval`` = N > 0 (:class:`bench.study.launch.Regime`) has ``eval.py`` evaluate every test run's
``checkpoints/last.ckpt`` right after it finishes (:func:`evaluate`): test tasks 0..N-1, temperature 0, in the run's
validation batch size (so its first tasks are the final validation's own), into ``<run>/eval<N>/`` (``summary.json``
of :func:`cope.run.evaluate.summarize`, ``episodes.csv``), which the run's record keeps
(:mod:`bench.study.records`). The curve's last point is a 64-task panel in study4; this is a 256-task one, so the
per-seed success it measures has a quarter of the binomial variance.

:func:`summarize` is the report's table of it: per arm the seeds evaluated, the mean greedy success over them
(bootstrap 95%), and the paired-by-seed differences to GRPO and, for the arms after it, to CoPE (authors', list),
both with the bootstrap and the paired t interval (:mod:`bench.study.stats`, as the curve's Δ columns). A run
without a complete evaluation is named per seed with the reason: a run restored from a record with none was
recorded before the final evaluation existed, and its checkpoint (never recorded) is gone.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from bench.study.stats import bootstrap, paired_difference, paired_t

GONE = "checkpoint gone: recorded before the final evaluation existed"
FAILED = "no evaluation: eval.py did not finish, see the run's eval.log"
INCOMPLETE = 3  # evaluate()'s code for an eval.py that exited 0 before its last task (a SIGTERM'd one)
REFERENCES = ("grpo", "cope_authors")  # the arms the final evaluation's Δ columns compare with, in this order


def evaluate(run: Path, algo: str, seed: int, overrides: tuple[str, ...], count: int, threads: int, repo: Path,
             python: str = sys.executable) -> int:
    """Evaluate ``run``'s last checkpoint with ``repo``'s eval.py under ``python`` on test tasks 0..count-1, greedy, in
    the run's validation batch size, into ``<run>/eval<count>/``. Resumable (eval.py skips finished tasks); returns its
    exit code, or :data:`INCOMPLETE` where it exited 0 without a complete summary."""
    out = run / f"eval{count}"
    summary = out / "summary.json"
    if summary.exists() and json.loads(summary.read_text()).get("complete"):
        return 0
    batch = next(o.split("=", 1)[1] for o in reversed(overrides) if o.startswith("data.val_batch_size="))
    cmd = [python, str(repo / "eval.py"), f"algo={algo}", f"seed={seed}",
           *overrides, f"ckpt_path={run}/checkpoints/last.ckpt", "eval.split=test", "eval.start=0",
           f"eval.count={count}", "eval.temperature=0", f"eval.batch_size={batch}", "eval.progress=false",
           f"eval.out={out}", f"hydra.run.dir={out}", "~logger"]
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
    with (run / "eval.log").open("a") as log:
        rc = subprocess.run(cmd, cwd=repo, env=env, stdout=log, stderr=subprocess.STDOUT).returncode
    # eval.py stopped by SIGTERM exits 0 with the finished waves and "complete": false: not an evaluation to record
    # (the launcher records a run only at 0; the next launch resumes the evaluation from its episodes.csv)
    if rc == 0 and not (summary.exists() and json.loads(summary.read_text()).get("complete")):
        return INCOMPLETE
    return rc


def read(run: Path) -> dict:
    """The run's final evaluation: ``{"tasks", "success", "replayed"}`` from its largest complete
    ``eval<N>/summary.json`` (``replayed``: of a replay's checkpoint, :mod:`bench.study.replay`), or ``{"reason"}``
    saying why there is none."""
    found = sorted(((int(p.parent.name.removeprefix("eval")), p) for p in run.glob("eval*/summary.json")
                    if p.parent.name.removeprefix("eval").isdigit()), reverse=True)
    for _, path in found:
        s = json.loads(path.read_text())
        if s.get("complete"):
            return {"tasks": int(s["tasks"]), "success": float(s["success"]), "replayed": (run / "replay.json").exists()}
    if found:
        s = json.loads(found[0][1].read_text())
        return {"reason": f"evaluation incomplete: {s.get('tasks', 0)} of {found[0][0]} tasks, see the run's eval.log"}
    return {"reason": GONE if (run / "restored_from").exists() else FAILED}


def summarize(results: list[dict]) -> dict:
    """{regime: {arm: row}} over the finished test runs of the regimes where any run has a final evaluation; a row:
    ``setting``, ``tasks``, ``seeds`` (evaluated), ``replayed`` (those evaluated on a replay's checkpoint), ``missing``
    ({seed: reason}), ``success`` (mean, bootstrap 95%),
    ``runs`` ({seed: success}) and per reference arm (:data:`REFERENCES`, a different arm that was evaluated)
    ``delta_<ref>`` (bootstrap) and ``delta_<ref>_t`` (paired t), paired by seed."""
    table: dict = {}
    for res in results:
        job = res["job"]
        if res["rc"] != 0 or job.phase != "test":
            continue
        row = table.setdefault(job.regime, {}).setdefault(
            job.arm, {"setting": job.setting, "runs": {}, "missing": {}, "tasks": set(), "replayed": []})
        got = read(Path(res["dir"]))
        if "success" in got:
            row["runs"][job.seed] = got["success"]
            row["tasks"].add(got["tasks"])
            if got["replayed"]:
                row["replayed"].append(job.seed)
        else:
            row["missing"][job.seed] = got["reason"]
    table = {r: arms for r, arms in table.items() if any(row["runs"] for row in arms.values())}
    for arms in table.values():
        for arm, row in arms.items():
            row["seeds"] = sorted(row["runs"])
            row["tasks"] = sorted(row["tasks"])
            row["success"] = bootstrap([row["runs"][s] for s in row["seeds"]], "mean")
            for ref in REFERENCES[: REFERENCES.index(arm) if arm in REFERENCES else None]:
                if arms.get(ref, {}).get("runs") and row["runs"]:
                    row[f"delta_{ref}"] = paired_difference(row["runs"], arms[ref]["runs"])
                    row[f"delta_{ref}_t"] = paired_t(row["runs"], arms[ref]["runs"])
    return table


def half_width(t: tuple | None) -> float | None:
    """The paired t 95% interval's half-width (None below 2 pairs): an observed mean difference smaller than it
    does not separate, i.e. the smallest effect that comparison could have seen."""
    if not t or t[3] < 2:
        return None
    return (t[2] - t[1]) / 2


__all__ = ["FAILED", "GONE", "INCOMPLETE", "REFERENCES", "evaluate", "half_width", "read", "summarize"]
