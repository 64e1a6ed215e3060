"""ValidationEpisodes: one CSV of per-task held-out outcomes per validation run."""
import csv
from types import SimpleNamespace

import pytest

from cope.callbacks.val_episodes import COLUMNS, ValidationEpisodes
from cope.envs.base import Task
from cope.episode import Episode, Step
from cope.records import ValidationRecord


def _episode(index: int, success: bool, valid: tuple[bool, ...]) -> Episode:
    e = Episode(task=Task("maze", "test", index), group=0, success=success, score=float(success), reward=float(success),
                end_reason="done" if success else "max_steps")
    e.steps = [Step(action_start=0, action_end=1, closed=True, valid=v, action_text="north") for v in valid]
    return e


def _trainer(tmp_path, episodes, n, **kw):
    dm = SimpleNamespace(val_record=ValidationRecord(epoch=0, episodes=episodes), counters={"episodes": n})
    return SimpleNamespace(**{"log_dir": str(tmp_path), "default_root_dir": str(tmp_path), "datamodule": dm,
                              "sanity_checking": False, "global_rank": 0, "world_size": 1, **kw})


def _read(path):
    with path.open() as f:
        return list(csv.DictReader(f))


def test_rows_per_task_sorted_one_file_per_validation(tmp_path):
    cb = ValidationEpisodes()
    eps = [_episode(3, False, (True, False, False)), _episode(1, True, (True, True))]
    cb.on_validation_end(_trainer(tmp_path, eps, 0, sanity_checking=True), None)
    assert not (tmp_path / "val_episodes").exists()  # the sanity check is not a measurement
    cb.on_validation_end(_trainer(tmp_path, eps, 0), None)
    cb.on_validation_end(_trainer(tmp_path, eps[:1], 64), None)
    rows = _read(tmp_path / "val_episodes/episodes0.csv")
    assert list(rows[0]) == COLUMNS
    assert [(r["index"], r["success"], r["steps"], r["invalid"], r["end_reason"]) for r in rows] == [
        ("1", "1", "2", "0", "done"), ("3", "0", "3", "2", "max_steps")]
    assert [r["index"] for r in _read(tmp_path / "val_episodes/episodes64.csv")] == ["3"]
    cb.on_validation_end(_trainer(tmp_path, eps, 64, global_rank=1, world_size=2), None)
    assert len(_read(tmp_path / "val_episodes/episodes64_rank1.csv")) == 2


@pytest.mark.parametrize("bad", ["", "a/b", None])
def test_rejects_bad_dirname(bad):
    with pytest.raises(ValueError, match="dirname"):
        ValidationEpisodes(dirname=bad)


@pytest.mark.long
def test_real_run_files_match_the_learning_curve(run_train, tmp_path):
    run_train(["trainer.max_epochs=2", "data.val_tasks=8"], tmp_path)
    [curve_csv] = tmp_path.rglob("learning_curve.csv")  # both live in the logger's folder
    curve = _read(curve_csv)
    assert len(curve) == 3  # before training, after epochs 0 and 1
    for point in curve:
        rows = _read(curve_csv.parent / f"val_episodes/episodes{point['episodes']}.csv")
        assert sorted(int(r["index"]) for r in rows) == list(range(8))
        assert sum(int(r["success"]) for r in rows) / 8 == pytest.approx(float(point["val_success"]))
