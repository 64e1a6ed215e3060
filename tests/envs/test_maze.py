"""Tests for the built-in grid maze env (`cope.envs.maze`)."""
from __future__ import annotations

import random
import re
import subprocess
import sys

import pytest

from cope.envs.base import Env, Task
from cope.envs.maze import DIRECTIONS, HARNESS_INVALID, SUCCESS_TEXT, MazeEnv, MazeLayout, parse_action

_OFFSET = r"(Wall\. )?Goal: (\d+ (north|south)(, \d+ (east|west))?|\d+ (east|west))\. "
_MOVES = r"(none|(north|south|east|west)(, (north|south|east|west))*)"
STATUS_RE = re.compile(_OFFSET + rf"Closer: {_MOVES}\. Open: {_MOVES}\.")  # compass=True (default)
OLD_STATUS_RE = re.compile(_OFFSET + rf"Open: {_MOVES}\.")  # compass=False


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


def _place(env: MazeEnv, size: int, walls: set, pos: tuple, goal: tuple) -> str:
    """Put the agent of ``env`` at ``pos`` in a hand-made layout and return its status line."""
    env._layout = MazeLayout(size, frozenset(walls), pos, goal)
    env._pos = pos
    return env._status()


def _closer(obs: str) -> list[str]:
    listed = re.search(r"Closer: ([a-z, ]+)\. Open:", obs).group(1)
    return [] if listed == "none" else listed.split(", ")


# 5x5, agent A at (2,2) (rows grow south, columns east; # wall):
#
#     .....
#     ..#..
#     .#A..
#     .....
#     .....
@pytest.mark.parametrize(
    ("goal", "closer", "offset"),
    [((4, 4), "south, east", "2 south, 2 east"),  # both goalward moves open
     ((4, 0), "south", "2 south, 2 west"),  # west is a wall, south is open
     ((0, 0), "none", "2 north, 2 west"),  # both goalward moves are walls
     ((0, 4), "east", "2 north, 2 east"),  # north is a wall, east is open
     ((4, 2), "south", "2 south"),  # straight south: east/west would lengthen the offset
     ((2, 4), "east", "2 east"),  # straight east: south would lengthen the offset
     ((2, 0), "none", "2 west")],  # straight west, through the wall
)
def test_closer_on_hand_picked_layout(goal, closer, offset):
    env = MazeEnv()
    obs = _place(env, 5, {(1, 2), (2, 1)}, (2, 2), goal)
    assert obs == f"Goal: {offset}. Closer: {closer}. Open: south, east."


def test_closer_none_at_edge_and_old_format_without_compass():
    # 4x4, agent at the north-west corner, goal 3 east behind a wall: the only open move is south.
    walls, pos, goal = {(0, 1)}, (0, 0), (0, 3)
    assert _place(MazeEnv(), 4, walls, pos, goal) == "Goal: 3 east. Closer: none. Open: south."
    assert _place(MazeEnv(compass=False), 4, walls, pos, goal) == "Goal: 3 east. Open: south."
    assert _place(MazeEnv(compass=False), 5, {(1, 2), (2, 1)}, (2, 2), (4, 0)) == (
        "Goal: 2 south, 2 west. Open: south, east."
    )


@pytest.mark.parametrize("split", ["train", "test"])
def test_closer_is_exactly_the_open_moves_that_shorten_the_offset(split):
    env = MazeEnv()
    seen_none = seen_some = 0
    for index in range(100):
        reset = env.reset(_task(split, index))
        obs, rng = reset.observation.split("\n")[1], random.Random(index)
        for _ in range(env.max_steps):
            (gr, gc), (r, c) = env._layout.goal, env._pos
            open_moves = env._layout.open_moves(env._pos)
            expected = [
                d for d, (dr, dc) in DIRECTIONS.items()
                if d in open_moves and (abs(gr - r - dr) < abs(gr - r) or abs(gc - c - dc) < abs(gc - c))
            ]
            assert STATUS_RE.fullmatch(obs)
            assert _closer(obs) == expected and set(expected) <= set(open_moves)
            seen_none += not expected
            seen_some += bool(expected)
            out = env.step(rng.choice(open_moves))
            if out.done:
                break
            obs = out.observation
    assert seen_none > 0 and seen_some > 0


def test_compass_false_gives_the_old_format():
    on, off = MazeEnv(), MazeEnv(compass=False)
    assert on.compass is True and off.compass is False
    for index in range(30):
        a, b = on.reset(_task(index=index)), off.reset(_task(index=index))
        assert a.admissible_actions == b.admissible_actions and a.info == b.info
        for _ in range(4):
            assert "Closer" not in b.observation and OLD_STATUS_RE.fullmatch(b.observation.split("\n")[-1])
            assert re.sub(r" Closer: [a-z, ]+\.", "", a.observation) == b.observation
            move = _bump(on) or a.admissible_actions[0]  # exercise the "Wall. " prefix too
            a, b = on.step(move), off.step(move)
            if a.done:
                assert b.done and a.observation == b.observation == SUCCESS_TEXT
                break


def _solve_rate(policy, seed: int, num: int = 200) -> float:
    env, rng, wins = MazeEnv(), random.Random(seed), 0
    for index in range(num):
        out = env.reset(_task("test", index))
        while True:
            out = env.step(policy(out.observation, out.admissible_actions, rng))
            if out.done:
                wins += out.success
                break
    return wins / num


def test_following_the_compass_solves_most_mazes():
    """Taking a Closer move whenever there is one (chosen at random among them), else the first open
    move, solves most test mazes; uniformly random open moves solve few."""

    def compass(obs, open_moves, rng):
        closer = _closer(obs)
        return rng.choice(closer) if closer else open_moves[0]

    def uniform(obs, open_moves, rng):
        return rng.choice(open_moves)

    guided = [_solve_rate(compass, seed) for seed in range(2)]
    blind = [_solve_rate(uniform, seed) for seed in range(2)]
    assert min(guided) >= 0.6, guided
    assert max(blind) <= 0.3, blind
    assert min(guided) - max(blind) >= 0.4, (guided, blind)


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
