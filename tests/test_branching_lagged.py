"""Branched rollouts that overlap training (``+collector=branching data.max_lag=L``): epoch e's trees grow in the
background thread on the policy version of epoch max(0, e - L), as flat overlapped rollouts do
(cope.train.collect.lagged).

A held version's trees are exactly the trees its weights grow at lag 0 (same tasks, seed and fork decisions), not
those of the weights that trained on meanwhile; every action carries its sampler's log-prob (the behaviour
correction); through train.py the trees grow in the collector thread on the versions the schedule names, and a
resume discards and counts the trees in flight (a checkpoint never holds half a tree)."""
from __future__ import annotations

import functools
import threading

import pytest
import torch
from tiny_fixtures import maze_factory, tiny_policy

from cope.rollout.engine import EnvRuntime, HFEngine, Sampling
from cope.train.collect.branching.collector import BranchingCollector
from cope.train.collect.lagged import THREAD
from cope.train.datamodule import RolloutDataModule

G, TASKS = 4, 3
BRANCHED = ["+collector=branching", "branch.roots=2", "data.sampling.temperature=0.7", "data.share_prefix=true",
            "algo=echo"]  # ECHO moves the weights every epoch, also when no group has a reward spread
LEAVES = 2 * 4  # debug=fast: 2 tasks x 4 leaves per epoch, one minibatch (one optimizer step)


def _datamodule(policy, max_lag: int) -> RolloutDataModule:
    dm = RolloutDataModule(env=maze_factory, tasks_per_epoch=TASKS, group_size=G, minibatch_size=G * TASKS,
                           max_context=512, sampling=Sampling(temperature=0.7, max_action_tokens=4), val_tasks=0,
                           progress=False, env_runtime=EnvRuntime(), max_lag=max_lag,
                           collector=functools.partial(BranchingCollector, group_size=G, roots=2))
    dm.connect(policy)
    return dm


def _epoch(policy, max_lag: int, epochs: int, between=lambda: None):
    """The last of ``epochs`` epochs' records of a fresh DataModule (``between()`` runs after each but the last)."""
    dm = _datamodule(policy, max_lag)
    try:
        for e in range(epochs):
            rec = dm.collect_epoch(e)
            if e < epochs - 1:
                between()
        return rec
    finally:
        dm.teardown("fit")


def _ids(rec) -> list[list[int]]:
    return [e.tokens for e in rec.episodes]


def test_a_held_versions_trees_are_the_trees_its_weights_grow_at_lag_zero():
    """Epoch 1 of a lag-1 run is queued at the start of epoch 0 under version 0; the adapter then moves (as training
    would) before it is taken. Its trees equal the lag-0 trees of epoch 1 under the old weights, and differ from those
    the moved weights grow."""
    policy = tiny_policy()
    trainable = [p for p in policy.model.parameters() if p.requires_grad]
    before = [p.detach().clone() for p in trainable]
    gen = torch.Generator().manual_seed(0)
    moved = [torch.randn(p.shape, generator=gen) for p in trainable]

    def move():
        with torch.no_grad():
            for p, d in zip(trainable, moved):
                p.add_(d)

    lagged = _epoch(policy, 1, 2, between=move)
    assert lagged.metrics["rollout/lag_mean"] == 1.0 and lagged.metrics["rollout/branch_leaves"] == G * TASKS
    assert lagged.metrics["rollout/branch_forks"] > 0  # trees, not flat groups
    assert all(s.sampler_logprobs is not None and len(s.sampler_logprobs) == s.action_end - s.action_start
               for e in lagged.episodes if not e.aborted for s in e.steps)  # the behaviour correction's input
    assert all(e.sampled_epoch == 0 for e in lagged.episodes)
    now = _epoch(policy, 0, 2)  # the moved weights, at lag 0
    with torch.no_grad():
        for p, b in zip(trainable, before):
            p.copy_(b)
    then = _epoch(policy, 0, 2)  # the weights of version 0, at lag 0
    assert _ids(lagged) == _ids(then) and [e.branch_of for e in lagged.episodes] == [e.branch_of for e in then.episodes]
    assert _ids(now) != _ids(then)  # the test can tell the versions apart


def _record_actors(mp: pytest.MonkeyPatch) -> list[tuple]:
    """Every actor the in-process engine lends: (thread, requested version, the engine's newest version)."""
    seen, actor = [], HFEngine.actor

    def recorded(self, sampling, seed, version=None, logprobs=False):
        seen.append((threading.current_thread().name, version, self.version))
        return actor(self, sampling, seed, version=version, logprobs=logprobs)

    mp.setattr(HFEngine, "actor", recorded)
    return seen


@pytest.mark.long
def test_train_py_grows_each_epochs_trees_in_the_background_on_the_scheduled_version(run_train, tmp_path, read_metrics):
    with pytest.MonkeyPatch.context() as mp:
        seen = _record_actors(mp)
        result = run_train([*BRANCHED, "data.max_lag=1", "trainer.max_epochs=3"], tmp_path)
    m = read_metrics(tmp_path / "csv" / "metrics.csv")
    # epochs 0 and 1 queued at the start of epoch 0 (version 0), epoch 2 at the start of epoch 1 (after one step)
    assert [(thread, version) for thread, version, _ in seen] == [(THREAD, 0), (THREAD, 0), (THREAD, 1)]
    assert m["rollout/lag_mean"] == [0.0, 1.0, 1.0] and m["rollout/branch_leaves"] == [LEAVES] * 3
    assert all(0 < v < 1 for v in m["rollout/branch_saving"]) and all(0 < v < 1 for v in m["data/shared_fraction"])
    assert abs(m["policy/behaviour_weight_mean"][0] - 1) < 1e-5 and m["policy/behaviour_weight_max"][2] > 1.001
    assert result["counters/episodes"] == 3 * LEAVES and m["rollout/discarded_episodes"] == [0.0] * 3


@pytest.mark.long
def test_a_resume_discards_and_counts_the_trees_in_flight(run_train, tmp_path, read_metrics):
    """A fit that stops after epoch 0 with epoch 1's trees queued (the checkpoint a kill right after it leaves): the
    resume counts them as discarded, grows them again under its first version, and trains every epoch once."""
    run_train([*BRANCHED, "data.max_lag=1", "trainer.max_epochs=3", "+trainer.max_steps=1"], tmp_path)
    result = run_train([*BRANCHED, "data.max_lag=1", "trainer.max_epochs=3", "ckpt_path=last"], tmp_path)
    m = read_metrics(tmp_path / "csv" / "metrics.csv")
    assert m["rollout/discarded_episodes"] == [0.0, LEAVES, LEAVES]
    assert m["rollout/lag_mean"] == [0.0, 0.0, 1.0]  # after the resume: epoch 1 regrown on its first version
    assert result["counters/episodes"] == 3 * LEAVES and m["epoch"][-1] == 2.0
