"""What a run says when its outputs cannot be written, and where its held-out number comes from.

* A full disk at the adapter export: the error names the export folder and the run summary is still
  printed (marked as failed) before the error propagates.
* Too little free space for the run's outputs: a warning at start with the estimate.
* The summary names the epoch of the newest validation (it said ``nan at end`` when the last epoch
  did not validate)."""
from __future__ import annotations

import errno
import logging
import os
from collections import namedtuple

import pytest


@pytest.mark.long
def test_failed_export_names_folder_and_keeps_summary(run_train, tmp_path, monkeypatch, capsys):
    import peft

    def full(self, path, *a, **k):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(peft.PeftModel, "save_pretrained", full)
    with pytest.raises(OSError) as err:
        run_train(["trainer.max_epochs=1"], tmp_path)
    assert str(tmp_path / "csv" / "adapter") in str(err.value) and "No space left" in str(err.value)
    out = capsys.readouterr().out
    assert "=== cope-trainer run summary (the run FAILED" in out and "episodes 8," in out, out
    assert (tmp_path / "checkpoints" / "last.ckpt").is_file()  # the epoch's checkpoint was written before


@pytest.mark.long
def test_low_disk_space_warns_with_estimate(run_train, tmp_path, monkeypatch, caplog):
    import cope.run.checkpoint_io as cio

    Usage = namedtuple("Usage", "total used free")
    monkeypatch.setattr(cio.shutil, "disk_usage", lambda p: Usage(10**9, 10**9 - 1000, 1000))
    with caplog.at_level(logging.WARNING, logger="cope.run.checkpoint_io"):
        run_train(["trainer.max_epochs=1", "validate_before_fit=false"], tmp_path)
    msgs = [r.getMessage() for r in caplog.records if "free under" in r.getMessage()]
    assert msgs and "MiB" in msgs[0] and str(tmp_path) in msgs[0], caplog.text


@pytest.mark.long
def test_summary_names_the_validation_epoch(run_train, tmp_path, capsys):
    result = run_train(["trainer.max_epochs=3", "trainer.check_val_every_n_epoch=2"], tmp_path)
    assert result["val/epoch"] == 1.0  # validated after epoch index 1, not after the last (2)
    out = capsys.readouterr().out
    assert "at start -> " in out and "after epoch 1" in out and "nan" not in out, out
