"""Branched rollouts under DDP: 2 CPU processes (gloo) through the real entry point, each rank with its own env worker.

Each rank grows its own trees (its own tasks, from its own stream) and trains on them; every rank's groups grow
``data.group_size`` leaves (identical ones trained once: ``branch.dedup``), every rank trains the full groups'
minibatch count (so no collective waits on a rank that dropped more), and the ranks hold the same adapter after every
step. The pattern of tests/test_ddp.py, with tests/ddp_trace.py for the
weights and tests/branch_callbacks.py for the trees."""
from __future__ import annotations

import json
import os
from collections import Counter
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
RANKS, EPOCHS, TASKS, G = 2, 2, 2, 4  # debug=fast: 2 epochs of 2 tasks, groups of 4


def _rows(out: Path, rank: int, key: str) -> list[dict]:
    return [r for r in map(json.loads, (out / f"rank{rank}.jsonl").read_text().splitlines()) if key in r]


@pytest.mark.slow
@pytest.mark.ddp
@pytest.mark.parametrize("lag", [0, 1])  # 1: each rank's trees grow in its collector thread on the held version
def test_ddp_ranks_grow_whole_trees_and_agree_on_the_weights(train_script, read_metrics, tmp_path, lag):
    run_dir, trees, weights = tmp_path / "run", tmp_path / "trees", tmp_path / "weights"
    pythonpath = os.pathsep.join(p for p in (str(TESTS), os.environ.get("PYTHONPATH", "")) if p)
    proc = train_script(["debug=fast", "trainer=ddp", "trainer.devices=2", "trainer.accelerator=cpu",
                         "+collector=branching", "branch.roots=2", "branch.trigger=random", "data.env_runtime.workers=1",
                         f"data.max_lag={lag}",
                         # a maze the warm-started tiny model solves now and then: a reward spread, so the weights move
                         "model.warm_start_steps=150", "env.sizes=[5]", "env.min_distance=1",
                         "validate_before_fit=false", "trainer.check_val_every_n_epoch=100", f"hydra.run.dir={run_dir}",
                         "+callbacks.trees._target_=branch_callbacks.TreeTrace", f"+callbacks.trees.out={trees}",
                         "+callbacks.trace._target_=ddp_trace.DDPTrace", f"+callbacks.trace.out={weights}"],
                        tmp_path, timeout=600, env={"PYTHONPATH": pythonpath})
    report = f"exit {proc.returncode}\n--- stdout ---\n{proc.stdout[-3000:]}\n--- stderr ---\n{proc.stderr[-5000:]}"
    assert proc.returncode == 0, report
    assert "GLOBAL_RANK: 1" in proc.stderr + proc.stdout, report

    grown = [_rows(trees, r, "epoch") for r in range(RANKS)]
    assert [[row["epoch"] for row in rank] for rank in grown] == [list(range(EPOCHS))] * RANKS
    forks = 0
    for rank in grown:
        for row in rank:
            eps = row["episodes"]
            sizes = Counter(g for _, g, *_ in eps)  # every group: G leaves grown, duplicates trained once
            assert len(sizes) == TASKS and all(1 <= n <= G for n in sizes.values()), eps
            for task, g, branch_of, shared, _ in eps:
                if branch_of >= 0:
                    assert eps[branch_of][:2] == [task, g] and shared >= 1, eps  # a child of its own group's tree
                    forks += 1
    assert forks > 0
    for e in range(EPOCHS):  # each rank grew its own trees
        assert grown[0][e]["episodes"] != grown[1][e]["episodes"]

    adapters = [[row["adapter"] for row in _rows(weights, r, "step")] for r in range(RANKS)]
    assert adapters[0] == adapters[1] and len(adapters[0]) == EPOCHS * TASKS * G // 8, adapters  # minibatches of 8
    assert len(set(adapters[0])) > 1  # the weights moved

    cols = read_metrics(run_dir / "csv" / "metrics.csv")
    assert cols["counters/episodes"] == [RANKS * TASKS * G * (e + 1) for e in range(EPOCHS)]
    assert len(cols["rollout/branch_leaves"]) == EPOCHS
    assert cols.get("rollout/lag_mean", [0.0, 0.0]) == [0.0, float(lag)]
