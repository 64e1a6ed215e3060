"""A branching run (``+collector=branching``, env workers) killed with SIGKILL while a tree is being grown, then rerun
with ``ckpt_path=auto``, ends exactly where the same run ends uninterrupted: the same metrics rows (none duplicated,
none lost; wall-clock aside), the same trajectories, counters and final adapter, bit for bit (CPU, one thread).

The kill (tests/branch_callbacks.py) lands in a later epoch's collection, after the roots of its trees were grown and the
children's envs rebuilt by replay in the workers, before any child sampled a token. A checkpoint never holds half a
tree: the branching collector keeps nothing between epochs, and the last checkpoint before the kill is the previous
epoch's, whose counters hold whole groups only; the rerun collects the killed epoch again from its seed (the task
stream is derived from the seed, the rank and the epoch), so its trees are the uninterrupted run's. The pattern of
tests/test_resume_crash.py, with the moment of the kill fixed instead of drawn."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from conftest import metric_rows

pytestmark = pytest.mark.slow

TESTS = Path(__file__).resolve().parent
EPOCHS, KILL_AT, TASKS, G = 4, 2, 2, 4  # debug=fast: 2 tasks an epoch, groups of 4
BASE = ["debug=fast", "+collector=branching", "branch.roots=2", "branch.trigger=random", "data.env_runtime.workers=2",
        f"trainer.max_epochs={EPOCHS}", "validate_before_fit=false", "ckpt_path=auto",
        # a maze the warm-started tiny model solves now and then (a reward spread: the policy gradient is not 0)
        "model.warm_start_steps=150", "env.sizes=[5]", "env.min_distance=1",
        "+callbacks.kill._target_=branch_callbacks.KillMidTree"]


def _run(train_script, tmp_path: Path, run: Path, kill_epoch: int = -1):
    pythonpath = os.pathsep.join(p for p in (str(TESTS), os.environ.get("PYTHONPATH", "")) if p)
    return train_script([*BASE, f"+callbacks.kill.epoch={kill_epoch}", f"+callbacks.kill.out={tmp_path / 'kill.jsonl'}",
                         f"hydra.run.dir={run}"], tmp_path, timeout=600, env={"PYTHONPATH": pythonpath})


def _outputs(run: Path) -> dict:
    from safetensors.torch import load_file

    ckpt = torch.load(run / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    return {"counters": ckpt["RolloutDataModule"]["counters"], "epoch_step": (ckpt["epoch"], ckpt["global_step"]),
            "metrics": metric_rows(run / "csv" / "metrics.csv"),
            "trajectories": [json.loads(x) for x in (run / "csv" / "trajectories.jsonl").read_text().splitlines()],
            "adapter": load_file(str(run / "csv" / "adapter" / "adapter_model.safetensors"))}


def test_a_run_killed_mid_tree_resumes_to_the_uninterrupted_end(train_script, tmp_path):
    straight = _run(train_script, tmp_path, tmp_path / "straight")
    assert straight.returncode == 0, straight.stderr[-4000:]
    killed = _run(train_script, tmp_path, tmp_path / "cut", kill_epoch=KILL_AT)
    assert killed.returncode == -9, (killed.returncode, killed.stderr[-4000:])  # SIGKILL, nothing ran after it
    (note,) = [json.loads(x) for x in (tmp_path / "kill.jsonl").read_text().splitlines()]
    assert note["epoch"] == KILL_AT and note["children"] > 0  # mid-tree: roots grown, children started

    # the checkpoint the kill left: the previous epoch's, whole trees only, nothing of the tree being grown
    ckpt = torch.load(tmp_path / "cut/checkpoints/last.ckpt", map_location="cpu", weights_only=True)
    assert ckpt["epoch"] == KILL_AT - 1
    assert set(ckpt["RolloutDataModule"]) == {"counters"}  # the collector keeps nothing between epochs
    assert ckpt["RolloutDataModule"]["counters"]["episodes"] == KILL_AT * TASKS * G

    resumed = _run(train_script, tmp_path, tmp_path / "cut")
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    a, b = _outputs(tmp_path / "straight"), _outputs(tmp_path / "cut")
    assert a["counters"] == b["counters"] and a["counters"]["episodes"] == EPOCHS * TASKS * G
    assert a["epoch_step"] == b["epoch_step"]
    assert a["metrics"] == b["metrics"]  # every row, in order: nothing duplicated, nothing missing
    assert a["trajectories"] == b["trajectories"]
    leaves = [float(r["rollout/branch_leaves"]) for r in a["metrics"] if "rollout/branch_leaves" in r]
    assert leaves == [TASKS * G] * EPOCHS
    assert any(float(r["rollout/branch_forks"]) > 0 for r in a["metrics"] if "rollout/branch_forks" in r)
    assert a["adapter"].keys() == b["adapter"].keys()
    for k in a["adapter"]:
        assert torch.equal(a["adapter"][k], b["adapter"][k]), k
    assert any(float(r.get("rollout/success", 0)) > 0 for r in a["metrics"]), "no episode succeeded: a vacuous run"
