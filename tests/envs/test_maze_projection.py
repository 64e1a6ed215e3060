"""Action projection (``env.action_parsing=project``): the maze reads the first direction word of a prose
answer, flags the step, and strict parsing stays the default. The texts are SmolLM2-135M-Instruct's own
first-turn answers (the cold-start measurement): it explains instead of answering with one word."""
from __future__ import annotations

import pytest

from cope.envs.actions import first_word, match_admissible
from cope.envs.base import Task
from cope.envs.maze import DIRECTIONS, HARNESS_INVALID, MazeEnv, parse_action, project_action

# (text, strict parse, projection)
CASES = [
    ("The goal is 3 south, 1 east", None, "south"),
    ("Here it is: North, South,", None, "north"),
    ("To find the goal in a 7", None, None),
    ("north", "north", "north"),
    ("  'West.' ", "west", "west"),
    ("go East", "east", "east"),
    ("Northwest is not a move; eastward neither", None, None),  # whole words only
    ("I would go SOUTH then west.", None, "south"),
]


@pytest.mark.parametrize("text,strict,projected", CASES)
def test_parse_and_project(text, strict, projected):
    assert parse_action(text) == strict
    assert project_action(text) == projected


def _env_at_start(parsing: str) -> tuple[MazeEnv, str, str]:
    """A maze reset on a task whose start has an open move and a blocked one; returns (env, open, blocked)."""
    env = MazeEnv(sizes=[6], max_steps=8, action_parsing=parsing)
    for i in range(200):
        env.reset(Task("maze", "train", i))
        opened = env._layout.open_moves(env._pos)
        blocked = [d for d in DIRECTIONS if d not in opened]
        if opened and blocked:
            return env, opened[0], blocked[0]
    raise AssertionError("no start with both an open and a blocked move")


def test_strict_refuses_prose():
    env, open_move, _ = _env_at_start("strict")
    out = env.step(f"The answer is {open_move}, I think")
    assert not out.valid and out.observation == "" and out.harness == HARNESS_INVALID
    assert out.info["projected"] is False


def test_project_moves_and_flags():
    env, open_move, _ = _env_at_start("project")
    start = env._pos
    out = env.step(f"The answer is {open_move.capitalize()}, I think")
    assert out.valid and out.info["projected"] is True and env._pos != start
    assert out.observation.startswith("Goal:") or out.success
    assert out.harness == f"Read as: {open_move}. Answer with one word."


def test_project_keeps_walls_and_strict_answers():
    env, _, blocked = _env_at_start("project")
    out = env.step(f"Let me try {blocked} first")
    assert not out.valid and out.info["projected"] is True and out.observation.startswith("Wall.")
    env2, open_move, _ = _env_at_start("project")
    out = env2.step(open_move)  # a strictly formatted answer is not projected
    assert out.valid and out.info["projected"] is False and out.harness == ""


def test_project_without_a_move_word_is_malformed():
    env, _, _ = _env_at_start("project")
    out = env.step("To find the goal in a 7")
    assert not out.valid and out.harness == HARNESS_INVALID and out.info["projected"] is False


def test_same_outcome_as_strict_on_the_projected_move():
    a, open_move, _ = _env_at_start("project")
    b, _, _ = _env_at_start("strict")
    pa, pb = a.step(f"Closer: {open_move}."), b.step(open_move)
    assert (pa.observation, pa.valid, pa.reward, pa.done) == (pb.observation, pb.valid, pb.reward, pb.done)


def test_bad_mode():
    with pytest.raises(ValueError, match="action_parsing"):
        MazeEnv(action_parsing="lenient")


def test_first_word_and_admissible_matcher():
    assert first_word("Here it is: North, South,", DIRECTIONS) == "north"
    assert first_word("northern lights", DIRECTIONS) is None
    adm = ["open fridge", "open the fridge", "go to kitchen", "take apple"]
    assert match_admissible("I will open the fridge now", adm) == "open the fridge"  # longest at the same place
    assert match_admissible("First: Go  To Kitchen. Then take apple", adm) == "go to kitchen"  # earliest, spaces/case
    assert match_admissible("take apples", adm) is None  # whole words
    assert match_admissible("nothing here", adm) is None and match_admissible("x", None) is None
