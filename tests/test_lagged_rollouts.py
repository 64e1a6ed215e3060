"""``data.max_lag``: rollouts collected in a background thread while earlier epochs train (cope.train.collect.lagged).

With the in-process engine (each held version a sampler copy of the adapter): epoch e trains on episodes of the
policy at the start of epoch max(0, e - L), collected off the main thread; the minibatches carry the sampler's
log-probs and the loss reports the behaviour weights; a resume discards and counts what was in flight and trains no
epoch twice; bad settings fail before any work, naming the key; lag 0 is the sequential loop."""
from __future__ import annotations

import threading

import pytest

from cope.rollout.engine import HFEngine
from cope.train.collect.lagged import THREAD

EPISODES = 2 * 4  # debug=fast: 2 tasks x 4 episodes per epoch
STEPS = 1  # one minibatch of 8 episodes per epoch


def _run(run_train, tmp_path, lag: int, epochs: int, extra=()):
    return run_train([f"data.max_lag={lag}", f"trainer.max_epochs={epochs}", "data.sampling.temperature=0.7", *extra],
                     tmp_path)


def _record_rollouts(mp: pytest.MonkeyPatch) -> list[tuple]:
    """Every later rollout call of the in-process engine: (thread, requested version, the engine's newest version)."""
    seen, rollout = [], HFEngine.rollout

    def recorded(self, *args, version=None, **kw):
        seen.append((threading.current_thread().name, version, self.version))
        return rollout(self, *args, version=version, **kw)

    mp.setattr(HFEngine, "rollout", recorded)
    return seen


@pytest.fixture
def calls():
    with pytest.MonkeyPatch.context() as mp:
        yield _record_rollouts(mp)


@pytest.fixture(scope="module")
def lag2(run_train, tmp_path_factory, read_metrics):
    out = tmp_path_factory.mktemp("lag2")
    with pytest.MonkeyPatch.context() as mp:
        seen = _record_rollouts(mp)
        # algo=echo: the observation loss moves the weights every epoch, also when no group has a reward signal
        result = run_train(["algo=echo", "data.max_lag=2", "trainer.max_epochs=4", "data.sampling.temperature=0.7"], out)
    return out, result, seen, read_metrics(out / "csv" / "metrics.csv")


def test_each_epoch_trains_on_the_policy_lag_epochs_old(lag2):
    out, result, seen, m = lag2
    assert m["rollout/lag_mean"] == [0.0, 1.0, 2.0, 2.0] and m["rollout/lag_max"] == [0.0, 1.0, 2.0, 2.0]
    train = [(version, newest) for thread, version, newest in seen if thread == THREAD]
    # epochs 0, 1, 2 queued at the start of epoch 0 (version: step 0); epoch 3 at the start of epoch 1 (step 1); epoch 3's
    # collection can run while epoch 1 or 2 trains, when the newest version is already ahead of it
    assert [v for v, _ in train] == [0, 0, 0, STEPS]
    main = [(version, newest) for thread, version, newest in seen if thread != THREAD]  # validations: the live model
    assert main and all(version is None for version, _ in main)
    assert sorted({n for _, n in main}) == [0, STEPS, 2 * STEPS, 3 * STEPS, 4 * STEPS]
    assert result["counters/episodes"] == 4 * EPISODES and m["rollout/discarded_episodes"] == [0.0] * 4


def test_lagged_batches_carry_the_behaviour_correction(lag2):
    _, _, _, m = lag2
    w, top = m["policy/behaviour_weight_mean"], m["policy/behaviour_weight_max"]
    assert len(w) == 4 * STEPS and all(x > 0 for x in w)
    assert abs(w[0] - 1.0) < 1e-5 and top[0] < 1 + 1e-5  # epoch 0: its sampler is the policy that scored it
    assert all(x > 1.01 for x in top[1:])  # later epochs: sampled 1-2 epochs ago, the weights moved since


def test_resume_discards_and_counts_the_collections_in_flight(run_train, tmp_path, read_metrics):
    """A fit that ends after epoch 1 with epochs 2 and 3 queued (max_steps: the checkpoint a kill right after it would
    leave): the resume discards them, counts them and collects them again; every epoch is trained once."""
    _run(run_train, tmp_path, 2, 4, ["+trainer.max_steps=2"])
    result = _run(run_train, tmp_path, 2, 4, ["ckpt_path=last"])
    m = read_metrics(tmp_path / "csv" / "metrics.csv")
    assert m["rollout/discarded_episodes"] == [0.0, 0.0, 2 * EPISODES, 2 * EPISODES]
    assert m["rollout/lag_mean"] == [0.0, 1.0, 0.0, 1.0]  # after the resume: both sampled at its first version
    assert result["counters/episodes"] == 4 * EPISODES and m["epoch"][-1] == 3.0


