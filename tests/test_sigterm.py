"""SIGTERM ends a run as interrupted: exit status 143, the newest epoch checkpoint kept, resumable.

Before: Lightning's ``SIGTERMException`` is a ``SystemExit`` without a code, so ``train.py`` exited 0
after a SIGTERM mid-run (a study launcher counted a 4-of-20-epoch run as finished), and a SIGTERM during
the pre-fit validation was forgotten (Lightning resets its flag when ``fit`` starts) and the run trained on.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import TRAIN_PY

from cope.run.preemption import EXIT_SIGTERM, SigtermGuard


def _ckpt_epoch(path: Path) -> int | None:
    try:
        return int(torch.load(path, map_location="cpu", weights_only=True)["epoch"])
    except Exception:  # noqa: BLE001 - not written yet, or mid-rename
        return None


def _last_train_epoch(run: Path) -> int:
    lines = (run / "csv/learning_curve_train.csv").read_text().splitlines()
    return int(lines[-1].split(",")[0])


@pytest.mark.long
def test_sigterm_mid_fit_exits_143_and_resumes(tmp_path):
    run = tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    cmd = [sys.executable, str(TRAIN_PY), "debug=fast", "trainer.max_epochs=500", f"hydra.run.dir={run}"]
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    ckpt = run / "checkpoints/last.ckpt"
    try:
        t0 = time.monotonic()
        while (_ckpt_epoch(ckpt) if ckpt.exists() else None) is None or _ckpt_epoch(ckpt) < 1:
            assert proc.poll() is None, proc.stdout.read()[-3000:]
            assert time.monotonic() - t0 < 300, "no checkpoint of epoch 1 in time"
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == EXIT_SIGTERM, out[-3000:]
    assert "INTERRUPTED by SIGTERM" in out and "ckpt_path=auto" in out, out[-3000:]
    saved = _ckpt_epoch(ckpt)
    assert saved is not None and 1 <= saved < 499  # stopped early, the newest finished epoch on disk

    resumed = subprocess.run([*cmd[:-2], f"trainer.max_epochs={saved + 3}", "ckpt_path=auto", f"hydra.run.dir={run}"],
                             cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert _last_train_epoch(run) == saved + 2  # continued from the checkpoint, not from scratch or past it
    assert _ckpt_epoch(ckpt) == saved + 2


@pytest.mark.long
def test_sigterm_during_prefit_validation_does_not_start_training(compose, tmp_path, monkeypatch):
    import lightning.pytorch as pl

    from cope.run.train import train

    validate = pl.Trainer.validate

    def validate_then_sigterm(self, *a, **k):
        os.kill(os.getpid(), signal.SIGTERM)  # arrives before Lightning registers its own handler for the stage
        return validate(self, *a, **k)

    monkeypatch.setattr(pl.Trainer, "validate", validate_then_sigterm)
    fit_called = []
    monkeypatch.setattr(pl.Trainer, "fit", lambda self, *a, **k: fit_called.append(1))
    outer = []  # without the guard this handler would get the signal (and the run would go on into fit)
    previous = signal.signal(signal.SIGTERM, lambda s, f: outer.append(s))
    try:
        mine = signal.getsignal(signal.SIGTERM)
        with pytest.raises(SystemExit) as exc:
            train(compose(["trainer.max_epochs=3"], tmp_path))
        assert signal.getsignal(signal.SIGTERM) is mine  # the guard put the previous handler back
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert exc.value.code == EXIT_SIGTERM
    assert not fit_called and not outer


def test_guard_chains_and_restores_the_previous_handler():
    seen = []
    previous = signal.signal(signal.SIGTERM, lambda s, f: seen.append(s))
    try:
        mine = signal.getsignal(signal.SIGTERM)
        with SigtermGuard() as guard:
            signal.raise_signal(signal.SIGTERM)
            assert guard.received
        assert signal.getsignal(signal.SIGTERM) is mine
        assert not seen  # recorded by the guard, not passed on: the run decides when to stop
    finally:
        signal.signal(signal.SIGTERM, previous)


@pytest.mark.long
def test_sigterm_during_a_rollout_stops_it_at_the_next_turn(compose, tmp_path, monkeypatch):
    """A rollout at 7B can outlast a scheduler's grace period: the run stops at the next turn, not after it."""
    import lightning.pytorch as pl

    from cope.envs.maze import MazeEnv
    from cope.run.train import train

    step, fit = MazeEnv.step, pl.Trainer.fit
    calls = {"n": 0, "at_signal": None, "fitting": False}

    def step_then_sigterm(self, action):  # counts the training rollout's steps only (not the warm-start build's)
        calls["n"] += calls["fitting"]
        if calls["n"] == 5 and calls["at_signal"] is None:
            calls["at_signal"] = calls["n"]
            os.kill(os.getpid(), signal.SIGTERM)
        return step(self, action)

    def fitting(self, *a, **k):
        calls["fitting"] = True
        return fit(self, *a, **k)

    monkeypatch.setattr(MazeEnv, "step", step_then_sigterm)
    monkeypatch.setattr(pl.Trainer, "fit", fitting)
    previous = signal.getsignal(signal.SIGTERM)
    try:
        with pytest.raises(SystemExit) as exc:
            train(compose(["validate_before_fit=false", "trainer.max_epochs=3"], tmp_path))
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert exc.value.code == EXIT_SIGTERM
    # the turn in progress finishes (at most one step per live episode: 2 tasks x 4), the rest of the epoch does not
    assert calls["n"] - calls["at_signal"] <= 8, calls
    assert not (tmp_path / "checkpoints/last.ckpt").exists()
