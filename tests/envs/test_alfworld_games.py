"""Tests for the alfworld-style (generated) games (`cope.envs.alfworld.games`, `cope.envs.alfworld.scenes`):
determinism, cache, file layout, splits, and three experts that must win them through our adapter
(`cope.envs.alfworld.env`) on the real engine: the stored walkthrough, alfworld's fast-downward planner, and a
hand-coded expert that sees only the text and the admissible commands.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from cope.envs.alfworld.env import NOTHING_HAPPENS, AlfWorldEnv
from cope.envs.alfworld.scenes import TASK_TYPES
from cope.envs.base import Task

pytest.importorskip("alfworld", reason="needs the alfworld extra (alfworld==0.4.2)")
from alfworld_fixtures import GEN, alfworld_data, cache  # noqa: E402,F401 - fixtures used by name

pytestmark = pytest.mark.long  # real env engines: seconds to a minute per test (make test-fast leaves them out)


@pytest.fixture(scope="module")
def env(cache):
    e = AlfWorldEnv(source="generated", task_types=["pick_and_place_simple"], cache_dir=cache)
    yield e
    e.close()


def _task(split="train", index=0) -> Task:
    return Task(GEN, split, index)


def test_generator_is_deterministic_and_byte_identical(tmp_path):
    from cope.envs.alfworld.games import ensure_game, game_files
    from cope.envs.alfworld.scenes import sample_scene

    for split, index in (("train", 0), ("train", 5), ("test", 2)):
        a = ensure_game(str(tmp_path / "a"), split, index)
        b = ensure_game(str(tmp_path / "b"), split, index)
        for name in ("game.tw-pddl", "traj_data.json", "initial_state.pddl"):
            fa, fb = Path(a).with_name(name), Path(b).with_name(name)
            assert fa.read_bytes() == fb.read_bytes()
        assert game_files(sample_scene(split, index, TASK_TYPES)) == game_files(sample_scene(split, index, TASK_TYPES))
    one, other = ensure_game(str(tmp_path / "a"), "train", 0), ensure_game(str(tmp_path / "a"), "train", 1)
    assert Path(one).read_bytes() != Path(other).read_bytes()
    seeded = ensure_game(str(tmp_path / "a"), "train", 0, seed=1)
    assert seeded != one and Path(seeded).read_bytes() != Path(one).read_bytes()


def test_generated_files_look_like_an_official_game_folder(tmp_path):
    from cope.envs.alfworld.games import GENERATOR_NAME, ensure_game

    path = Path(ensure_game(str(tmp_path), "test", 4))
    game = json.loads(path.read_text())
    traj = json.loads(path.with_name("traj_data.json").read_text())
    assert set(game) == {"pddl_domain", "grammar", "pddl_problem", "solvable", "walkthrough"}
    assert game["solvable"] is True and game["walkthrough"]
    assert game["pddl_problem"] == path.with_name("initial_state.pddl").read_text()
    assert "UNKNOWN GOAL" not in game["grammar"] and "(define (domain alfred)" in game["pddl_domain"]
    assert "alfworld-style (generated)" in GENERATOR_NAME and traj["generator"] == GENERATOR_NAME
    assert "Not an ALFWorld benchmark game" in game["pddl_problem"].splitlines()[0]
    assert traj["task_type"] in TASK_TYPES and traj["split"] == "test"
    assert set(traj["pddl_params"]) >= {"object_target", "parent_target", "toggle_target", "mrecep_target", "object_sliced"}
    assert traj["turk_annotations"]["anns"][0]["task_desc"] in game["grammar"]


def test_cache_is_reused_and_written_atomically(tmp_path):
    from cope.envs.alfworld.games import ensure_game

    path = Path(ensure_game(str(tmp_path), "train", 3))
    path.write_text(path.read_text())  # same bytes, new mtime
    mtime = path.stat().st_mtime_ns
    assert Path(ensure_game(str(tmp_path), "train", 3)) == path and path.stat().st_mtime_ns == mtime
    leftovers = [p for p in path.parent.parent.iterdir() if p.name.startswith(".")]
    assert leftovers == [] and sorted(p.name for p in path.parent.iterdir()) == [
        "game.tw-pddl", "initial_state.pddl", "traj_data.json"]


def test_train_and_test_use_disjoint_floor_plans_and_every_task_type():
    from cope.envs.alfworld.scenes import floor_plans, sample_scene

    seen = {"train": set(), "test": set()}
    types = set()
    for split in seen:
        for index in range(60):
            scene = sample_scene(split, index, TASK_TYPES)
            assert scene.floor_plan in floor_plans(split)
            seen[split].add(scene.floor_plan)
            types.add(scene.task_type)
            targets = [o for o in scene.objects if o.type == scene.object_target]
            assert targets and all(scene.receptacle(o.where).type != scene.parent_target for o in targets)
            if scene.task_type == "pick_two_obj_and_place":
                assert len(targets) >= 2
    assert not set(floor_plans("train")) & set(floor_plans("test"))
    assert seen["train"] and seen["test"] and types == set(TASK_TYPES)


# -- episodes through the adapter -------------------------------------------------------------------------------
@pytest.mark.parametrize("task_type", TASK_TYPES)
def test_expert_walkthrough_wins_through_the_adapter(task_type, cache):
    env = AlfWorldEnv(source="generated", task_types=[task_type], cache_dir=cache)
    try:
        reset = env.reset(_task("train", 1))
        assert reset.info["task_type"] == task_type and reset.info["source"] == "generated"
        assert reset.observation.startswith("-= Welcome to TextWorld, ALFRED! =-")
        assert reset.task_description.startswith("Your task is to: ") and reset.observation.endswith(reset.task_description)
        plan = env.expert_plan()
        for i, action in enumerate(plan):
            out = env.step(action)
            assert out.valid and out.harness == "" and out.observation != NOTHING_HAPPENS, (action, out)
            last = i == len(plan) - 1
            assert out.success == out.done == last and out.score == out.reward == (1.0 if last else 0.0)
        assert out.info["timeout"] is False
        with pytest.raises(RuntimeError, match="reset"):
            env.step("look")
    finally:
        env.close()


def test_package_planner_solves_a_generated_game_through_the_adapter(env):
    """alfworld's planner expert (fast-downward, AlfredExpertType.PLANNER) plans from the engine state alone."""
    env.reset(_task("train", 2))
    engine = env._engine.unwrapped
    plan = engine._pddl_state.replan(engine._entity_infos)
    assert plan
    for action in plan:
        out = env.step(action)
        assert out.valid
    assert out.success and out.done and out.score == 1.0 and out.reward == 1.0