@pytest.mark.parametrize("overrides, key", [
    (["data.max_lag=-1"], "data.max_lag"),
    (["data.max_lag=1", "data.sampling.top_p=0.9"], "data.sampling.top_p"),
    (["data.max_lag=1", "model.finetune=full"], "model.finetune"),  # a sampler copy would be a whole model per version
    (["data.max_lag=1", "rollout=vllm"], "data.engine.max_loras"),  # validation and collection: two adapters at once
])
def test_bad_lag_settings_fail_before_any_work(compose, tmp_path, overrides, key):
    from cope.run.config_check import check_config
    from cope.run.config_keys import ConfigError

    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        check_config(compose(overrides, tmp_path))


def test_lag_zero_starts_no_thread_and_adds_no_key(run_train, tmp_path, read_metrics, calls):
    """max_lag=0: the synchronous loop (no collector thread, no sampler copy, no behaviour key or lag metric). That
    loop is the one before the feature bit for bit: a 3-epoch run at T=0.7 gave that commit's 74 metric columns and
    14 trained tensors exactly (docs/overlap.md)."""
    run_train(["data.max_lag=0"], tmp_path)
    assert calls and all(thread != THREAD and version is None for thread, version, _ in calls)
    m = read_metrics(tmp_path / "csv" / "metrics.csv")
    assert not [k for k in m if k.startswith(("rollout/lag", "rollout/discarded", "policy/behaviour", "perf/rollout_wait"))]


@pytest.mark.slow
def test_kill_with_collections_in_flight_then_resume(tmp_path, read_metrics):
    """``python train.py`` with max_lag=2 SIGKILLed between its epoch-1 checkpoint and the end of epoch 3 (collections
    queued or running), resumed: the checkpoint's in-flight episodes are counted as discarded, every epoch is trained
    exactly once, the lag stays within 2, and the episode counter holds only trained epochs."""
    import os
    import signal
    import subprocess
    import sys
    import time
    from pathlib import Path

    import torch

    train_py = Path(__file__).resolve().parents[1] / "train.py"  # (not conftest's: tests/vllm has a conftest module too)

    run, ckpt = tmp_path / "run", tmp_path / "run" / "checkpoints" / "last.ckpt"
    cmd = [sys.executable, str(train_py), "debug=fast", "algo=echo", "data.max_lag=2", "trainer.max_epochs=5",
           f"hydra.run.dir={run}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        deadline = time.monotonic() + 300
        # the kill comes right after epoch 1's checkpoint (its epoch row travels in it: callbacks/checkpoint.py);
        # epochs 2 and 3 are queued then
        while time.monotonic() < deadline and proc.poll() is None:
            if ckpt.exists() and torch.load(ckpt, map_location="cpu", weights_only=False)["epoch"] >= 1:
                break
            time.sleep(0.05)
        assert proc.poll() is None, proc.stderr.read()[-3000:]
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    state = torch.load(ckpt, map_location="cpu", weights_only=False)
    dm = state["RolloutDataModule"]
    assert dm["in_flight_episodes"] > 0  # collections were queued when it was written
    again = subprocess.run([*cmd, "ckpt_path=last"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stderr[-3000:]
    m = read_metrics(run / "csv" / "metrics.csv")
    epochs = int(state["epoch"]) + 1  # trained before the kill
    assert len(m["rollout/lag_mean"]) == 5 and max(m["rollout/lag_max"]) <= 2
    assert m["rollout/discarded_episodes"][epochs:] == [float(dm["in_flight_episodes"])] * (5 - epochs)
    final = torch.load(ckpt, map_location="cpu", weights_only=False)["RolloutDataModule"]
    assert final["counters"]["episodes"] == 5 * EPISODES and final["discarded_episodes"] == dm["in_flight_episodes"]


def test_an_attached_vllm_server_is_not_held_to_max_loras(compose, tmp_path):
    """data.engine.max_loras configures a managed server; an attached one was started by its operator (docs/vllm.md)."""
    from cope.run.config_check import check_config

    check_config(compose(["data.max_lag=1", "rollout=vllm", "data.engine.url=http://127.0.0.1:1"], tmp_path))
