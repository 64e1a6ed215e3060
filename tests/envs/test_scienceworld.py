"""Tests for the ScienceWorld adapter (`cope.envs.scienceworld.env`, task map and reply parsing).

The table/text tests need nothing; the rest need the ``scienceworld`` package (extra ``scienceworld``)
and Java. JVMs start in seconds, so the simulator tests share module-scoped instances.
"""
from __future__ import annotations

import importlib.util
import os
import pickle
import shutil
import subprocess
import sys

import pytest

from cope.envs.base import Env, Task
from cope.envs.scienceworld.tasks import (
    TASK_NAMES,
    TASK_TABLE,
    TaskMap,
    parse_simplifications,
    resolve_tasks,
    split_variations,
)
from cope.envs.scienceworld.text import is_no_effect, is_parse_failure, parse_menu

pytestmark = pytest.mark.long  # real env engines: seconds to a minute per test (make test-fast leaves them out)

HAVE_SW = importlib.util.find_spec("scienceworld") is not None
needs_sw = pytest.mark.skipif(not HAVE_SW, reason="needs the scienceworld package: pip install 'cope-trainer[scienceworld]'")
needs_jvm = pytest.mark.skipif(not HAVE_SW or shutil.which("java") is None,
                               reason="needs the scienceworld package and Java (java on PATH)")
MENU = ("Ambiguous request: Please enter the number for the action you intended (or blank to cancel):\n"
        "0:\topen door between kitchen and hallway\n1:\topen door between bedroom and hallway\n")


def _task(split: str, index: int) -> Task:
    return Task("scienceworld", split, index)


def _find(env, split: str, name: str, variation: int) -> Task:
    return _task(split, env._maps[split].pairs.index((name, variation)))


# -- task table and index map (no JVM) ---------------------------------------------------------------
def test_task_table():
    assert len(TASK_TABLE) == 30 and len(set(TASK_NAMES)) == 30
    assert sum(row[2] for row in TASK_TABLE) == 7207
    assert all(0 < tr and 0 < dev and tr + dev < total for _, _, total, tr, dev in TASK_TABLE)


def test_resolve_tasks():
    assert resolve_tasks(None) == resolve_tasks([]) == TASK_NAMES
    assert resolve_tasks(["4-4", "boil", "10-2"]) == ("find-animal", "boil", "mendelian-genetics-unknown-plant")
    for bad in (["boil", "1-1"], ["no-such-task"], "boil"):
        with pytest.raises(ValueError, match="tasks"):
            resolve_tasks(bad)


@pytest.mark.parametrize("split", ["train", "test"])
def test_task_map_interleaves_every_variation_once(split):
    m = TaskMap.build(TASK_NAMES, split, "dev")
    assert len(set(m.pairs)) == len(m)
    assert len(m) == sum(len(split_variations(t, split, "dev")) for t in TASK_NAMES)
    assert [t for t, _ in m.pairs[:30]] == list(TASK_NAMES)  # any prefix spreads over the tasks
    assert m.pairs[0] == ("boil", 0 if split == "train" else 14)
    for t, v in m.pairs:
        assert v in split_variations(t, split, "dev")
    capped = [t for t, _ in TaskMap.build(["boil", "identify-life-stages-2"], split, "dev", 3).pairs]
    if split == "train":  # identify-life-stages-2 has 4 train and 2 dev variations
        assert capped == ["boil", "identify-life-stages-2"] * 3
    else:
        assert capped == ["boil", "identify-life-stages-2"] * 2 + ["boil"]


def test_splits_are_disjoint_and_cover_all_variations():
    for _, name, total, _, _ in TASK_TABLE:
        parts = [set(split_variations(name, "train")), set(split_variations(name, "test", "dev")),
                 set(split_variations(name, "test", "test"))]
        assert all(parts) and sum(map(len, parts)) == total == len(set().union(*parts)) == max(parts[2]) + 1


def test_parse_simplifications():
    assert parse_simplifications("", TASK_NAMES) == ""
    assert parse_simplifications("easy", TASK_NAMES) == "easy"
    assert parse_simplifications(" teleportAction, openDoors ", ["boil"]) == "teleportAction,openDoors"
    assert parse_simplifications("noElectricalAction", ["boil"]) == "noElectricalAction"
    for bad, tasks in (("teleport", ["boil"]), ("openDoors,openDoors", ["boil"]), ("noElectricalAction", TASK_NAMES)):
        with pytest.raises(ValueError, match="simplifications"):
            parse_simplifications(bad, tasks)