_GOALS = [  # alfworld's task sentence templates -> (object, parent, lamp, verb, count)
    (re.compile(r"(?:look at|examine the) (\w+) (?:under|with) the (\w+)"), lambda m: (m[1], "", m[2], "", 1)),
    (re.compile(r"put a (clean|hot|cool) (\w+) in (\w+)"), lambda m: (m[2], m[3], "", m[1], 1)),
    (re.compile(r"(clean|heat|cool) some (\w+) and put it in (\w+)"), lambda m: (m[2], m[3], "", m[1], 1)),
    (re.compile(r"(?:put|find) two (\w+) (?:in|and put them in) (\w+)"), lambda m: (m[1], m[2], "", "", 2)),
    (re.compile(r"put (?:a|some) (\w+) (?:in|on) (\w+)"), lambda m: (m[1], m[2], "", "", 1)),
]
_VERB = {"clean": ("clean", "sinkbasin"), "hot": ("heat", "microwave"), "heat": ("heat", "microwave"),
         "cool": ("cool", "fridge")}


def _text_expert(env: AlfWorldEnv, task: Task, limit: int = 80):
    """A hand-coded expert that sees only the text and the admissible commands (no game files): visit the
    receptacles until the object can be taken, use the appliance the task names, then put it where the task
    says (or find the lamp and switch it on). Returns the last EnvStep and the number of steps."""
    reset = env.reset(task)
    goal = reset.task_description.removeprefix("Your task is to: ").rstrip(".")
    obj, parent, lamp, verb, count = next(fn(m) for rx, fn in _GOALS if (m := rx.fullmatch(goal)))
    adm, obs, out, steps = reset.admissible_actions, reset.observation, None, 0
    places = [a.removeprefix("go to ") for a in adm if a.startswith("go to ")]  # every receptacle, from the intro
    search = [p for p in places if not p.startswith(f"{parent} ")]

    def first(prefix: str, contains: str = "") -> str | None:
        return next((a for a in adm if a.startswith(prefix) and contains in a), None)

    def act(action: str) -> None:
        nonlocal adm, obs, out, steps
        out = env.step(action)
        assert out.valid, (action, out.observation)
        adm, obs, steps = out.admissible_actions, out.observation, steps + 1
        assert steps <= limit

    def visit(place: str) -> None:  # a receptacle at the agent's own spot has no "go to": look at it instead
        act(f"go to {place}" if f"go to {place}" in adm else f"examine {place}")
        if "is closed" in obs and f"open {place}" in adm:
            act(f"open {place}")

    placed: list[str] = []  # "box 1": already where it belongs

    def take() -> str | None:
        return next((a for a in adm if a.startswith(f"take {obj} ") and a.split(" from ")[0][5:] not in placed), None)

    for _ in range(count):
        queue = list(search)
        while take() is None:
            visit(queue.pop(0))
        act(take())
        if verb:
            command, appliance = _VERB[verb]
            if first(f"{command} {obj} ") is None:
                visit(next(p for p in places if p.startswith(f"{appliance} ")))
            act(first(f"{command} {obj} "))
        if lamp:
            queue = list(search)
            while first(f"use {lamp} ") is None:
                visit(queue.pop(0))
            act(first(f"use {lamp} "))
            break
        visit(next(p for p in places if p.startswith(f"{parent} ")))
        move = first(f"move {obj} ", f" to {parent} ")
        act(move)
        placed.append(move.split(" to ")[0][5:])
    return out, steps


@pytest.mark.parametrize("task_type", ["pick_and_place_simple", "pick_heat_then_place_in_recep"])
def test_text_only_expert_solves_generated_games(task_type, cache):
    env = AlfWorldEnv(source="generated", task_types=[task_type], cache_dir=cache, max_steps=150)
    try:
        out, steps = _text_expert(env, _task("test", 0), limit=150)
        assert out.success and out.done and out.score == 1.0 and out.reward == 1.0, (steps, out)
    finally:
        env.close()


@pytest.mark.slow
@pytest.mark.parametrize("task_type", TASK_TYPES)
def test_text_only_expert_solves_every_task_type(task_type, cache):
    env = AlfWorldEnv(source="generated", task_types=[task_type], cache_dir=cache, max_steps=150)
    try:
        for index in range(3):
            out, steps = _text_expert(env, _task("train", index), limit=150)
            assert out.success and out.done and out.score == 1.0, (index, steps, out)
    finally:
        env.close()
