"""Checkpoint files: atomic writes, a full disk, damaged files, and what ``ckpt_path`` accepts.

The run-level guarantees (a checkpoint after every epoch, exact resume after SIGKILL) are in
tests/test_resume_crash.py (slow tier) and tests/test_resume.py."""
from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from cope.run.checkpoint_io import (
    AtomicCheckpointIO,
    CheckpointReadError,
    CheckpointWriteError,
    estimate_output_bytes,
    read_checkpoint,
)
from cope.run.train import resolve_ckpt_path


def _ckpt(v: float) -> dict:
    return {"state_dict": {"w": torch.full((4,), v)}, "epoch": int(v)}


def test_save_and_load_roundtrip(tmp_path):
    io_ = AtomicCheckpointIO()
    io_.save_checkpoint(_ckpt(1.0), tmp_path / "c" / "last.ckpt")
    got = io_.load_checkpoint(tmp_path / "c" / "last.ckpt")
    assert torch.equal(got["state_dict"]["w"], torch.ones(4)) and got["epoch"] == 1
    assert [p.name for p in (tmp_path / "c").iterdir()] == ["last.ckpt"]  # no temp file left


@pytest.mark.long
def test_sigkill_during_write_keeps_previous_checkpoint(tmp_path):
    """A process killed while writing a new checkpoint (data on disk, not yet renamed) leaves the old one."""
    target = tmp_path / "last.ckpt"
    AtomicCheckpointIO().save_checkpoint(_ckpt(1.0), target)
    before = target.read_bytes()
    script = textwrap.dedent(f"""
        import os, time, torch
        from cope.run.checkpoint_io import AtomicCheckpointIO
        real = os.fsync
        def slow(fd):
            real(fd); print("writing", flush=True); time.sleep(60)
        os.fsync = slow
        AtomicCheckpointIO().save_checkpoint({{"state_dict": {{"w": torch.zeros(1 << 20)}}, "epoch": 2}}, {str(target)!r})
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "writing"
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    assert target.read_bytes() == before
    assert read_checkpoint(target)["epoch"] == 1
    leftovers = [p for p in tmp_path.iterdir() if p.name != "last.ckpt"]
    assert leftovers, "the killed write should have left its temp file (the next save removes it)"
    AtomicCheckpointIO().save_checkpoint(_ckpt(3.0), target)
    assert [p.name for p in tmp_path.iterdir()] == ["last.ckpt"] and read_checkpoint(target)["epoch"] == 3


def test_full_disk_names_the_file_and_keeps_previous(tmp_path, monkeypatch):
    target = tmp_path / "last.ckpt"
    AtomicCheckpointIO().save_checkpoint(_ckpt(1.0), target)
    real_open = open

    class Full:
        def __init__(self, f):
            self.f = f

        def __enter__(self):
            return self

        def __exit__(self, *a):
            self.f.close()

        def write(self, data):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    def fake_open(path, mode="r", *a, **k):
        f = real_open(path, mode, *a, **k)
        return Full(f) if "w" in mode and ".tmp-" in str(path) else f

    monkeypatch.setattr("builtins.open", fake_open)
    with pytest.raises(CheckpointWriteError) as err:
        AtomicCheckpointIO().save_checkpoint(_ckpt(2.0), target)
    monkeypatch.undo()
    assert str(target) in str(err.value) and "No space left" in str(err.value)
    assert err.value.errno == errno.ENOSPC
    assert read_checkpoint(target)["epoch"] == 1
    assert [p.name for p in tmp_path.iterdir()] == ["last.ckpt"]


@pytest.mark.parametrize("content, what", [
    (b"", "empty (0 bytes)"),
    (b"\x00garbage" * 100, "not a torch checkpoint archive"),
])
def test_damaged_file_one_clear_message(tmp_path, content, what):
    bad = tmp_path / "last.ckpt"
    bad.write_bytes(content)
    for load in (read_checkpoint, AtomicCheckpointIO().load_checkpoint):
        with pytest.raises(CheckpointReadError) as err:
            load(bad)
        msg = str(err.value)
        assert str(bad) in msg and what in msg, msg
        assert "weights_only=False" not in msg and "weights_only" not in msg, msg


def test_truncated_checkpoint(tmp_path):
    good = tmp_path / "good.ckpt"
    torch.save(_ckpt(1.0), good)
    bad = tmp_path / "bad.ckpt"
    bad.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    with pytest.raises(CheckpointReadError) as err:
        read_checkpoint(bad)
    assert str(bad) in str(err.value) and "weights_only" not in str(err.value)


def test_pickled_objects_are_refused_without_the_unsafe_advice(tmp_path):
    evil = tmp_path / "evil.ckpt"
    torch.save({"state_dict": {}, "obj": Path("/x")}, evil)  # not a tensor/plain container: refused by weights_only
    with pytest.raises(CheckpointReadError) as err:
        read_checkpoint(evil)
    assert str(evil) in str(err.value) and "weights_only" not in str(err.value)


def test_ckpt_path_values(tmp_path):
    ckdir = tmp_path / "checkpoints"
    assert resolve_ckpt_path(None, ckdir) is None
    assert resolve_ckpt_path("auto", ckdir) is None  # nothing to resume: a fresh start
    with pytest.raises(FileNotFoundError, match="ckpt_path=last: there is no checkpoint at"):
        resolve_ckpt_path("last", ckdir)
    with pytest.raises(FileNotFoundError, match="no such checkpoint file"):
        resolve_ckpt_path(str(tmp_path / "nope.ckpt"), ckdir)
    AtomicCheckpointIO().save_checkpoint(_ckpt(1.0), ckdir / "last.ckpt")
    assert resolve_ckpt_path("last", ckdir) == resolve_ckpt_path("auto", ckdir) == str(ckdir / "last.ckpt")
    (ckdir / "last.ckpt").write_bytes(b"")
    with pytest.raises(CheckpointReadError, match="empty"):
        resolve_ckpt_path("last", ckdir)


@pytest.mark.long
@pytest.mark.parametrize("args, expect", [
    (["ckpt_path=last"], "ckpt_path=last: there is no checkpoint at"),
    (["ckpt_path=DAMAGED"], "is empty (0 bytes)"),
])
def test_entry_point_refuses_before_any_model_is_built(train_script, tmp_path, args, expect):
    (tmp_path / "damaged.ckpt").write_bytes(b"")
    args = [a.replace("DAMAGED", str(tmp_path / "damaged.ckpt")) for a in args]
    cache = tmp_path / "cache"
    t0 = time.perf_counter()
    proc = train_script(["debug=fast", *args, f"hydra.run.dir={tmp_path / 'run'}"], tmp_path, timeout=120,
                        env={"COPE_CACHE": str(cache)})
    assert proc.returncode != 0 and expect in proc.stderr, proc.stderr[-3000:]
    assert "weights_only" not in proc.stderr
    assert not (cache / "tiny").exists(), "the model was built before the checkpoint error"
    assert time.perf_counter() - t0 < 60


def test_output_estimate_grows_with_the_adapter():
    # two checkpoints (old + new during the atomic write) of weights + 2 AdamW moments, plus the export
    assert estimate_output_bytes(10**6) - estimate_output_bytes(0) == 2 * 12 * 10**6 + 4 * 10**6
