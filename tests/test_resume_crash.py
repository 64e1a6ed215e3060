"""A run killed with SIGKILL at a random moment after its second epoch, then resumed with ``ckpt_path=last``,
ends exactly where the same run ends uninterrupted: same counters, same metrics rows (none duplicated,
none lost), same trajectories and learning-curve files, same final adapter bit for bit (CPU, one thread).

Each algo with state, and each path a resume must replay, is covered: GRPO; CoPE's separate forecast steps with ECHO's
observation loss beside them (`algo=cope_echo`); the temporal ensemble; the continuation reading's adaptive scale
(LossBalance state). EMPG (a stateless rescaling of the batch's advantages) runs GRPO's path and gets no run of its own.
The tiny model is warm-started long enough that episodes succeed (a cold one makes only invalid moves, and
every algo but ECHO would then leave the adapter unchanged, which would make the comparison vacuous).
The kill lands anywhere in the third epoch or later: rollouts, training steps, validation, a checkpoint
write. The moment is drawn from a seeded RNG and printed, so a failure can be replayed."""
from __future__ import annotations

import csv
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import TRAIN_PY
from safetensors.torch import load_file

pytestmark = pytest.mark.slow

EPOCHS = 5
BASE = ["debug=fast", "model.warm_start_steps=150", "env.sizes=[6]", "env.max_steps=12", "data.tasks_per_epoch=8",
        "data.sampling.temperature=0.3", f"trainer.max_epochs={EPOCHS}"]
ALGOS = {
    "grpo": ["algo=grpo"],
    "cope_adaptive": ["algo=cope_continuation", "cope.normalize=adaptive"],
    "cope_echo": ["algo=cope_echo", "cope.gate=all", "cope.minibatch_size=8"],  # forecast steps of its own, + ECHO
    "cope_te": ["algo=cope", "cope.gate=all", "cope.te.weight=0.1", "cope.te.warmup_steps=2"],  # + the temporal ensemble
}
TIMING = ("perf/",)  # wall-clock metrics: the only columns allowed to differ


def _env() -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "HYDRA_FULL_ERROR": "1"}


def _cmd(run: Path, extra: list[str]) -> list[str]:
    return [sys.executable, str(TRAIN_PY), *BASE, *extra, f"hydra.run.dir={run}"]


def _run(run: Path, extra: list[str]) -> subprocess.CompletedProcess:
    proc = subprocess.run(_cmd(run, extra), cwd=run.parent, env=_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc


def _ckpt_epoch(path: Path) -> int | None:
    try:
        return int(torch.load(path, map_location="cpu", weights_only=True)["epoch"])
    except Exception:  # noqa: BLE001 - not there yet
        return None


def _kill_inside_epoch(run: Path, extra: list[str], rng: random.Random) -> dict:
    """Starts the run, waits for the checkpoint of epoch 1 (0-based), SIGKILLs it a random time later."""
    ckpt = run / "checkpoints" / "last.ckpt"
    proc = subprocess.Popen(_cmd(run, extra), cwd=run.parent, env=_env(), stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        t0, seen = time.monotonic(), {}
        while time.monotonic() - t0 < 400:
            assert proc.poll() is None, f"the run ended before it was killed:\n{proc.stderr.read()[-3000:]}"
            e = _ckpt_epoch(ckpt) if ckpt.exists() else None
            if e is not None and e not in seen:
                seen[e] = time.monotonic()
            if 1 in seen:
                break
            time.sleep(0.05)
        assert 1 in seen, "no checkpoint of epoch 1 in time"
        epoch_s = seen[1] - seen[0] if 0 in seen else 3.0
        delay = rng.uniform(0.0, 2.0 * epoch_s)  # anywhere in epochs 2..3 of 5
        time.sleep(delay)
        assert proc.poll() is None, "the run ended before the kill"
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        return {"delay_s": delay, "epoch_s": epoch_s, "ckpt_epoch_at_kill": _ckpt_epoch(ckpt)}
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def _rows(path: Path) -> list[dict]:
    with open(path, newline="") as f:
        return [{k: v for k, v in r.items() if v not in ("", None) and not k.startswith(TIMING)} for r in csv.DictReader(f)]


def _outputs(run: Path) -> dict:
    ckpt = torch.load(run / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    return {
        "counters": ckpt["RolloutDataModule"]["counters"],
        "epoch_step": (ckpt["epoch"], ckpt["global_step"]),
        "adapter": load_file(str(run / "csv" / "adapter" / "adapter_model.safetensors")),
        "metrics": _rows(run / "csv" / "metrics.csv"),
        "trajectories": [json.loads(ln) for ln in (run / "csv" / "trajectories.jsonl").read_text().splitlines()],
        "curve": (run / "csv" / "learning_curve.csv").read_text(),
        "curve_train": (run / "csv" / "learning_curve_train.csv").read_text(),
        "callbacks": {k: v for k, v in ckpt["callbacks"].items() if "Checkpoint" not in k},
    }


@pytest.mark.parametrize("algo", sorted(ALGOS))
def test_kill_anywhere_then_resume_equals_uninterrupted(tmp_path, algo):
    extra = ALGOS[algo]
    straight = tmp_path / "straight"
    _run(straight, extra)
    crashed = tmp_path / "crashed"
    seed = int(os.environ.get("COPE_KILL_SEED") or random.randrange(2**31))  # a failure's note names its seed: rerun it
    info = _kill_inside_epoch(crashed, extra, random.Random(seed))
    note = f"algo={algo} kill seed={seed} {info}"
    proc = _run(crashed, [*extra, "ckpt_path=last"])
    assert "=== cope-trainer run summary ===" in proc.stdout, note
    a, b = _outputs(straight), _outputs(crashed)
    assert a["counters"] == b["counters"], note
    assert a["counters"]["episodes"] == EPOCHS * 8 * 4, note
    assert a["epoch_step"] == b["epoch_step"], note
    assert a["metrics"] == b["metrics"], note  # every row, in order: nothing duplicated, nothing missing
    assert a["trajectories"] == b["trajectories"], note
    assert a["curve"] == b["curve"] and a["curve_train"] == b["curve_train"], note
    assert a["callbacks"].keys() == b["callbacks"].keys(), note
    assert str(a["callbacks"]) == str(b["callbacks"]), note  # LossBalance / SampleEfficiency state
    assert a["adapter"].keys() == b["adapter"].keys()
    for k in a["adapter"]:
        assert torch.equal(a["adapter"][k], b["adapter"][k]), f"{k}: {note}"
    assert any(r.get("rollout/success", "0") not in ("0.0", "0") for r in a["metrics"]), "no episode succeeded"
