"""The study's run launcher (bench.study.runs.train_one) resumes an interrupted run from its checkpoint.

A stand-in train.py (records its arguments, fails on the first attempt after writing a checkpoint) keeps this
in the fast tier; that ``ckpt_path=auto`` continues a real run exactly is tests/test_resume_crash.py's job."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from bench.study import runs as sample_efficiency

FAKE = '''import json, sys
from pathlib import Path
run = Path(next(a.split("=", 1)[1] for a in sys.argv if a.startswith("hydra.run.dir=")))
calls = run / "calls.jsonl"
with calls.open("a") as f:
    f.write(json.dumps(sys.argv[1:]) + "\\n")
(run / "checkpoints").mkdir(exist_ok=True)
(run / "checkpoints/last.ckpt").write_text("epoch")
if len(calls.read_text().splitlines()) == 1:
    sys.exit(3)  # the first attempt dies after its first checkpoint
(run / "csv").mkdir(exist_ok=True)
(run / "csv/learning_curve.csv").write_text("epoch,episodes,val_success\\n")
'''


def test_resume_continues_from_the_checkpoint_and_sums_the_attempts(tmp_path, monkeypatch):
    (tmp_path / "train.py").write_text(FAKE)
    monkeypatch.setattr(sample_efficiency, "REPO", tmp_path)
    run = tmp_path / "runs/grpo/seed0"
    first = sample_efficiency.train_one("grpo", 0, run, ["x=1"], 1, force=False, resume=True)
    assert first["rc"] == 3 and not (run / "done").exists() and (run / "checkpoints/last.ckpt").exists()
    second = sample_efficiency.train_one("grpo", 0, run, ["x=1"], 1, force=False, resume=True)
    assert second["rc"] == 0 and not second["skipped"]
    calls = [json.loads(line) for line in (run / "calls.jsonl").read_text().splitlines()]
    assert len(calls) == 2 and all(c[-1] == "ckpt_path=auto" for c in calls)  # the folder was kept, not wiped
    done = json.loads((run / "done").read_text())
    attempts = json.loads((run / "attempts.json").read_text())
    assert done["attempts"] == 2 and done["estimated_attempts"] == 0
    assert done["wall_s"] == pytest.approx(sum(a["end"] - a["start"] for a in attempts)) and done["wall_s"] > 0
    assert sample_efficiency.train_one("grpo", 0, run, ["x=1"], 1, force=False, resume=True)["skipped"]


def test_an_attempt_whose_launcher_was_killed_counts_until_its_run_last_wrote(tmp_path, monkeypatch):
    """A session's end may SIGKILL the launcher before it writes an attempt's end: the resumed run's wall time still
    counts that attempt, up to the newest file time in the run folder, and its log is kept."""
    import os
    import time

    (tmp_path / "train.py").write_text(FAKE.replace("len(calls.read_text().splitlines()) == 1", "False"))
    monkeypatch.setattr(sample_efficiency, "REPO", tmp_path)
    run = tmp_path / "runs/grpo/seed0"
    (run / "checkpoints").mkdir(parents=True)
    now = time.time()
    (run / "checkpoints/last.ckpt").write_text("epoch")
    os.utime(run / "checkpoints/last.ckpt", (now - 600, now - 600))  # the killed attempt's last write
    (run / "bench.log").write_text("the first attempt's log\n")
    os.utime(run / "bench.log", (now - 900, now - 900))
    (run / "attempts.json").write_text(json.dumps([50.0, {"start": now - 1000, "end": None}]))  # an older plain entry
    assert sample_efficiency.train_one("grpo", 0, run, ["x=1"], 1, force=False, resume=True)["rc"] == 0
    done = json.loads((run / "done").read_text())
    assert done["attempts"] == 3 and done["estimated_attempts"] == 1
    assert 50 + 400 < done["wall_s"] < 50 + 400 + 60  # 50 s, 400 s (estimated), then this attempt's few seconds
    assert (run / "bench.log").read_text().startswith("the first attempt's log\n")


def test_without_resume_an_unfinished_run_restarts_from_scratch(tmp_path, monkeypatch):
    (tmp_path / "train.py").write_text(FAKE)
    monkeypatch.setattr(sample_efficiency, "REPO", tmp_path)
    run = tmp_path / "runs/grpo/seed0"
    assert sample_efficiency.train_one("grpo", 0, run, [], 1, force=False)["rc"] == 3
    assert sample_efficiency.train_one("grpo", 0, run, [], 1, force=False)["rc"] == 3  # wiped: a first attempt again
    calls = [json.loads(line) for line in (run / "calls.jsonl").read_text().splitlines()]
    assert len(calls) == 1 and "ckpt_path=auto" not in calls[0]


SLEEPER = '''import signal, sys, time
from pathlib import Path
run = Path(next(a.split("=", 1)[1] for a in sys.argv if a.startswith("hydra.run.dir=")))
def stop(signum, frame):
    (run / "got_sigterm").write_text("1")
    sys.exit(143)
signal.signal(signal.SIGTERM, stop)
(run / "started").write_text("1")
time.sleep(120)
'''

LAUNCHER = '''import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from bench.study import runs as se
se.REPO = Path(sys.argv[2])
se.stop_on_sigterm()
runs = [Path(sys.argv[2]) / f"runs/seed{s}" for s in range(3)]
with ThreadPoolExecutor(2) as pool:  # 2 at once: the third must never start
    results = list(pool.map(lambda r: se.train_one("grpo", 0, r, [], 1, force=False, resume=True), runs))
print([(r["rc"], se.run_state(r)) for r in results], flush=True)
'''


def test_a_sigtermed_launcher_stops_its_runs_and_starts_no_more(tmp_path):
    import signal
    import subprocess
    import time

    (tmp_path / "train.py").write_text(SLEEPER)
    repo = Path(__file__).resolve().parents[1]  # the working folder: `python -c` imports bench.study from it
    proc = subprocess.Popen([sys.executable, "-c", LAUNCHER, "-", str(tmp_path)], cwd=repo, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    t0 = time.monotonic()
    while len(list(tmp_path.glob("runs/*/started"))) < 2:
        assert proc.poll() is None and time.monotonic() - t0 < 60, proc.stderr.read()
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)  # only the launcher: it must pass the stop on
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    assert sorted(p.parent.name for p in tmp_path.glob("runs/*/got_sigterm")) == ["seed0", "seed1"]
    assert not (tmp_path / "runs/seed2/started").exists()
    assert "stopped by SIGTERM" in out and "stopping 2 running job(s)" in err


HOLDER = '''import os, sys, time
from pathlib import Path
run = Path(next(a.split("=", 1)[1] for a in sys.argv if a.startswith("hydra.run.dir=")))
(run / "pid").write_text(str(os.getpid()))
if (run.parent / "quick").exists():  # a later attempt: finish at once
    (run / "csv").mkdir(exist_ok=True)
    (run / "csv/learning_curve.csv").write_text("epoch,episodes,val_success\\n")
    sys.exit(0)
(run / "checkpoints").mkdir(exist_ok=True)
(run / "checkpoints/last.ckpt").write_text("epoch")
time.sleep(120)
'''

ONE_LAUNCHER = '''import sys
from pathlib import Path
from bench.study import runs as se
se.REPO = Path(sys.argv[2])
print(se.train_one("grpo", 0, Path(sys.argv[2]) / "runs/seed0", [], 1, force=False, resume=True), flush=True)
'''


def test_a_run_another_launcher_holds_is_left_to_it_also_after_that_launcher_was_killed(tmp_path, monkeypatch):
    """Two launchers on one --out (a second started while the first still waits for its stopped runs): the second
    leaves the running run alone (its folder untouched), also once the first launcher was SIGKILLed and only its
    orphaned train.py lives on; it trains the run once that has exited."""
    import os
    import signal
    import subprocess
    import time

    (tmp_path / "train.py").write_text(HOLDER)
    monkeypatch.setattr(sample_efficiency, "REPO", tmp_path)
    run = tmp_path / "runs/seed0"
    repo = Path(__file__).resolve().parents[1]
    first = subprocess.Popen([sys.executable, "-c", ONE_LAUNCHER, "-", str(tmp_path)], cwd=repo,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    t0 = time.monotonic()
    while not (run / "checkpoints/last.ckpt").exists():
        assert first.poll() is None and time.monotonic() - t0 < 60, first.stderr.read()
        time.sleep(0.05)
    before = (run / "attempts.json").read_text()
    got = sample_efficiency.train_one("grpo", 0, run, [], 1, force=False, resume=True)
    assert got["rc"] == sample_efficiency.BUSY and "left to it" in sample_efficiency.run_state(got)
    assert (run / "attempts.json").read_text() == before  # nothing of the run was touched
    first.kill()  # the launcher only: its train.py lives on, holding the lock it was handed
    first.communicate(timeout=30)
    child = int((run / "pid").read_text())
    os.kill(child, 0)  # still alive
    assert sample_efficiency.train_one("grpo", 0, run, [], 1, force=False, resume=True)["rc"] == sample_efficiency.BUSY
    os.kill(child, signal.SIGKILL)
    t0 = time.monotonic()
    while time.monotonic() - t0 < 30:  # reaped by init (a zombie keeps no descriptor: the lock is free at once)
        try:
            os.kill(child, 0)
            time.sleep(0.05)
        except ProcessLookupError:
            break
    (run.parent / "quick").write_text("1")
    done = sample_efficiency.train_one("grpo", 0, run, [], 1, force=False, resume=True)
    assert done["rc"] == 0 and not done["skipped"] and json.loads((run / "done").read_text())["attempts"] == 2


def test_a_lock_copy_in_a_process_being_forked_is_waited_out(tmp_path):
    """With ``--jobs 2``, a process forked by the other thread holds a copy of a run's lock descriptor until its exec
    closes it; a launcher that then takes the lock (its run's final evaluation) waits that moment out instead of
    leaving its own run to a holder that does not exist. The child here keeps its copy for 0.5 s."""
    import subprocess
    import time

    run = tmp_path / "runs/seed0"
    with sample_efficiency.held(run) as mine:
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(0.5)"], pass_fds=(mine.fileno(),))
    t0 = time.monotonic()
    with sample_efficiency.held(run) as again:
        assert again is not None, "a momentary copy of the lock made the launcher give its own run away"
    assert time.monotonic() - t0 > 0.2 and child.wait(timeout=10) == 0
