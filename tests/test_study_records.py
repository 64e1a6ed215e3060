"""The study's committed run records (bench.study.records): a fresh checkout, which has no run folders,
resumes the study from them instead of rerunning finished jobs; a record of other overrides is not reused."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.study import launch as study
from bench.study import records as study_records
from bench.study import runs as sample_efficiency

FAKE = '''import json, sys
from pathlib import Path
run = Path(next(a.split("=", 1)[1] for a in sys.argv if a.startswith("hydra.run.dir=")))
with (run.parents[5] / "calls.jsonl").open("a") as f:
    f.write(json.dumps(sys.argv[1:]) + "\\n")
(run / "csv/val_episodes").mkdir(parents=True)
(run / "csv/learning_curve.csv").write_text("epoch,episodes,val_success\\n1,8,0.5\\n")
(run / "csv/learning_curve_train.csv").write_text("epoch,episodes\\n0,4\\n1,8\\n")
(run / "csv/metrics.csv").write_text("step,grad/cos\\n0,0.1\\n")
(run / "csv/val_episodes/episodes8.csv").write_text("task,success\\n0,1\\n")
(run / "checkpoints").mkdir()
(run / "checkpoints/last.ckpt").write_text("big, not recorded")
'''


def _jobs(lr: str = "1e-3") -> list[study.Job]:
    ov = ("trainer.max_epochs=2", f"module.optimizer.lr={lr}")
    return [study.Job("prior", "test", "grpo", "lr", s, ov) for s in (0, 1)]


def _calls(root: Path) -> int:
    f = root / "calls.jsonl"
    return len(f.read_text().splitlines()) if f.exists() else 0


def test_a_fresh_checkout_restores_finished_runs_instead_of_rerunning(tmp_path, monkeypatch):
    (tmp_path / "train.py").write_text(FAKE)
    monkeypatch.setattr(sample_efficiency, "REPO", tmp_path)
    out, records = tmp_path / "out", tmp_path / "records"
    first = study.run_jobs(_jobs(), out, 2, 1, records)
    assert [r["rc"] for r in first] == [0, 0] and _calls(tmp_path) == 2
    rec = _jobs()[0].dir(records)
    manifest = json.loads((rec / "record.json").read_text())
    assert "csv/val_episodes/episodes8.csv" in manifest["files"] and "done" in manifest["files"]
    assert not (rec / "checkpoints").exists()  # checkpoints stay out of the record

    import shutil
    shutil.rmtree(out)  # a new checkout: no run folders, only the committed records
    again = study.run_jobs(_jobs(), out, 2, 1, records)
    assert [r["rc"] for r in again] == [0, 0] and all(r["skipped"] for r in again)
    assert _calls(tmp_path) == 2  # nothing ran again
    run = _jobs()[1].dir(out)
    assert (run / "csv/learning_curve.csv").read_text() == "epoch,episodes,val_success\n1,8,0.5\n"
    assert (run / "restored_from").exists() and study._complete(run, _jobs()[1].overrides)


def test_a_record_of_other_overrides_is_not_reused(tmp_path, monkeypatch):
    (tmp_path / "train.py").write_text(FAKE)
    monkeypatch.setattr(sample_efficiency, "REPO", tmp_path)
    out, records = tmp_path / "out", tmp_path / "records"
    study.run_jobs(_jobs("1e-3"), out, 1, 1, records)
    import shutil
    shutil.rmtree(out)
    changed = study.run_jobs(_jobs("3e-3"), out, 1, 1, records)  # the design changed: same folder, new overrides
    assert all(not r["skipped"] for r in changed) and _calls(tmp_path) == 4
    meta = json.loads((_jobs()[0].dir(records) / "record.json").read_text())
    assert meta["overrides"][-1] == "module.optimizer.lr=3e-3"  # the new run replaced the record


def test_an_unfinished_run_is_not_recorded_and_a_broken_record_is_ignored(tmp_path):
    run, rec = tmp_path / "run", tmp_path / "rec"
    (run / "csv").mkdir(parents=True)
    try:
        study_records.save(run, rec, ["a=1"])
        raise AssertionError("an unfinished run was recorded")
    except FileNotFoundError as e:
        assert "done" in str(e)
    (run / "done").write_text("{}")
    (run / "csv/metrics.csv").write_text("x\n")
    assert study_records.save(run, rec, ["a=1"]) == ["csv/metrics.csv", "done"]
    (rec / "csv/metrics.csv").unlink()  # a record missing a file it lists
    assert not study_records.restore(rec, tmp_path / "fresh", ["a=1"]) and not (tmp_path / "fresh").exists()


def test_the_default_records_folder_is_committed_not_ignored():
    import shutil
    import subprocess

    repo = Path(__file__).resolve().parents[1]
    if shutil.which("git") is None or not (repo / ".git").exists():
        pytest.skip("not a git checkout")
    probe = "bench/results/study/runs/prior/test/grpo/lr3e-3/seed0/csv/metrics.csv"
    r = subprocess.run(["git", "check-ignore", "-q", probe], cwd=repo)
    assert r.returncode == 1, f"{probe} is git-ignored: the study's records would not be committed"


def test_a_restored_run_is_never_saved_back_over_its_record(tmp_path, monkeypatch):
    """A record can hold more than a run folder does (a reused run's ``reused.json``): the launches after the one
    that restored it leave it as committed."""
    (tmp_path / "train.py").write_text(FAKE)
    monkeypatch.setattr(sample_efficiency, "REPO", tmp_path)
    out, records = tmp_path / "out", tmp_path / "records"
    study.run_jobs(_jobs(), out, 1, 1, records)
    rec = _jobs()[0].dir(records)
    (rec / "reused.json").write_text('{"from": "an earlier study"}\n')
    import shutil
    shutil.rmtree(out)
    for _ in range(2):  # the launch that restores it, then one that finds the restored folder
        assert all(r["skipped"] for r in study.run_jobs(_jobs(), out, 1, 1, records))
    assert (rec / "reused.json").read_text() == '{"from": "an earlier study"}\n' and _calls(tmp_path) == 2


def test_a_fresh_checkout_trains_only_the_prerequisites_of_unfinished_runs(tmp_path, monkeypatch):
    """GRPO on SFT seed 0 is recorded, seed 1 is not: on a fresh checkout seed 0's SFT run is not trained again (its
    adapter is needed by nothing), seed 1's is."""
    from bench.study import stages
    (tmp_path / "train.py").write_text(FAKE)
    monkeypatch.setattr(sample_efficiency, "REPO", tmp_path)
    out, records = tmp_path / "out", tmp_path / "records"
    ov = ("trainer.max_epochs=2",)
    tests = [study.Job("baselines", "test", "grpo_sft", "lr", s, ov) for s in (0, 1)]
    pre = stages.prerequisites(tests, study.Job, lambda r: ov, smoke=True)
    study.run_jobs(stages.with_adapters(tests[:1], pre, out), out, 1, 1, records)  # seed 0's test run, recorded
    import shutil
    shutil.rmtree(out)  # a new checkout: seed 0 only as a record
    tests = stages.with_adapters(tests, pre, out)
    study._restore(tests, out, records)
    before = _calls(tmp_path)
    results = stages.run_prerequisites(pre, tests, out, 1)
    assert _calls(tmp_path) == before + 1  # seed 1's SFT only
    assert [r["skipped"] for r in results] == [True, False] and all(r["rc"] == 0 for r in results)
    assert not pre[0].dir(out).exists() and (pre[1].dir(out) / "done").exists()


