"""Tests for the ALFWorld adapter (`cope.envs.alfworld.env`); the generator and the experts are in
test_alfworld_games.py.

Everything runs on alfworld-style generated games through the real engine (alfworld 0.4.2's grammar and
domain, textworld's PddlEnv, fast-downward); the official loader is checked on a fake ``json_2.1.1`` tree
made of generated games laid out the official way. A reset of a new game costs about a second (PDDL
translation), so engines are shared per module and the number of distinct games is kept small.
"""
from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from cope.envs.alfworld.env import (
    HARNESS_MALFORMED,
    HARNESS_TIMEOUT,
    NOTHING_HAPPENS,
    AlfWorldEnv,
    missing_data_message,
)
from cope.envs.base import Env, Task

needs_alfworld = pytest.mark.skipif(importlib.util.find_spec("alfworld") is None,
                                    reason="needs the alfworld extra (alfworld==0.4.2)")
from alfworld_fixtures import GEN, alfworld_data, cache  # noqa: E402,F401 - fixtures used by name

pytestmark = pytest.mark.long  # real env engines: seconds to a minute per test (make test-fast leaves them out)


@pytest.fixture(scope="module")
def env(cache):
    pytest.importorskip("alfworld", reason="needs the alfworld extra (alfworld==0.4.2)")
    e = AlfWorldEnv(source="generated", task_types=["pick_and_place_simple"], cache_dir=cache, max_steps=50)
    yield e
    e.close()


def _task(split="train", index=0, name=GEN) -> Task:
    return Task(name, split, index)


# -- construction, names, errors (no alfworld needed) ------------------------------------------------------------
def test_protocol_names_and_instructions(cache):
    gen = AlfWorldEnv(source="generated", cache_dir=cache, num_train_tasks=7, num_test_tasks=3)
    assert isinstance(gen, Env) and gen.name == GEN
    assert gen.num_tasks("train") == 7 and gen.num_tasks("test") == 3
    assert AlfWorldEnv().name == "alfworld" and AlfWorldEnv(source="generated", name="x").name == "x"
    for word in ("go to", "take", "move", "heat", "cool", "clean", "use", "open", "one command"):
        assert word in gen.instructions
    with pytest.raises(ValueError, match="split"):
        gen.num_tasks("valid")
    with pytest.raises(ValueError, match="index"):
        gen.game_file("test", 3)


@pytest.mark.parametrize(
    ("kwargs", "arg"),
    [({"source": "thor"}, "source"), ({"task_types": []}, "task_types"), ({"task_types": ["pick_apple"]}, "task_types"),
     ({"task_types": ["look_at_obj_in_light"] * 2}, "task_types"), ({"max_steps": 0}, "max_steps"),
     ({"max_observation_chars": 10}, "max_observation_chars"), ({"hidden_commands": "help"}, "hidden_commands"),
     ({"test_split": "valid_train"}, "test_split"), ({"num_train_tasks": 0}, "num_train_tasks"),
     ({"num_test_tasks": 0}, "num_test_tasks"), ({"name": ""}, "name")],
)
def test_bad_constructor_args(kwargs, arg):
    with pytest.raises(ValueError, match=arg):
        AlfWorldEnv(**kwargs)


def test_missing_official_data_says_how_to_get_it(tmp_path):
    env = AlfWorldEnv(source="official", data_dir=str(tmp_path / "nowhere"))
    for call in (lambda: env.num_tasks("train"), lambda: env.reset(_task(name="alfworld"))):
        with pytest.raises(FileNotFoundError) as err:
            call()
        text = str(err.value)
        assert text == missing_data_message(str(tmp_path / "nowhere"))
        for needle in ("alfworld-download", "pip install 'cope-trainer[alfworld]'", "ALFWORLD_DATA",
                       "env.source=generated", "not the ALFWorld benchmark", "json_2.1.1"):
            assert needle in text


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)


def test_imports_without_torch_or_the_engine():
    code = ("import sys; sys.modules['torch'] = None\n"
            "import cope.envs.alfworld.env, cope.envs.alfworld.games, cope.envs.alfworld.scenes\n"
            "heavy = [m for m in ('torch', 'alfworld', 'textworld', 'fast_downward', 'numpy') if sys.modules.get(m)]\n"
            "print('ok', heavy)")
    result = _run(code)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok []"


def test_missing_package_error_names_the_extra(tmp_path):
    code = ("import sys; sys.modules['alfworld'] = None\n"
            "from cope.envs.alfworld.env import AlfWorldEnv; from cope.envs.base import Task\n"
            f"env = AlfWorldEnv(source='generated', cache_dir={str(tmp_path)!r})\n"
            "try:\n    env.reset(Task(env.name, 'train', 0))\n"
            "except ImportError as e:\n    print('ImportError:', e)\n")
    result = _run(code)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("ImportError:") and "pip install 'cope-trainer[alfworld]'" in result.stdout


