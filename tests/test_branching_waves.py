"""Branched rollouts with ``data.env_runtime.max_live_episodes``: a wave runs in parts, and a tree keeps at most that
many envs live (a memory-heavy env, one JVM per instance, sets it through its ``max_instances``)."""
from __future__ import annotations

import functools
import itertools

import pytest
from tiny_fixtures import branched_epoch, tiny_policy

from cope.envs.maze import MazeEnv
from cope.rollout.engine import EnvRuntime, Sampling

G, TASKS = 8, 2


class LiveMaze(MazeEnv):
    """A maze that replays only and counts its live instances (made and not closed), class-wide."""

    fork = None
    forks_by_replay = True
    live = peak = made = 0

    def __init__(self, **kw):
        super().__init__(**{"sizes": [6], "max_steps": 8, **kw})
        LiveMaze.live += 1
        LiveMaze.made += 1
        LiveMaze.peak = max(LiveMaze.peak, LiveMaze.live)
        self._open = True

    def close(self) -> None:
        if self._open:
            LiveMaze.live -= 1
            self._open = False
        super().close()


def _collect(policy, max_live: int | None, **branch):
    LiveMaze.live = LiveMaze.peak = LiveMaze.made = 0
    return branched_epoch(policy, LiveMaze, TASKS, G, EnvRuntime(max_live_episodes=max_live),
                          Sampling(max_action_tokens=4, temperature=0.7), roots=2, **branch)


@pytest.fixture(scope="module")
def policy():
    return tiny_policy()


@pytest.mark.parametrize("max_live", [3, 5])
def test_a_tree_keeps_at_most_max_live_episodes_envs_live(policy, max_live):
    rec = _collect(policy, max_live, stop_duplicates=True)
    assert LiveMaze.made > max_live + 1  # every root and replayed child made its own env
    assert LiveMaze.peak <= max_live + 1, LiveMaze.peak  # + the template the collector reads names from (closed at once)
    assert LiveMaze.live == 0  # all closed after the epoch
    m = rec.metrics
    assert m["rollout/branch_replay_mismatch"] == 0 and m["rollout/branch_forks"] > 0
    stopped = m["rollout/branch_stop_duplicate"]
    assert len(rec.episodes) + stopped == TASKS * G  # every slot a leaf or a child stopped early: never over budget
    assert all(len(list(members)) <= G for _g, members in itertools.groupby(rec.episodes, key=lambda e: e.group))
    for e in rec.episodes:
        if e.branch_of >= 0:
            parent = rec.episodes[e.branch_of]
            end = parent.steps[e.shared_steps - 1].obs_end
            assert e.tokens[:end] == parent.tokens[:end]


def test_without_a_cap_every_wave_runs_at_once(policy):
    _collect(policy, None)
    assert LiveMaze.peak > 5  # the first wave alone is TASKS * roots = 4 roots, the next up to 12 children


def _trees(rec) -> list[tuple]:
    return [(e.group, e.tokens, e.reward, e.branch_of, e.shared_steps, e.end_reason) for e in rec.episodes]


def test_env_workers_grow_the_same_parted_trees_as_in_process(policy):
    """With a cap, waves run in parts in both places, and a child's duplicate check sees the siblings of earlier
    parts in both (kin linked over the whole wave): the same trees and stops, id for id."""
    def collect(workers: int):
        return branched_epoch(policy, functools.partial(MazeEnv, sizes=[6], max_steps=8), TASKS, G,
                              EnvRuntime(workers=workers, max_live_episodes=3), roots=2, replay=True, stop_duplicates=True,
                              stop_loops=True)

    here, there = collect(0), collect(2)
    assert _trees(here) == _trees(there)
    keys = ("rollout/branch_stop_duplicate", "rollout/branch_stop_loop", "rollout/branch_forks", "rollout/branch_env_steps")
    assert {k: here.metrics[k] for k in keys} == {k: there.metrics[k] for k in keys}
    assert here.metrics["rollout/branch_forks"] > 0
