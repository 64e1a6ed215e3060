"""The collector seam (cope.train.collect.collector): the DataModule gathers every epoch through one collector chosen at
construction, and works with one it has never heard of.

The third collector here replays fixed episodes in a real Lightning fit, passed as ``data.collector``; it declares
itself off-policy, so the minibatches must carry its sampler log-probs, the record must say so, its own metric must
reach the record, and its state must travel in the DataModule's checkpoint state beside the counters."""
from __future__ import annotations

import copy
import functools
from types import SimpleNamespace

import lightning.pytorch as pl
import pytest
import torch
from tiny_fixtures import maze_factory, tiny_policy

from cope.algos.grpo import PolicyGradient
from cope.rollout.engine import Sampling
from cope.rollout.loop import RolloutStats
from cope.train.collect.branching.collector import BranchingCollector
from cope.train.collect.collector import Collected, CollectorHost
from cope.train.collect.lagged import LaggedCollector
from cope.train.collect.sync import SyncCollector
from cope.train.datamodule import RolloutDataModule, choose_collector
from cope.train.module import AgentRLModule

DM = dict(env=maze_factory, tasks_per_epoch=2, group_size=2, minibatch_size=4, max_context=512,
          sampling=Sampling(max_action_tokens=4), val_tasks=0, progress=False)


class ReplayCollector:
    """Replays the same episodes every epoch as if sampled one epoch earlier by a sampler that reported log-prob -1
    for every action token (so they are off-policy)."""

    off_policy = True

    def __init__(self, *, host: CollectorHost, episodes: list):
        self.host, self.episodes = host, episodes
        self.replays, self.cancelled = 0, False

    def collect(self, epoch: int) -> Collected:
        eps = copy.deepcopy(self.episodes)
        for e in eps:
            e.sampled_epoch = max(epoch - 1, 0)
            for s in e.steps:
                s.sampler_logprobs = [-1.0] * (s.action_end - s.action_start)
        self.replays += 1
        stats = RolloutStats(episodes=len(eps), env_steps=sum(e.num_steps for e in eps), generated_tokens=7)
        rng = self.host.task_stream(epoch).rng  # the DataModule's stream orders the minibatches
        return Collected(eps, [e.group for e in eps], stats, rng, 0.0, {"replay/replays": float(self.replays)})

    def cancel(self) -> None:
        self.cancelled = True

    def state_dict(self) -> dict:
        return {"replays": self.replays}

    def load_state_dict(self, state: dict) -> None:
        self.replays = int(state.get("replays", 0))


@pytest.fixture(scope="module")
def recorded():
    """Four episodes of the tiny policy on the maze, collected by the default (synchronous) DataModule."""
    policy = tiny_policy()
    dm = RolloutDataModule(**DM)
    dm.connect(policy)
    assert not dm.collector.off_policy  # data.max_lag=0: collect, then train
    record = dm.collect_epoch(0)
    dm.teardown("fit")
    assert len(record.episodes) == 4 and all(e.sampled_epoch == 0 for e in record.episodes)
    assert "behaviour_logprobs" not in record.minibatches[0] and "replay/replays" not in record.metrics
    return policy, record.episodes


def test_a_collector_the_datamodule_never_heard_of_trains(recorded, tmp_path):
    policy, episodes = recorded
    dm = RolloutDataModule(**DM, collector=functools.partial(ReplayCollector, episodes=episodes))
    dm.connect(policy)
    replay = dm.collector
    module = AgentRLModule(policy, [PolicyGradient()], optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-3))
    seen = []

    class Record(pl.Callback):
        def on_train_epoch_end(self, trainer, pl_module):
            seen.append(trainer.datamodule.train_record)

    trainer = pl.Trainer(accelerator="cpu", max_epochs=2, reload_dataloaders_every_n_epochs=1, logger=False,
                         use_distributed_sampler=False, enable_checkpointing=False, enable_progress_bar=False,
                         limit_val_batches=0, callbacks=[Record()], default_root_dir=tmp_path, enable_model_summary=False)
    trainer.fit(module, datamodule=dm)

    assert [r.epoch for r in seen] == [0, 1] and replay.replays == 2 and replay.cancelled  # teardown cancelled it
    for r in seen:
        assert [e.tokens for e in r.episodes] == [e.tokens for e in episodes]
        assert r.sampler_logprobs and r.scored
        mb = r.minibatches[0]
        assert torch.equal(mb["behaviour_logprobs"][mb["action_mask"]], torch.full((int(mb["action_mask"].sum()),), -1.0))
    assert [r.metrics["replay/replays"] for r in seen] == [1.0, 2.0]
    assert seen[1].metrics["counters/episodes"] == 8.0 and dict(dm.counters)["episodes"] == 8
    assert seen[1].metrics["counters/generated_tokens"] == 14.0  # the collector's own stats are counted

    state = dm.state_dict()
    assert state == {"counters": dict(dm.counters), "replays": 2}
    again = RolloutDataModule(**DM, collector=functools.partial(ReplayCollector, episodes=episodes))
    again.load_state_dict(state)
    assert again.collector.replays == 2 and dict(again.counters) == dict(dm.counters)


def test_the_collector_is_chosen_once_from_max_lag():
    assert choose_collector(0) is SyncCollector
    lagged = choose_collector(2)
    assert lagged.func is LaggedCollector and lagged.keywords == {"max_lag": 2}
    assert choose_collector(0, ReplayCollector) is ReplayCollector
    with pytest.raises(ValueError, match=r"data\.max_lag must be >= 0"):
        choose_collector(-1)
    with pytest.raises(ValueError, match=r"data\.max_lag=1: data\.collector \(ReplayCollector\) .* set data\.max_lag=0"):
        choose_collector(1, ReplayCollector)
    branching = functools.partial(BranchingCollector, group_size=4)  # as Hydra's _partial_ gives it
    assert choose_collector(0, branching) is branching  # its trees grow in the background only with a lag
    assert choose_collector(2, branching).keywords == {"group_size": 4, "max_lag": 2}


def _host(engine) -> CollectorHost:
    return CollectorHost(engine=engine, sampling=Sampling(), task_stream=None, rollout=None, version=lambda: 0,
                         max_epochs=lambda: None, world=lambda: 2, stopping=lambda: False)


def test_the_lagged_collector_refuses_an_engine_that_cannot_overlap():
    with pytest.raises(ValueError, match=r"data\.max_lag=1: needs a rollout engine"):
        LaggedCollector(host=_host(SimpleNamespace(overlaps=False)), max_lag=1)


def test_collector_state_in_the_checkpoint():
    """The synchronous collector adds nothing; the lagged one its discarded and in-flight episodes, and a resume
    counts what was in flight as discarded (old checkpoints: the same keys)."""
    assert SyncCollector(host=_host(None)).state_dict() == {}
    lagged = LaggedCollector(host=_host(SimpleNamespace(overlaps=True)), max_lag=1)
    assert lagged.off_policy and lagged.state_dict() == {"discarded_episodes": 0, "in_flight_episodes": 0}
    lagged.load_state_dict({"counters": {}, "discarded_episodes": 8, "in_flight_episodes": 16})
    assert lagged.state_dict() == {"discarded_episodes": 24, "in_flight_episodes": 0}
    lagged.load_state_dict({"counters": {}})  # a checkpoint of a synchronous run
    assert lagged.discarded_episodes == 0
