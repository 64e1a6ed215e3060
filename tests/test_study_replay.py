"""bench.study.replay: a recorded run whose checkpoint is gone is run again from its own command, and its replay's final
checkpoint is evaluated only when the replay's curves and metrics equal the record's row for row."""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest

from bench.study import final_eval, replay
from bench.study.launch import Job
from bench.study.markdown import markdown
from bench.study.records import restore
from bench.study.report import summarize

CURVE = "epoch,episodes,val_success\n0,8,0.25\n1,16,0.5\n"
TRAIN = "epoch,episodes\n0,8\n1,16\n"
METRICS = "epoch,step,loss/total,perf/rollout_seconds\n0,1,0.5,3.2\n1,2,0.25,2.9\n"
# the replay's train.py: writes the curves it finds in the repo's "replay_writes" folder, logs its argv
FAKE_TRAIN = '''import json, shutil, sys
from pathlib import Path
repo = Path(__file__).parent
with (repo / "trains.jsonl").open("a") as f:
    f.write(json.dumps(sys.argv) + "\\n")
run = Path(next(a.split("=", 1)[1] for a in sys.argv if a.startswith("hydra.run.dir=")))
shutil.copytree(repo / "replay_writes", run / "csv", dirs_exist_ok=True)
(run / "checkpoints").mkdir(exist_ok=True)
(run / "checkpoints/last.ckpt").write_text("adapter")
'''
FAKE_EVAL = '''import json, sys
from pathlib import Path
args = dict(a.split("=", 1) for a in sys.argv[1:] if "=" in a)
out = Path(args["eval.out"])
out.mkdir(parents=True, exist_ok=True)
with (Path(__file__).parent / "evals.jsonl").open("a") as f:
    f.write(json.dumps(sys.argv[1:]) + "\\n")
n = int(args["eval.count"])
(out / "episodes.csv").write_text("index,success\\n" + "".join(f"{i},{i % 4 == 0:d}\\n" for i in range(n)))
(out / "summary.json").write_text(json.dumps({"tasks": n, "complete": True, "success": 0.25}))
'''


def _setup(tmp_path: Path) -> tuple[Path, Path]:
    """A record of a finished test run (made under another interpreter and folder) and a repo with fake scripts."""
    record = tmp_path / "results/runs/smollm2/test/grpo/lr1e-3/seed0"
    files = {"csv/learning_curve.csv": CURVE, "csv/learning_curve_train.csv": TRAIN, "csv/metrics.csv": METRICS}
    for name, text in files.items():
        (record / name).parent.mkdir(parents=True, exist_ok=True)
        (record / name).write_text(text)
    cmd = ["/old/venv/bin/python", "/old/wt/train.py", "algo=grpo", "seed=0", "hydra.run.dir=/old/out/seed0",
           "trainer.max_epochs=2", "data.val_batch_size=4", "ckpt_path=auto"]
    (record / "done").write_text(json.dumps({"wall_s": 10.0, "cmd": cmd}))
    (record / "record.json").write_text(json.dumps({"overrides": cmd[4:7], "files": [*sorted(files), "done"]}))
    repo = tmp_path / "wt"
    (repo / "replay_writes").mkdir(parents=True)
    (repo / "train.py").write_text(FAKE_TRAIN)
    (repo / "eval.py").write_text(FAKE_EVAL)
    for name, text in files.items():
        (repo / "replay_writes" / Path(name).name).write_text(text.replace("3.2", "4.7"))  # only a timing differs
    return record, repo


