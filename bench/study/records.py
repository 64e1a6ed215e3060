"""Committed records of the study's finished runs, so that the study resumes on a fresh machine.

A run folder (``outputs/study/...``) holds checkpoints and logs and is not committed, so a new checkout
starts without it: a study longer than one sitting would restart from zero. :func:`save` copies what the
report reads from a finished run (its curves, metrics, per-task held-out outcomes, its ``done`` marker,
the resolved config and its final evaluation's summary and per-task outcomes, :mod:`bench.study.final_eval`:
tens of kB) into ``bench/results/study/runs/<same path>``, and :func:`restore` puts such a record back into an
empty run folder, where the launcher then reuses it as finished.

A record is only reused for the same job: it stores the job's overrides, and a job whose overrides differ
(the study's design changed) ignores it and runs again, overwriting it when it finishes.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

KEPT = ("done", "csv/learning_curve.csv", "csv/learning_curve_train.csv", "csv/metrics.csv",
        "csv/val_episodes/*.csv", ".hydra/config.yaml", ".hydra/overrides.yaml", "eval*/summary.json", "eval*/episodes.csv")
MANIFEST = "record.json"


def _files(root: Path) -> list[Path]:
    return sorted({p for pattern in KEPT for p in root.glob(pattern) if p.is_file()})


def save(run: Path, record: Path, overrides: tuple[str, ...] | list[str]) -> list[str]:
    """Copy a finished run's kept files into ``record`` (replacing an older record); returns their paths."""
    if not (run / "done").exists():
        raise FileNotFoundError(f"{run} has no 'done' marker: only a finished run is recorded")
    shutil.rmtree(record, ignore_errors=True)
    names = []
    for src in _files(run):
        rel = src.relative_to(run)
        (record / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, record / rel)
        names.append(rel.as_posix())
    (record / MANIFEST).write_text(json.dumps({"overrides": list(overrides), "files": names}, indent=1) + "\n")
    return names


def restore(record: Path, run: Path, overrides: tuple[str, ...] | list[str]) -> bool:
    """Put a record of this job back into ``run``; False (nothing copied) when there is no record, it is
    incomplete, or it was made with other overrides."""
    manifest = record / MANIFEST
    if not manifest.exists():
        return False
    meta = json.loads(manifest.read_text())
    if meta["overrides"] != list(overrides) or "done" not in meta["files"] \
            or not all((record / n).is_file() for n in meta["files"]):
        return False
    shutil.rmtree(run, ignore_errors=True)  # an unfinished attempt of the same job: the record supersedes it
    for name in meta["files"]:
        (run / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(record / name, run / name)
    (run / "restored_from").write_text(str(record) + "\n")
    return True
