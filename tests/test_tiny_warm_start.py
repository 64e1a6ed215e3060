"""The tiny model's format-only warm start (src/cope/models/tiny.py): which tasks its random walks visit, and
envs without admissible actions (their example actions stand in)."""
from __future__ import annotations

import pytest
from tiny_fixtures import maze_factory, tiny_chat, tiny_tokenizer

from cope.envs.maze import MazeEnv
from cope.models.warm_start import WithExamples, random_walks


def test_warm_start_tasks_limits_the_walked_tasks():
    tok, chat = tiny_tokenizer(), tiny_chat()
    envs = [maze_factory() for _ in range(8)]
    eps = random_walks(envs, tok, chat, seed=0, max_context=512, max_action_tokens=8, num_tasks=2)
    assert len(eps) == 8 and {e.task.index for e in eps} <= {0, 1}
    wide = random_walks(envs, tok, chat, seed=0, max_context=512, max_action_tokens=8)
    assert max(e.task.index for e in wide) > 1


class _Shell(MazeEnv):
    """A maze that hides its admissible moves, as a shell env has none, but lists example actions."""

    def reset(self, task):
        r = super().reset(task)
        r.admissible_actions = None
        return r

    def step(self, action):
        r = super().step(action)
        r.admissible_actions = None
        return r

    def example_actions(self):
        return ["north", "east"]


def test_envs_without_admissible_actions_walk_their_example_actions():
    tok, chat = tiny_tokenizer(), tiny_chat()
    plain = [_Shell(sizes=[6], max_steps=4) for _ in range(2)]
    with pytest.raises(ValueError, match="example_actions"):
        random_walks(plain, tok, chat, seed=0, max_context=512, max_action_tokens=8)
    eps = random_walks([WithExamples(e) for e in plain], tok, chat, seed=0, max_context=512, max_action_tokens=8)
    texts = {s.action_text for e in eps for s in e.steps}
    assert eps and texts <= {"north", "east"}
