"""Tests for the built-in grid maze env (`cope.envs.maze`)."""
from __future__ import annotations

import re
import subprocess
import sys

import pytest

from cope.envs.base import Env, Task
from cope.envs.maze import DIRECTIONS, HARNESS_INVALID, SUCCESS_TEXT, MazeEnv, parse_action

STATUS_RE = re.compile(
    r"(Wall\. )?Goal: \d+ (north|south)(, \d+ (east|west))?\. Open: [a-z, ]+\."
    r"|(Wall\. )?Goal: \d+ (east|west)\. Open: [a-z, ]+\."
)


def _task(split: str = "train", index: int = 0) -> Task:
    return Task(env="maze", split=split, index=index)


def _bump(env: MazeEnv) -> str | None:
    """A direction that is blocked (wall or edge) from the agent's position, if any."""
    blocked = [d for d in DIRECTIONS if d not in env._layout.open_moves(env._pos)]
    return blocked[0] if blocked else None


def test_protocol_and_instructions():
    env = MazeEnv()
    assert isinstance(env, Env)
    assert env.num_tasks("train") == 100_000 and env.num_tasks("test") == 1_000
    for word in ("north", "south", "east", "west", "goal"):
        assert word in env.instructions
    with pytest.raises(ValueError, match="split"):
        env.num_tasks("val")


def test_same_task_same_layout():
    a, b = MazeEnv(), MazeEnv()
    for index in range(20):
        ra, rb = a.reset(_task(index=index)), b.reset(_task(index=index))
        assert a.render().encode() == b.render().encode()
        assert ra.observation == rb.observation
    assert a.generate("test", 7) == b.generate("test", 7)


def test_train_and_test_layouts_differ():
    env = MazeEnv()
    differ = sum(env.generate("train", i) != env.generate("test", i) for i in range(20))
    assert differ == 20


@pytest.mark.parametrize("split", ["train", "test"])
def test_all_tasks_solvable_and_far_enough(split):
    env = MazeEnv()
    sizes = set()
    for index in range(200):
        layout = env.generate(split, index)
        sizes.add(layout.size)
        distance = layout.distances_to_goal().get(layout.start)
        assert distance is not None
        assert env.min_distance <= distance <= env.max_steps
        assert len(layout.walls) == round(env.wall_density * layout.size**2)
        assert layout.start not in layout.walls and layout.goal not in layout.walls
    assert sizes == {6, 7, 8}


def test_reset_observation_format():
    env = MazeEnv()
    reset = env.reset(_task(index=3))
    size = env._layout.size
    first, second = reset.observation.split("\n")
    assert first == f"Find the goal in a {size}x{size} maze." == reset.task_description
    assert STATUS_RE.fullmatch(second)
    assert reset.admissible_actions == env._layout.open_moves(env._pos)
    assert second.endswith(f"Open: {', '.join(reset.admissible_actions)}.")
    # Fixed order north, south, east, west.
    assert reset.admissible_actions == [d for d in DIRECTIONS if d in reset.admissible_actions]


@pytest.mark.parametrize("index", range(10))
def test_shortest_path_reaches_goal(index):
    env = MazeEnv()
    reset = env.reset(_task(index=index))
    path = env.shortest_path()
    assert len(path) == reset.info["distance"] == env._dist[env._layout.start]
    for i, move in enumerate(path):
        out = env.step(move)
        assert out.valid
        assert out.admissible_actions == env._layout.open_moves(env._pos)
        if i < len(path) - 1:
            assert not out.done and out.reward == 0.0 and not out.success and out.score == 0.0
            assert STATUS_RE.fullmatch(out.observation) and not out.observation.startswith("Wall")
    assert out.done and out.success and out.reward == 1.0 and out.score == 1.0
    assert out.observation == SUCCESS_TEXT and out.harness == "" and out.info["timeout"] is False
    with pytest.raises(RuntimeError, match="reset"):
        env.step("north")


def test_goal_offset_matches_layout():
    env = MazeEnv(sizes=(6,), wall_density=0.0)
    env.reset(_task(index=1))
    (gr, gc), (ar, ac) = env._layout.goal, env._pos
    obs = env._status()
    for amount, pos, neg in ((gr - ar, "south", "north"), (gc - ac, "east", "west")):
        if amount:
            assert f"{abs(amount)} {pos if amount > 0 else neg}" in obs


def test_wall_bump_is_invalid_and_agent_stays():
    env = MazeEnv()
    for index in range(50):
        env.reset(_task(index=index))
        move = _bump(env)
        if move is not None:
            break
    before, pos = env.render(), env._pos
    out = env.step(move)
    assert not out.valid and not out.done and out.reward == 0.0
    assert env._pos == pos and env.render() == before
    assert out.observation.startswith("Wall. Goal: ") and STATUS_RE.fullmatch(out.observation)
    assert out.harness == ""


@pytest.mark.parametrize("action", ["jump", "north east", "", "   ", "northeast", "go", "n", "go north now"])
def test_malformed_actions(action):
    env = MazeEnv()
    env.reset(_task())
    pos = env._pos
    out = env.step(action)
    assert not out.valid and out.observation == "" and out.harness == HARNESS_INVALID
    assert out.reward == 0.0 and not out.done and env._pos == pos
    assert parse_action(action) is None


@pytest.mark.parametrize(
    ("action", "move"),
    [(" North.", "north"), ("'east'", "east"), ("go west", "west"), ("`SOUTH`", "south"),
     ('"Go north."', "north"), ("south\n", "south"), ("`east`.", "east")],
)
def test_noisy_actions_parse(action, move):
    assert parse_action(action) == move
    env = MazeEnv()
    env.reset(_task())
    assert env.step(action).harness == ""


def test_timeout_after_max_steps():
    env = MazeEnv(max_steps=5, min_distance=3)
    env.reset(_task(index=2))
    for i in range(5):
        out = env.step("jump" if i % 2 else (_bump(env) or "jump"))
        assert out.done == (i == 4)
    assert not out.success and out.score == 0.0 and out.info["timeout"] is True
    with pytest.raises(RuntimeError):
        env.step("north")


def test_step_before_reset_raises():
    with pytest.raises(RuntimeError, match="before reset"):
        MazeEnv().step("north")


def test_render_glyphs():
    env = MazeEnv(sizes=(7,))
    env.reset(_task(index=4))
    grid = env.render().split("\n")
    assert len(grid) == 7 and all(len(row) == 7 for row in grid)
    text = "".join(grid)
    assert text.count("A") == 1 and text.count("G") == 1 and set(text) <= set("#.AG")
    assert text.count("#") == len(env._layout.walls)


@pytest.mark.parametrize(
    ("kwargs", "arg"),
    [({"sizes": ()}, "sizes"), ({"sizes": (1, 6)}, "sizes"), ({"wall_density": 0.9}, "wall_density"),
     ({"wall_density": -0.1}, "wall_density"), ({"max_steps": 0}, "max_steps"),
     ({"min_distance": 0}, "min_distance"), ({"min_distance": 30}, "min_distance"),
     ({"num_train_tasks": 0}, "num_train_tasks"), ({"num_test_tasks": 0}, "num_test_tasks"),
     ({"name": ""}, "name")],
)
def test_bad_constructor_args(kwargs, arg):
    with pytest.raises(ValueError, match=arg):
        MazeEnv(**kwargs)


def test_task_index_out_of_range():
    env = MazeEnv(num_test_tasks=10)
    with pytest.raises(ValueError, match="index"):
        env.reset(_task("test", 10))


def test_imports_without_torch():
    code = "import sys; sys.modules['torch'] = None; import cope.envs.maze; print('ok')"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"