# -- generator --------------------------------------------------------------------------------------------------@needs_alfworld
def test_inadmissible_and_malformed_actions_are_invalid(env):
    reset = env.reset(_task())
    for action in ("jump", "take unicorn 1 from countertop 1", "go to the moon"):
        out = env.step(action)
        assert not out.valid and out.observation == NOTHING_HAPPENS and out.harness == ""
        assert out.admissible_actions == reset.admissible_actions and not out.done and out.reward == 0.0
    for action in ("", "   ", "go to cabinet 1\nopen cabinet 1"):
        out = env.step(action)
        assert not out.valid and out.observation == "" and out.harness == HARNESS_MALFORMED
        assert out.admissible_actions == reset.admissible_actions
    target = reset.admissible_actions[0]
    assert target.startswith("go to ")
    out = env.step(f'Action: "{target.upper()}."')  # model noise is tolerated: same command
    assert out.valid and out.info["command"] == target and out.observation.startswith("You arrive at ")


@needs_alfworld
@pytest.mark.parametrize("action", ["\\help", "\\N wh sto fridge", "go\\_north", "\\", "#", "/look", "*",
                                    "restart", "restore", "save", "quit", "undo", "script", "tw-trace-actions"])
def test_interpreter_escapes_are_plain_inadmissible_commands(env, action):
    """TextWorld's z-machine interpreter takes "\\help" as its own command and never returns (cope.envs.textworld);
    ALFWorld's PDDL engine has no interpreter: these are commands it does not know, and nothing changes."""
    reset = env.reset(_task())
    out = env.step(action)
    assert not out.valid and out.observation == NOTHING_HAPPENS and out.harness == "" and not out.done
    assert out.admissible_actions == reset.admissible_actions
    assert env.step("look").valid


@needs_alfworld
def test_admissible_actions_come_from_the_engine_and_hide_help(env):
    reset = env.reset(_task())
    engine_list = env._state["admissible_commands"]
    assert "help" in engine_list and "help" not in reset.admissible_actions
    assert reset.admissible_actions == [a for a in engine_list if a != "help"]
    assert {"look", "inventory"} <= set(reset.admissible_actions)
    out = env.step("help")  # hidden, still a valid command
    assert out.valid and "Available commands" in out.observation
    shown = AlfWorldEnv(source="generated", task_types=["pick_and_place_simple"], cache_dir=env.cache_dir,
                        hidden_commands=())
    try:
        assert "help" in shown.reset(_task()).admissible_actions
    finally:
        shown.close()


@needs_alfworld
def test_observation_and_harness_split_on_truncation_and_timeout(env):
    full = env.reset(_task())
    help_text = env.step("help").observation
    small = AlfWorldEnv(source="generated", task_types=["pick_and_place_simple"], cache_dir=env.cache_dir,
                        max_observation_chars=120, max_steps=2)
    try:
        reset = small.reset(_task())
        assert reset.observation == full.observation[:120] and "120 of" in reset.harness
        out = small.step("help")
        assert out.observation == help_text[:120] and out.harness == f"[observation truncated: 120 of {len(help_text)} characters shown]"
        out = small.step("look")
        assert out.done and not out.success and out.info["timeout"] and out.harness.endswith(HARNESS_TIMEOUT)
        assert HARNESS_TIMEOUT not in out.observation and out.score == 0.0 and out.reward == 0.0
        with pytest.raises(RuntimeError, match="reset"):
            small.step("look")
    finally:
        small.close()


@needs_alfworld
def test_same_task_same_game_and_close_is_safe(env, cache):
    a = env.reset(_task("test", 1))
    other = AlfWorldEnv(source="generated", task_types=["pick_and_place_simple"], cache_dir=cache)
    b = other.reset(_task("test", 1))
    assert a.observation == b.observation and a.admissible_actions == b.admissible_actions
    assert a.info["gamefile"] == b.info["gamefile"]
    other.close()
    other.close()
    assert other.reset(_task("test", 1)).observation == a.observation  # usable again after close
    other.close()
    with pytest.raises(RuntimeError, match="before reset"):
        other.step("look")


