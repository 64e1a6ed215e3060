"""The projection flag travels from the env (``info["projected"]``) to ``Step.projected`` through the rollout
engine, in process and through env workers, and into ``rollout/projected_actions`` and ``rollout/strict_valid``."""
from __future__ import annotations

import functools

import pytest
from tiny_fixtures import Scripted, maze_tasks, tiny_chat, tiny_tokenizer

from cope.envs.maze import MazeEnv
from cope.envs.runtime.pool import EnvWorkerPool
from cope.rollout.loop import run_episodes
from cope.rollout.metrics import episode_metrics

PROSE = ["north", "The goal is south, I think", "To find the goal in a 7", "east"]  # strict, projected, malformed, strict


def _run(parsing: str, workers: int = 0):
    tok, chat = tiny_tokenizer(), tiny_chat()
    factory = functools.partial(MazeEnv, sizes=[6], max_steps=4, action_parsing=parsing)
    ids = [[*tok.encode(a, add_special_tokens=False), chat.stop_id] for a in PROSE]
    envs = EnvWorkerPool(factory, workers, 60, 60) if workers else [factory()]
    try:
        eps, _ = run_episodes(envs, maze_tasks(1, start=3), [0], Scripted({0: ids}), tok, chat, 1024, 16)
    finally:
        if workers:
            envs.close()
    return eps


@pytest.mark.parametrize("workers", [0, pytest.param(1, marks=pytest.mark.long)])
def test_projected_steps_are_flagged(workers):
    ep = _run("project", workers)[0]
    assert ep.num_steps == 4 and [s.projected for s in ep.steps] == [False, True, False, False]
    assert not ep.steps[1].strict and ep.steps[1].action_text == PROSE[1]  # projected: never strict; text as sampled
    assert not ep.steps[2].valid and not ep.steps[2].strict
    m = episode_metrics([ep], "rollout")
    assert m["rollout/projected_actions"] == 0.25
    assert m["rollout/strict_valid"] == sum(s.valid and not s.projected for s in ep.steps) / 4


def test_strict_parsing_projects_nothing():
    ep = _run("strict")[0]
    assert not any(s.projected for s in ep.steps) and not ep.steps[1].valid
    m = episode_metrics([ep], "rollout")
    assert m["rollout/projected_actions"] == 0.0 and m["rollout/strict_valid"] == 1 - m["rollout/invalid_rate"]