def test_every_reused_record_is_its_source_s_record_byte_for_byte():
    """A committed record with ``reused.json`` (study5's GRPO and ECHO, study4's runs) holds exactly the files of the
    record it names, so the report reads the earlier study's run and nothing else."""
    repo = Path(__file__).resolve().parents[1]
    reused = sorted((repo / "bench/results").glob("*/runs/**/reused.json"))
    assert len(reused) >= 10
    for marker in reused:
        rec, src = marker.parent, repo / json.loads(marker.read_text())["from"]
        files = json.loads((rec / "record.json").read_text())["files"]
        assert files == json.loads((src / "record.json").read_text())["files"], rec
        for name in files:
            assert (rec / name).read_bytes() == (src / name).read_bytes(), f"{rec / name} differs from {src / name}"


def test_seeds_limits_the_runs_and_an_unknown_seed_is_refused(tmp_path, capsys):
    """``--seeds``: only those test seeds' runs (here restored from study5's committed records) are reported; a seed the
    regime does not have fails before any work, naming the flag."""
    repo = Path(__file__).resolve().parents[1]
    common = ["--regimes", "baselines", "--arms", "grpo", "echo", "--report", "--out", str(tmp_path / "out"),
              "--records", str(repo / "bench/results/study5/runs"), "--results", str(tmp_path / "res")]
    assert study.main([*common, "--seeds", "1", "3"]) == 0
    test = json.loads((tmp_path / "res/study.json").read_text())["test"]["baselines"]
    assert {a: r["seeds"] for a, r in test.items()} == {"grpo": [1, 3], "echo": [1, 3]}
    assert sorted(p.name for p in (tmp_path / "out/baselines/test/grpo/lr1e-3").iterdir()) == ["seed1", "seed3"]
    with pytest.raises(SystemExit):
        study.main([*common, "--seeds", "7"])
    assert "--seeds [7]: regime baselines has test seeds [0, 1, 2, 3, 4]" in capsys.readouterr().err