def _fake_official_tree(root: Path, cache: str) -> None:
    """json_2.1.1/<split>/<task_type>-<Obj>-None-<Parent>-<N>/trial_<id>/ made of generated games, plus the
    folders AlfredTWEnv skips (movable, Sliced, unsolvable)."""
    from cope.envs.alfworld.games import ensure_game

    def add(split, folder, index, task_types, solvable=True):
        src = Path(ensure_game(cache, "train", index, task_types)).parent
        dst = root / "json_2.1.1" / split / folder / f"trial_T{index:04d}"
        shutil.copytree(src, dst)
        if not solvable:
            game = json.loads((dst / "game.tw-pddl").read_text())
            (dst / "game.tw-pddl").write_text(json.dumps({**game, "solvable": False}))

    simple, light = ["pick_and_place_simple"], ["look_at_obj_in_light"]
    add("train", "pick_and_place_simple-Apple-None-CounterTop-10", 0, simple)
    add("train", "pick_and_place_simple-Book-None-Shelf-11", 1, simple)
    add("train", "look_at_obj_in_light-Pen-None-DeskLamp-301", 2, light)
    add("train", "pick_and_place_with_movable_recep-Apple-Bowl-Fridge-12", 3, simple)
    add("train", "pick_and_place_simple-AppleSliced-None-Fridge-13", 4, simple)
    add("train", "pick_and_place_simple-Egg-None-Fridge-14", 5, simple, solvable=False)
    add("valid_unseen", "pick_and_place_simple-Cup-None-Shelf-10", 6, simple)
    add("valid_seen", "pick_and_place_simple-Mug-None-Shelf-1", 7, simple)
    add("valid_seen", "look_at_obj_in_light-CD-None-DeskLamp-1", 8, light)


@needs_alfworld
def test_official_layout_splits_task_types_and_filters(tmp_path, cache):
    _fake_official_tree(tmp_path, cache)
    env = AlfWorldEnv(source="official", data_dir=str(tmp_path))
    assert env.name == "alfworld"
    assert env.num_tasks("train") == 3 and env.num_tasks("test") == 1  # valid_unseen
    assert AlfWorldEnv(source="official", data_dir=str(tmp_path), test_split="valid_seen").num_tasks("test") == 2
    only = AlfWorldEnv(source="official", data_dir=str(tmp_path), task_types=["look_at_obj_in_light"])
    assert only.num_tasks("train") == 1 and "look_at_obj_in_light-Pen" in only.game_file("train", 0)
    paths = [env.game_file("train", i) for i in range(3)]
    assert paths == sorted(paths) and not any("movable" in p or "Sliced" in p or "Egg" in p for p in paths)
    try:
        reset = env.reset(Task("alfworld", "test", 0))
        assert reset.info["source"] == "official" and reset.info["task_type"] == "pick_and_place_simple"
        assert "valid_unseen" in reset.info["gamefile"]
        for action in env.expert_plan():
            out = env.step(action)
        assert out.success and out.score == 1.0
    finally:
        env.close()


@needs_alfworld
def test_train_one_epoch_on_generated_games(run_train, tmp_path, cache):
    result = run_train(["env=alfworld", "env.source=generated", f"env.cache_dir={cache}",
                        "env.task_types=[pick_and_place_simple]",
                        "model.max_context=2048", "data.max_context=2048", "model.tokenizer_episodes=4",
                        "model.warm_start_walks=4", "model.warm_start_steps=2", "data.tasks_per_epoch=1",
                        "data.group_size=2", "data.minibatch_size=2", "data.val_tasks=1", "data.val_batch_size=1",
                        "trainer.max_epochs=1", "env.max_steps=3", "validate_before_fit=false"], tmp_path)
    assert result["counters/episodes"] == 2


@needs_alfworld
def test_engine_memo_changes_nothing_but_time(cache, monkeypatch):
    from collections import OrderedDict

    from cope.envs.alfworld import engine as alfworld_engine

    monkeypatch.setattr(alfworld_engine, "_MEMO", OrderedDict())  # empty memos for this test
    monkeypatch.setattr(alfworld_engine, "_PARSES", OrderedDict())
    argv = list(sys.argv)
    fresh = AlfWorldEnv(source="generated", task_types=["look_at_obj_in_light"], cache_dir=cache, engine_memo=False)
    memo = AlfWorldEnv(source="generated", task_types=["look_at_obj_in_light"], cache_dir=cache)
    try:
        a = fresh.reset(_task("test", 3))
        fresh.step("look")
        assert not alfworld_engine._MEMO and not alfworld_engine._PARSES and sys.argv == argv  # memo off: untouched
        b = memo.reset(_task("test", 3))
        assert len(alfworld_engine._MEMO) == 2 and sys.argv == argv  # plain + planner translation
        parses = len(alfworld_engine._PARSES)
        assert parses > 0
        memo.reset(_task("test", 3))
        assert len(alfworld_engine._MEMO) == 2 and len(alfworld_engine._PARSES) == parses  # all served from memo
        fresh.reset(_task("test", 3))
        assert (a.observation, a.admissible_actions) == (b.observation, b.admissible_actions)
        for action in ["look", "inventory", "jump", *fresh.expert_plan()]:
            x, y = fresh.step(action), memo.step(action)
            assert (x.observation, x.admissible_actions, x.valid, x.success) == (
                y.observation, y.admissible_actions, y.valid, y.success)
        assert x.success
    finally:
        fresh.close()
        memo.close()