def _calls(repo: Path, name: str) -> list[list[str]]:
    path = repo / name
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def test_an_identical_replay_is_evaluated_and_its_evaluation_added_to_the_record(tmp_path, monkeypatch):
    monkeypatch.setattr(replay, "stop_on_sigterm", lambda: None)  # pytest keeps its own signal handlers
    record, repo = _setup(tmp_path)
    out = tmp_path / "replays"
    argv = [str(record), "--python", sys.executable, "--repo", str(repo), "--out", str(out), "--count", "8"]
    assert replay.main(argv) == 0
    (train,) = _calls(repo, "trains.jsonl")
    run = out / "smollm2/test/grpo/lr1e-3/seed0"
    assert train == [str(repo / "train.py"), "algo=grpo", "seed=0", "trainer.max_epochs=2", "data.val_batch_size=4",
                         "ckpt_path=auto", f"hydra.run.dir={run}"]  # the record's command, in the replay's folder
    (ev,) = _calls(repo, "evals.jsonl")
    assert ev[:2] == ["algo=grpo", "seed=0"] and f"ckpt_path={run}/checkpoints/last.ckpt" in ev and "eval.batch_size=4" in ev
    manifest = json.loads((record / "record.json").read_text())
    assert {"eval8/summary.json", "eval8/episodes.csv", "replay.json"} <= set(manifest["files"])
    assert final_eval.read(record) == {"tasks": 8, "success": 0.25, "replayed": True}

    assert replay.main(argv) == 0 and len(_calls(repo, "trains.jsonl")) == 1  # evaluated: skipped, nothing run again
    restored = tmp_path / "fresh/seed0"  # a fresh checkout's launcher restores the evaluation with the record
    assert restore(record, restored, manifest["overrides"])
    results = [{"rc": 0, "dir": str(restored), "job": Job("smollm2", "test", "grpo", "lr1e-3", 0)}]
    row = final_eval.summarize(results)["smollm2"]["grpo"]
    assert row["replayed"] == [0] and row["runs"] == {0: 0.25}
    info = {"title": "t", "threshold": 0.4, "overrides": [], "arm_overrides": {}, "tuned_in": None, "by_size": None,
            "budget": [], "panels": {"tune": [], "test": []}, "seeds": {"tune": [100], "test": [0]}, "final_eval": 8}
    meta = {"regimes": {"smollm2": info}, "choice": {}, "common": []}
    (restored / "csv/learning_curve.csv").write_text("epoch,episodes,env_steps,val_success\n0,8,50,0.25\n")
    assert "Evaluated on a replay (GRPO seed 0)" in markdown(summarize(results, meta), meta)


def test_a_replay_that_differs_from_its_record_adds_nothing(tmp_path):
    record, repo = _setup(tmp_path)
    (repo / "replay_writes/metrics.csv").write_text(METRICS.replace("0.25,2.9", "0.26,2.9"))
    before = (record / "record.json").read_text()
    rc, what = replay.replay(record, tmp_path / "r", sys.executable, repo, 8, 1)
    assert rc == 1 and "csv/metrics.csv row 1: loss/total 0.25 (record) != 0.26 (replay)" in what
    assert not _calls(repo, "evals.jsonl") and (record / "record.json").read_text() == before
    assert not (record / "replay.json").exists() and final_eval.read(record)["reason"]


def test_a_replay_stopped_before_its_last_epoch_resumes_on_the_next_call(tmp_path):
    """train.py stopped by SIGTERM exits 0 after fewer epochs: no done marker, no comparison, no evaluation."""
    record, repo = _setup(tmp_path)
    (repo / "replay_writes/learning_curve_train.csv").write_text("epoch,episodes\n0,8\n")
    rc, what = replay.replay(record, tmp_path / "r", sys.executable, repo, 8, 1)
    assert rc == replay.INCOMPLETE and "rerun" in what and not (tmp_path / "r/done").exists()
    (repo / "replay_writes/learning_curve_train.csv").write_text(TRAIN)
    rc, what = replay.replay(record, tmp_path / "r", sys.executable, repo, 8, 1)
    assert rc == 0 and len(_calls(repo, "trains.jsonl")) == 2 and "attached" in what


def test_float_rounding_passes_and_a_count_or_a_larger_difference_does_not(tmp_path):
    """Another machine rounds floats differently: a loss within RTOL is the same run; a count is compared exactly."""
    record, repo = _setup(tmp_path)
    (repo / "replay_writes/metrics.csv").write_text(METRICS.replace("0.25,2.9", "0.2500001,2.9"))
    rc, what = replay.replay(record, tmp_path / "a", sys.executable, repo, 8, 1)
    assert rc == 0 and "within 1.0e-07" in what
    assert json.loads((record / "replay.json").read_text())["largest_relative_deviation"] == pytest.approx(1e-7)
    record2, repo2 = _setup(tmp_path / "2")
    (repo2 / "replay_writes/learning_curve_train.csv").write_text(TRAIN.replace("1,16", "1,17"))
    rc, what = replay.replay(record2, tmp_path / "b", sys.executable, repo2, 8, 1)
    assert rc == 1 and "episodes 16 (record) != 17 (replay)" in what


def test_a_replay_that_departs_from_its_record_is_stopped_while_it_trains(tmp_path):
    """Hours of training saved: the replay's first rows already differ, so it is stopped, not run to its end."""
    record, repo = _setup(tmp_path)
    (repo / "replay_writes/metrics.csv").write_text(METRICS.replace("0,1,0.5", "0,1,0.6") + "1,2,0.25,2.9\n")
    (repo / "train.py").write_text(FAKE_TRAIN + "import time\ntime.sleep(120)\n")
    t0 = time.monotonic()
    rc, what = replay.replay(record, tmp_path / "r", sys.executable, repo, 8, 1, poll=0.2)
    assert rc == 1 and "stopped" in what and "row 0: loss/total 0.5 (record) != 0.6 (replay)" in what
    assert time.monotonic() - t0 < 60 and not _calls(repo, "evals.jsonl")