def test_reply_parsing():
    assert parse_menu(MENU) == ["open door between kitchen and hallway", "open door between bedroom and hallway"]
    assert parse_menu("The door is now open.") is None
    assert is_parse_failure("No known action matches that input.")
    assert is_parse_failure("Unknown action.  Type 'help' for a list of actions, and 'objects' for a list of possible object referents. ")
    for refusal in ("The door is already open.", "The stove is not moveable.", "It's not clear how to get there from here.",
                    "You can't move something into itself.", "The thermometer is not edible.",
                    "The stove appears broken, and can't be activated or deactivated.",
                    "Mixing the contents of the cupboard does not appear to produce anything new.",
                    "That container is empty, so there are no items to mix.", "There is only one thing (orange)",
                    "The door is not open."):
        assert is_no_effect(refusal) and not is_parse_failure(refusal), refusal
    for ok in ("The door is now open.", "You move to the kitchen.", "You focus on the air.", MENU,
               "a fridge. The fridge door is closed.\nThe freezer is already open."):
        assert not is_no_effect(ok) and not is_parse_failure(ok), ok


def test_imports_without_torch_and_lazy_import_error():
    code = ("import sys; sys.modules['torch'] = None; sys.modules['scienceworld'] = None\n"
            "import cope.envs.scienceworld.env as m\n"
            "try:\n    m.ScienceWorldEnv()\nexcept ImportError as e:\n    print('error:', e)\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert "pip install 'cope-trainer[scienceworld]'" in result.stdout


# -- construction (package, no JVM) -----------------------------------------------------------------
@needs_sw
@pytest.mark.parametrize(
    ("kwargs", "arg"),
    [({"tasks": ["nope"]}, "tasks"), ({"test_split": "val"}, "test_split"), ({"simplifications": "fast"}, "simplifications"),
     ({"max_variations_per_task": -1}, "max_variations_per_task"), ({"max_steps": 0}, "max_steps"),
     ({"reward_mode": "dense"}, "reward_mode"), ({"max_admissible_actions": -2}, "max_admissible_actions"),
     ({"ambiguity": "ask"}, "ambiguity"), ({"max_observation_chars": 0}, "max_observation_chars"),
     ({"jvm_heap_mb": 64}, "jvm_heap_mb"), ({"jvm_args": ["Xss1m"]}, "jvm_args"), ({"jvm_args": "-Xss1m"}, "jvm_args"),
     ({"name": ""}, "name")],
)
def test_bad_constructor_args(kwargs, arg):
    from cope.envs.scienceworld.env import ScienceWorldEnv

    with pytest.raises(ValueError, match=arg):
        ScienceWorldEnv(**kwargs)


@needs_sw
def test_construction_starts_no_jvm_and_pickles():
    from cope.envs.scienceworld.env import ScienceWorldEnv

    env = ScienceWorldEnv(tasks=["1-1", "4-4"], test_split="test", max_variations_per_task=5)
    assert isinstance(env, Env) and env.jvm_pid is None
    assert env.num_tasks("train") == 10 and env.num_tasks("test") == 10
    assert env.task_pair(_task("test", 1)) == ("find-animal", 225)
    with pytest.raises(ValueError, match="split"):
        env.num_tasks("dev")
    with pytest.raises(ValueError, match="index"):
        env.task_pair(_task("train", 10))
    clone = pickle.loads(pickle.dumps(env))
    assert clone.num_tasks("train") == 10 and clone.javaopts == env.javaopts
    assert env.javaopts[0] == "-Xmx384m" and "-XX:+UseSerialGC" in env.javaopts
    assert "teleport" not in env.instructions and "number" in env.instructions
    assert "teleport to LOC" in ScienceWorldEnv(simplifications="easy", ambiguity="first").instructions


# -- the simulator --------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def env():
    from cope.envs.scienceworld.env import ScienceWorldEnv

    e = ScienceWorldEnv(max_steps=100)
    yield e
    e.close()


@needs_jvm
def test_task_table_matches_the_simulator(env):
    env.reset(_task("train", 0))
    server = env._sim.server
    assert sorted(server.getTaskNames()) == sorted(TASK_NAMES)
    for _, name, total, _n_train, _n_dev in TASK_TABLE:
        assert server.load(name, 0, "", False) == ""
        assert server.getTaskMaxVariations(name) == total, name
        assert list(server.getVariationsTrain()) == list(split_variations(name, "train")), name
        assert list(server.getVariationsDev()) == list(split_variations(name, "test", "dev")), name
        assert list(server.getVariationsTest()) == list(split_variations(name, "test", "test")), name


@needs_jvm
def test_reset_is_deterministic_and_reuses_the_jvm(env):
    first = env.reset(_task("train", 0))
    pid = env.jvm_pid
    assert first.observation.startswith(first.task_description + "\n\nThis room is called the hallway.")
    assert first.task_description.startswith("Your task is to boil water.")
    assert first.admissible_actions is None and first.info == {"task_name": "boil", "variation": 0} and first.harness == ""
    other = env.reset(_task("test", 0))
    assert other.info["variation"] == 14
    again = env.reset(_task("train", 0))
    assert again.observation == first.observation and env.jvm_pid == pid  # one JVM, reused
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        cmdline = f.read().split(b"\0")
    assert b"-Xmx384m" in cmdline and b"-XX:+UseSerialGC" in cmdline


@needs_jvm
@pytest.mark.parametrize(("name", "variation"), [("find-animal", 1), ("grow-plant", 0)])
def test_gold_path_succeeds(env, name, variation):
    task = _find(env, "train", name, variation)
    gold = env.gold_actions(task)
    with pytest.raises(RuntimeError, match="reset"):
        env.step("look around")
    env.reset(task)
    menus = 0
    for i, action in enumerate(gold):
        out = env.step(action)
        if out.info["ambiguous"]:  # grow-plant's gold path answers a menu with "0"
            menus += 1
            assert out.valid and out.observation.startswith("Ambiguous request") and gold[i + 1] == "0"
            assert env.example_actions() == [str(k) for k in range(len(parse_menu(out.observation)))]
        if out.done:
            break
        assert out.reward == 0.0 and not out.success and 0.0 <= out.score < 1.0
    assert out.done and out.success and out.score == 1.0 and out.reward == 1.0
    assert out.info["score100"] == 100 and not out.info["failed"] and not out.info["timeout"]
    assert (menus > 0) == (name == "grow-plant")


@needs_jvm
def test_invalid_and_malformed_actions(env):
    env.reset(_task("train", 0))
    out = env.step("jump")
    assert not out.valid and out.observation == "No known action matches that input." and out.harness == ""
    for bad in ("", "   ", "look around\nfocus on air"):
        out = env.step(bad)
        assert not out.valid and out.observation == "" and out.harness.startswith("Invalid action")
    out = env.step('  "Open door to kitchen."  ')  # model noise is cleaned; the simulator ignores case
    assert out.valid and out.observation == "The door is now open." and out.harness == ""
    out = env.step("open door to kitchen")  # no effect
    assert not out.valid and out.observation == "The door is already open."
    assert not out.done and out.score == 0.0 and out.reward == 0.0


@needs_jvm
def test_ambiguity_menu(env):
    env.reset(_task("train", 0))
    out = env.step("open door")
    options = parse_menu(out.observation)
    assert out.valid and out.info["ambiguous"] and len(options) == 6
    assert env.example_actions() == [str(k) for k in range(6)]
    out = env.step("9")  # not an option: refused, the menu is gone
    assert not out.valid and out.observation.startswith("Unknown action.")
    assert env.step("9").observation == "No known action matches that input."
    env.step("open door")
    out = env.step("2")
    assert out.valid and out.observation == "The door is now open." and not out.info["ambiguous"]
    room = options[2].removeprefix("open door between ").removesuffix(" and hallway")
    assert f"A door to the {room} (that is open)" in env.step("look around").observation


@needs_jvm
def test_focus_on_wrong_object_fails_the_task(env):
    env.reset(_task("train", 0))
    out = env.step("focus on air")
    assert out.valid and out.done and not out.success
    assert out.score == -1.0 and out.info["failed"] and out.info["score100"] == -100 and out.reward == 0.0
    with pytest.raises(RuntimeError, match="reset"):
        env.step("look around")


@needs_jvm
def test_step_limit_and_observation_cap(env):
    saved = env.max_steps, env.max_observation_chars
    try:
        env.max_steps, env.max_observation_chars = 3, 60
        first = env.reset(_task("train", 0))
        assert len(first.observation) == 60 and first.harness == "[Observation cut at 60 characters.]"
        outs = [env.step("look around") for _ in range(3)]
    finally:
        env.max_steps, env.max_observation_chars = saved
    assert [o.done for o in outs] == [False, False, True] and outs[-1].info["timeout"]
    assert all(o.valid and len(o.observation) == 60 and o.observation.startswith("This room is called") for o in outs)
    assert outs[0].harness == "[Observation cut at 60 characters.]"
    assert outs[-1].harness.endswith("Step limit reached: the episode ends.") and not outs[-1].success


@needs_jvm
def test_example_actions_are_accepted(env):
    env.reset(_task("train", 3))
    examples = env.example_actions()
    assert 0 < len(examples) <= 16 and examples == sorted(examples)
    safe = [a for a in examples if not a.startswith("focus on")]
    out = env.step(safe[0])
    assert not is_parse_failure(out.observation)


@needs_jvm
def test_admissible_first_choice_and_score_delta():
    from cope.envs.scienceworld.env import ScienceWorldEnv

    env = ScienceWorldEnv(tasks=["chemistry-mix", "boil"], admissible_actions=True, max_admissible_actions=12,
                          ambiguity="first", reward_mode="score_delta", max_steps=100)
    try:
        r = env.reset(_task("train", 1))  # boil, variation 0
        assert len(r.admissible_actions) == 12 and r.admissible_actions == sorted(set(r.admissible_actions))
        assert r.admissible_actions == env.reset(_task("train", 1)).admissible_actions  # deterministic sample
        out = env.step("open door")  # answered with option 0 by the harness
        assert out.valid and out.info["ambiguous"] and out.observation == "The door is now open."
        assert out.harness.startswith("(Ambiguous command: the harness chose option 0") and "number" not in env.instructions
        assert len(out.admissible_actions) == 12
        out = env.step("focus on air")
        assert out.done and out.reward == -1.0 and out.score == -1.0 and out.admissible_actions is None

        task = _task("train", 0)  # chemistry-mix, variation 0
        gold = env.gold_actions(task)
        env.reset(task)
        total, invalid = 0.0, 0
        for action in gold:
            out = env.step(action)
            total += out.reward
            invalid += not out.valid  # the gold path pours a cup into itself ("You can't ...")
            if out.done:
                break
        assert out.success and out.score == 1.0 and total == pytest.approx(1.0) and invalid >= 1
    finally:
        env.close()


@needs_jvm
def test_close_kills_the_jvm_and_reset_restarts_it():
    from cope.envs.scienceworld.env import ScienceWorldEnv

    env = ScienceWorldEnv(tasks=["find-animal"])
    env.reset(_task("train", 0))
    pid = env.jvm_pid
    with open(f"/proc/{pid}/status") as f:
        rss_mb = int(f.read().split("VmRSS:")[1].split()[0]) / 1024
    assert rss_mb < 600, rss_mb  # -Xmx384m -XX:+UseSerialGC (an uncapped JVM sits near 750 MB)
    env._sim.proc.kill()  # a crashed JVM is replaced at the next reset
    env._sim.proc.wait()
    env.reset(_task("train", 0))
    assert env.jvm_pid not in (None, pid)
    pid = env.jvm_pid
    proc = env._sim.proc
    env.close()
    env.close()
    assert proc.poll() is not None and not os.path.exists(f"/proc/{pid}")
    assert env.jvm_pid is None
    with pytest.raises(RuntimeError, match="before reset"):
        env.step("look around")


@needs_jvm
def test_bad_jvm_option_fails_at_first_reset():
    from cope.envs.scienceworld.env import ScienceWorldEnv

    env = ScienceWorldEnv(jvm_args=["-XX:+NoSuchJvmOption"])
    with pytest.raises(RuntimeError, match="could not start the ScienceWorld JVM"):
        env.reset(_task("train", 0))
    assert env.jvm_pid is None
    env.close()


@needs_jvm
def test_train_one_epoch(run_train, tmp_path):
    result = run_train(["env=scienceworld", "env.max_steps=3", "env.max_observation_chars=2000",
                        "model.max_context=2048", "data.max_context=2048",
                        "model.tokenizer_episodes=2", "model.warm_start_walks=2", "model.warm_start_steps=2",
                        "data.tasks_per_epoch=1", "data.group_size=2", "data.minibatch_size=2", "data.val_tasks=1",
                        "data.val_batch_size=1", "trainer.max_epochs=1", "validate_before_fit=false"], tmp_path)
    assert result["counters/episodes"] == 2
