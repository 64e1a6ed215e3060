"""Bad command lines fail fast through the real entry point, naming what is wrong, before a model is built.

Each case runs with a fresh, empty COPE_CACHE: no `tiny/` folder may appear in it (building the tiny model
is the first expensive step, and it comes after every config check). Key/option/path errors go through
`python train.py ...`; bad values through `cope.run.train` in-process (same code path after composition)."""
from __future__ import annotations

import time

import pytest

FAST = 45.0  # seconds: interpreter + torch/lightning import on a loaded 1-thread CPU; a model build would add more


def _run(train_script, tmp_path, args):
    cache = tmp_path / "cache"
    cache.mkdir()
    t0 = time.perf_counter()
    proc = train_script([*args, f"hydra.run.dir={tmp_path / 'run'}"], tmp_path, timeout=120, env={"COPE_CACHE": str(cache)})
    wall = time.perf_counter() - t0
    report = f"exit {proc.returncode} after {wall:.1f}s\n--- stderr ---\n{proc.stderr[-4000:]}"
    assert proc.returncode != 0, report
    assert wall < FAST, report
    assert not (cache / "tiny").exists(), "the tiny model was built before the config error surfaced\n" + report
    return proc, report


@pytest.mark.parametrize("override, key", [
    ("trainer.max_epoch=3", "trainer.max_epoch"),
    ("data.group_sise=4", "data.group_sise"),
])
def test_mistyped_key(train_script, tmp_path, override, key):
    proc, report = _run(train_script, tmp_path, ["debug=fast", override])
    assert key in proc.stderr, report
    assert "not in struct" in proc.stderr, report


@pytest.mark.parametrize("override, group, option", [("algo=nope", "algo", "nope"), ("env=nope", "env", "nope")])
def test_unknown_group_option(train_script, tmp_path, override, group, option):
    proc, report = _run(train_script, tmp_path, ["debug=fast", override])
    assert f"'{group}/{option}'" in proc.stderr, report
    assert f"Available options in '{group}'" in proc.stderr, report


@pytest.mark.parametrize("override, key, value", [
    ("data.group_size=0", "data.group_size", "0"),
    ("algo.advantage_mode=bogus", "advantage_mode", "bogus"),
])
def test_bad_value(run_train, tmp_path, monkeypatch, override, key, value):
    # in-process (the entry point prints the same exception): saves an interpreter start per case
    cache = tmp_path / "cache"
    monkeypatch.setenv("COPE_CACHE", str(cache))
    import lightning.pytorch  # noqa: F401  (import time is not what is measured)

    t0 = time.perf_counter()
    with pytest.raises(Exception) as err:
        run_train([override], tmp_path)
    msg = f"{type(err.value).__name__}: {err.value}"
    assert key in msg and value in msg, msg
    assert "ValueError" in msg, msg
    assert time.perf_counter() - t0 < 10, "the error came late"
    assert not (cache / "tiny").exists(), "the tiny model was built before the config error surfaced"


def test_missing_model_path(train_script, tmp_path):
    # no debug=fast here: it sets tiny-model sizes (model.hidden_size, ...) that a pretrained model does not take
    proc, report = _run(train_script, tmp_path, ["model=qwen2.5-7b", "model.path=/nonexistent/dir"])
    assert "FileNotFoundError" in proc.stderr, report
    assert "model.path" in proc.stderr and "/nonexistent/dir" in proc.stderr, report
