"""One training run of a study as a resumable subprocess, and the launchers' SIGTERM handling.

:func:`train_one` runs (or reuses) one ``python train.py algo=<a> seed=<s> ...`` in its own folder: a ``done``
marker (holding the wall time) marks a finished run, which is reused; with ``resume`` an unfinished run continues
from its epoch checkpoint (``ckpt_path=auto``), otherwise it restarts from scratch. :func:`stop_on_sigterm` makes a
launcher pass a SIGTERM or Ctrl-C on to its running jobs and start no new one. A run folder is trained by one
process at a time (:func:`held`): a second launcher on the same ``--out`` (say, one started while the first still
waits for its stopped runs to write their checkpoints) leaves a run another launcher holds to it. Used by the study
launcher (:mod:`bench.study.launch`) and the default demo's seeds (:mod:`bench.demo_seeds`).
"""
from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def finished(run: Path) -> bool:
    """Whether a run folder holds a finished run (its `done` marker and its learning curve)."""
    return (run / "done").exists() and (run / "csv/learning_curve.csv").exists()


STOPPED = 128 + signal.SIGTERM  # a run's exit status after SIGTERM (train.py: newest epoch checkpoint kept)
BUSY = -1000  # a job's rc when another launcher (or the run it started) holds the run folder: left to it
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


@contextlib.contextmanager
def tracked(proc: subprocess.Popen):
    """``proc`` (a training subprocess) gets the launcher's SIGTERM while inside (:func:`stop_on_sigterm`); one that
    starts while the launcher is stopping gets it at once."""
    _LIVE.add(proc)
    if _STOPPING.is_set():
        proc.send_signal(signal.SIGTERM)
    try:
        yield proc
    finally:
        _LIVE.discard(proc)


def stopping() -> bool:
    """Whether the launcher got SIGTERM/SIGINT (see :func:`stop_on_sigterm`)."""
    return _STOPPING.is_set()


@contextlib.contextmanager
def held(run: Path, patience: float = 2.0):
    """The exclusive lock of ``run`` (``.<name>.lock`` beside the folder, not in it: a restart from scratch deletes
    the folder): yields the open lock file, or None when another process holds it. A subprocess given the file's descriptor
    (``pass_fds``) holds the lock with it until it exits, also when the launcher that started it was killed outright
    (an ``flock`` lasts while any descriptor of it is open). A process that another of the launcher's threads has just
    forked also holds a copy of every open descriptor, this lock's too, until its exec closes them: the lock is tried
    for ``patience`` seconds before the run is left to another holder (one that trains or evaluates it holds it for
    minutes)."""
    run.parent.mkdir(parents=True, exist_ok=True)
    with open(run.parent / f".{run.name}.lock", "a") as f:
        deadline = time.monotonic() + patience
        while True:
            try:
                fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    yield None
                    return
                time.sleep(0.05)
        yield f


def run_state(r: dict) -> str:
    """One word or phrase for a finished job's line in a launcher's log."""
    if r["skipped"]:
        return "reused"
    if r["rc"] == BUSY:
        return "held by another launcher's run: left to it"
    if r["rc"] == 0:
        return "ok"
    if r["rc"] == STOPPED:
        return "stopped by SIGTERM; resumes on the next launch"
    return f"FAILED rc={r['rc']}, see {r['dir']}/bench.log"


def train_one(algo: str, seed: int, run: Path, shared: list[str], threads: int, force: bool, resume: bool = False) -> dict:
    """Run (or reuse) one training job; returns {algo, seed, dir, wall_s, rc, skipped}.

    ``resume``: an unfinished run with a checkpoint continues from it (``ckpt_path=auto``: the same epochs,
    task stream and curve as an uninterrupted run) instead of restarting, its ``bench.log`` appended to; ``wall_s``
    sums its attempts (``attempts.json``), also those whose launcher was killed (:func:`_attempts`)."""
    if finished(run) and not force:
        return _reused(algo, seed, run)
    if _STOPPING.is_set():  # the launcher is stopping: do not start another run
        return {"algo": algo, "seed": seed, "dir": str(run), "rc": STOPPED, "skipped": False, "wall_s": 0.0}
    with held(run) as lock:
        if lock is None:
            return {"algo": algo, "seed": seed, "dir": str(run), "rc": BUSY, "skipped": False, "wall_s": 0.0}
        if finished(run) and not force:  # finished by another launcher just before this one took it
            return _reused(algo, seed, run)
        return _train_held(algo, seed, run, shared, threads, force, resume, lock.fileno())


def _reused(algo: str, seed: int, run: Path) -> dict:
    return {"algo": algo, "seed": seed, "dir": str(run), "rc": 0, "skipped": True,
            "wall_s": json.loads((run / "done").read_text())["wall_s"]}


def _train_held(algo: str, seed: int, run: Path, shared: list[str], threads: int, force: bool, resume: bool,
                lock_fd: int) -> dict:
    """:func:`train_one` with the run's lock held (``lock_fd``, passed on to the training subprocess)."""
    spent = run / "attempts.json"  # the wall time of every attempt (_attempts)
    kept = resume and not force and (run / "checkpoints/last.ckpt").exists()
    if kept:
        earlier = _attempts(spent, run)
    else:
        shutil.rmtree(run, ignore_errors=True)  # a half-finished run restarts from scratch
        earlier = []
    run.mkdir(parents=True, exist_ok=True)
    extra = ["ckpt_path=auto"] if resume else []
    cmd = [sys.executable, str(REPO / "train.py"), f"algo={algo}", f"seed={seed}", f"hydra.run.dir={run}", *shared, *extra]
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
    attempt = {"start": time.time(), "end": None}  # open until this launcher sees the run end
    spent.write_text(json.dumps([*earlier, attempt]))
    with (run / "bench.log").open("a" if kept else "w") as log:  # a resumed run's log goes on after its earlier ones
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, pass_fds=(lock_fd,))
        try:
            with tracked(proc):
                rc = proc.wait()
        finally:  # interrupted (the study killed): record the time this attempt spent
            if proc.poll() is None:
                proc.kill()
            attempt["end"] = time.time()
            spent.write_text(json.dumps([*earlier, attempt]))
    attempts = [*earlier, attempt]
    wall = sum(_seconds(a) for a in attempts)
    if rc == 0:
        estimated = sum(isinstance(a, dict) and bool(a.get("estimated")) for a in attempts)
        (run / "done").write_text(json.dumps({"wall_s": wall, "cmd": cmd, "attempts": len(attempts),
                                              "estimated_attempts": estimated}))
    return {"algo": algo, "seed": seed, "dir": str(run), "rc": rc, "skipped": False, "wall_s": wall}


def _seconds(attempt: float | dict) -> float:
    """An attempt's wall seconds (an older attempts.json lists them as plain numbers)."""
    return float(attempt) if not isinstance(attempt, dict) else attempt["end"] - attempt["start"]


def _attempts(spent: Path, run: Path) -> list:
    """The earlier attempts of a run being resumed. One still open had its launcher killed outright (a session's end
    can SIGKILL it before it writes the end): its training wrote into the run folder until it died, so it ends at the
    newest file time there, marked ``estimated`` (``done`` counts such attempts in ``estimated_attempts``)."""
    attempts = json.loads(spent.read_text()) if spent.exists() else []
    for a in attempts:
        if isinstance(a, dict) and a.get("end") is None:
            times = [p.stat().st_mtime for p in run.rglob("*") if p.is_file() and p != spent]
            a["end"], a["estimated"] = max([a["start"], *times]), True
    return attempts
