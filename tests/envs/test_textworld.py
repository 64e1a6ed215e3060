"""Tests for the TextWorld adapter (`cope.envs.textworld.env`, games from `cope.envs.textworld.games`).

Game generation is the slow part (2-5 s a game): the module generates six small games once, into a
module temp cache, and every test (the training run too) reuses them.
"""
from __future__ import annotations

import importlib.util
import random
import re
import subprocess
import sys
from pathlib import Path

import pytest

from cope.envs.base import Env, Task
from cope.envs.textworld.env import (
    HARNESS_CHAINED,
    HARNESS_ESCAPE,
    HARNESS_MALFORMED,
    HARNESS_TIMEOUT,
    SYSTEM_VERBS,
    TextWorldEnv,
    tidy,
)
from cope.envs.textworld.games import (
    TEST_SEED_OFFSET,
    challenge_settings,
    ensure_game,
    game_seed,
    settings_slug,
)

needs_textworld = pytest.mark.skipif(
    importlib.util.find_spec("textworld") is None,
    reason="TextWorld adapter tests need the textworld package: pip install 'cope-trainer[textworld]'",
)
# Small settings per challenge; the train-0 game of each is generated once per module.
SMALL = {
    "tw-cooking": {},  # the defaults: recipe 1, take 1, 1 room
    "tw-coin_collector": {"level": 3},
    "tw-treasure_hunter": {"level": 3},
    "tw-simple": {},
}
# TextWorld asks Jericho for its own valid actions too (Jericho declines for TextWorld games, with a warning
# that TextWorld silences at import and pytest turns back on).
pytestmark = [pytest.mark.filterwarnings("ignore:Unable to find valid actions"), pytest.mark.long]
BANNER_CHARS = re.compile(r"\$\$|\\\$|__")


def _task(split: str = "train", index: int = 0) -> Task:
    return Task(env="textworld", split=split, index=index)


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    """Module game cache with the train-0 game of every SMALL challenge and coin collector's test-0."""
    if importlib.util.find_spec("textworld") is None:
        pytest.skip("needs the textworld package")
    root = tmp_path_factory.mktemp("tw") / "textworld"
    for challenge, kw in SMALL.items():
        TextWorldEnv(challenge=challenge, cache_dir=str(root), **kw).game_file(_task())
    TextWorldEnv(challenge="tw-coin_collector", cache_dir=str(root), level=3).game_file(_task("test"))
    return root


def _env(cache: Path, challenge: str = "tw-cooking", **kw) -> TextWorldEnv:
    return TextWorldEnv(challenge=challenge, cache_dir=str(cache), **{**SMALL[challenge], **kw})


def test_protocol_and_instructions():
    env = TextWorldEnv(cache_dir="/nonexistent/never/used")  # the constructor touches no file, imports no textworld
    assert isinstance(env, Env)
    assert env.num_tasks("train") == 1_000 and env.num_tasks("test") == 100
    for word in ("command", "go north", "take", "inventory"):
        assert word in env.instructions
    with pytest.raises(ValueError, match="split"):
        env.num_tasks("val")
    env.close()
    env.close()


@pytest.mark.parametrize(
    ("kwargs", "arg"),
    [({"challenge": "tw-zork"}, "challenge"), ({"challenge": "tw-coin_collector", "level": 0}, "level"),
     ({"challenge": "tw-coin_collector", "level": 301}, "level"), ({"challenge": "tw-treasure_hunter", "level": 31}, "level"),
     ({"challenge": "tw-coin_collector", "level": 151}, "100 rooms"), ({"simple_rewards": "lots"}, "simple_rewards"),
     ({"challenge": "tw-simple", "simple_goal": "vague"}, "simple_goal"), ({"cooking_recipe": 0}, "cooking_recipe"),
     ({"cooking_take": 2}, "cooking_take"), ({"cooking_go": 7}, "cooking_go"), ({"max_steps": 0}, "max_steps"),
     ({"num_train_tasks": 0}, "num_train_tasks"), ({"num_test_tasks": 0}, "num_test_tasks"),
     ({"reward_mode": "dense"}, "reward_mode"), ({"max_observation_chars": 0}, "max_observation_chars"),
     ({"name": ""}, "name"), ({"cache_dir": ""}, "cache_dir"), ({"level": True}, "level")],
)
def test_bad_constructor_args(kwargs, arg):
    with pytest.raises(ValueError, match=arg):
        TextWorldEnv(**kwargs)


def test_seed_mapping_and_settings():
    assert [game_seed("train", i) for i in (0, 1, 7)] == [0, 1, 7]
    assert [game_seed("test", i) for i in (0, 1, 7)] == [TEST_SEED_OFFSET, TEST_SEED_OFFSET + 1, TEST_SEED_OFFSET + 7]
    assert max(game_seed("train", i) for i in range(1000)) < min(game_seed("test", i) for i in range(1000))
    with pytest.raises(ValueError, match="index"):
        game_seed("train", TEST_SEED_OFFSET)
    with pytest.raises(ValueError, match="split"):
        game_seed("valid", 0)
    # the held-out split also switches the challenges' own test distributions
    assert challenge_settings("tw-cooking", "test")["split"] == "test"
    assert challenge_settings("tw-cooking", "train")["split"] == "train"
    assert challenge_settings("tw-simple", "test")["test"] is True
    assert challenge_settings("tw-simple", "train")["test"] is False
    assert challenge_settings("tw-coin_collector", "test", level=4) == {"level": 4}
    cooking = challenge_settings("tw-cooking", "train", cooking_go=6, cooking_cut=True)
    assert settings_slug(cooking) == "cook0_cut1_drop0_go6_open0_recipe1_take1"
    assert settings_slug(cooking) == settings_slug(challenge_settings("tw-cooking", "test", cooking_go=6, cooking_cut=True))


def test_task_index_out_of_range():
    env = TextWorldEnv(num_test_tasks=3, cache_dir="/nonexistent/never/used")
    with pytest.raises(ValueError, match="index"):
        env.reset(_task("test", 3))


def test_tidy():
    raw = "\n\n   ___ \n  |$$ \\$$|\n\nGet the coin!  \n\n\n\n-= Attic =-\nDusty.\n\n"
    assert tidy(raw, first=True) == "Get the coin!\n\n-= Attic =-\nDusty."
    end = "You win.\n\n\n          *** The End ***\n\nWould you like to RESTART, RESTORE a saved game, QUIT or UNDO the last command?"
    assert tidy(end) == "You win.\n\n*** The End ***"


@needs_textworld
@pytest.mark.parametrize("admissible", [False, True], ids=["fast", "admissible"])
@pytest.mark.parametrize("challenge", list(SMALL))
def test_walkthrough_wins(cache, challenge, admissible):
    """The game's own walkthrough, through our adapter, wins: every step valid, score 1.0 at the end,
    the score_delta rewards sum to it, and the final text is the game's ending without the replay prompt."""
    env = _env(cache, challenge, admissible_actions=admissible, max_steps=100)
    first = env.reset(_task())
    assert (first.admissible_actions is not None) == admissible
    walkthrough = env.walkthrough()
    assert walkthrough
    total, score, current = 0.0, 0.0, first.admissible_actions
    for i, action in enumerate(walkthrough):
        if admissible:
            assert action in current
        out = env.step(action)
        current = out.admissible_actions
        assert out.valid, (action, out.observation)
        assert out.harness == ""
        assert out.score >= score and out.score == pytest.approx(out.info["points"] / out.info["max_score"])
        score, total = out.score, total + out.reward
        assert out.done == (i == len(walkthrough) - 1)
    assert out.success and out.info["won"] and not out.info["lost"] and not out.info["timeout"]
    assert out.score == 1.0 and total == pytest.approx(1.0)
    assert "*** The End ***" in out.observation and "RESTART" not in out.observation
    with pytest.raises(RuntimeError, match="reset"):
        env.step("look")
    env.close()


@needs_textworld
def test_sparse_reward(cache):
    env = _env(cache, "tw-cooking", reward_mode="sparse")
    env.reset(_task())
    outs = [env.step(a) for a in env.walkthrough()]
    assert [o.reward for o in outs] == [0.0] * (len(outs) - 1) + [1.0]
    assert 0.0 < outs[-2].score < 1.0  # the score still runs (cooking pays points along the way)


@needs_textworld
def test_losing_ends_the_episode(cache):
    """Eating the recipe's ingredient raw loses a cooking game: done, not a success, score kept."""
    env = _env(cache, "tw-cooking")
    env.reset(_task())
    walkthrough = env.walkthrough()
    take = next(a for a in walkthrough if a.startswith("take "))
    for action in walkthrough[: walkthrough.index(take) + 1]:
        out = env.step(action)
    ingredient = take[len("take "):].split(" from ")[0]
    out2 = env.step(f"eat {ingredient}")
    assert out2.done and not out2.success and out2.info["lost"] and not out2.info["won"]
    assert "*** You lost! ***" in out2.observation
    assert out2.score == out.score and out2.reward == 0.0


@needs_textworld
@pytest.mark.parametrize("action", ["xyzzy plugh", "dance wildly", "jump", "wait", "x me", "go up", "take all",
                                    "examine north", "help", "goal", "take", "eat stove", "open cookbook"])
def test_game_refusals_are_invalid(cache, action):
    """Parser errors, refusals and Inform 7 verbs outside TextWorld's logic: invalid, the game's text
    is the observation, nothing from us in harness, no score, the episode goes on."""
    env = _env(cache, "tw-cooking")
    env.reset(_task())
    out = env.step(action)
    assert not out.valid and out.observation and out.harness == ""
    assert out.reward == 0.0 and out.score == 0.0 and not out.done
    assert "[" not in out.observation  # the action-trace tags are stripped


@needs_textworld
def test_parser_error_text(cache):
    env = _env(cache, "tw-cooking")
    env.reset(_task())
    assert env.step("xyzzy plugh").observation == "That's not a verb I recognise."
    assert env.step("go up").observation == "You can't go that way."


@needs_textworld
@pytest.mark.parametrize(
    ("action", "harness"),
    [("", HARNESS_MALFORMED), ("   ", HARNESS_MALFORMED), ("look\ninventory", HARNESS_MALFORMED),
     ("x" * 199, HARNESS_MALFORMED), ("look\rinventory", HARNESS_MALFORMED), ("look\x00", HARNESS_MALFORMED),
     ("go north. go south", HARNESS_CHAINED), ("look, inventory", HARNESS_CHAINED),
     ("look then inventory", HARNESS_CHAINED), ("look; inventory", HARNESS_CHAINED),
     ("quit", "'quit' is a game-system command"), ("RESTART", "'restart' is a game-system command"),
     ("undo", "'undo'"), ("save", "'save'"), ("restore", "'restore'"), ("verbose", "'verbose'"),
     ("tw-trace-actions", "'tw-trace-actions'"), ("tw-print max_score", "'tw-print'"),
     ("restrict commands", "'restrict'"), ("print_state", "'print_state'")],
)
def test_refused_before_the_game(cache, action, harness):
    """Malformed, chained and game-system commands never reach the game: invalid, empty observation,
    our notice in harness, and the game (and its action trace) is untouched."""
    env = _env(cache, "tw-cooking")
    env.reset(_task())
    look = env.step("look").observation
    out = env.step(action)
    assert not out.valid and out.observation == "" and harness in out.harness and not out.done
    after = env.step("look")
    assert after.valid and after.observation == look


# Jericho's dumb-frotz reads these itself, not the game: "\help" and any "\<lowercase>" are its own commands,
# re-read forever (16 GB of help text in 20 s); "\_" ends the line early and the rest replaces the next action.
ESCAPES = ["\\help", "\\N wh sto fridge", "\\set", "\\s", "\\", "\\\\", "go\\_north", "look\\1", "take \\[key"]


@needs_textworld
def test_interpreter_escapes_are_refused_before_the_interpreter(cache, monkeypatch):
    """A backslash anywhere is refused like a malformed action: the interpreter is never called (a call
    fails this test instead of hanging it), and the game goes on as before."""
    env = _env(cache, "tw-simple")
    env.reset(_task())
    look = env.step("look").observation

    def reached(command):
        raise AssertionError(f"{command!r} reached the interpreter")

    with monkeypatch.context() as m:
        m.setattr(env._env, "step", reached)
        for action in ESCAPES:
            out = env.step(action)
            assert not out.valid and out.observation == "" and out.harness == HARNESS_ESCAPE and not out.done
    after = env.step("look")
    assert after.valid and after.observation == look


def test_system_verbs_cover_the_dangerous_ones():
    assert {"quit", "restart", "restore", "save", "undo", "version"} <= SYSTEM_VERBS


@needs_textworld
@pytest.mark.parametrize("action", ['  "Look."  ', "Action: inventory", "LOOK", "`examine cookbook`", "x cookbook",
                                    "look at cookbook"])
def test_noisy_and_synonym_actions_are_valid(cache, action):
    env = _env(cache, "tw-cooking")
    env.reset(_task())
    out = env.step(action)
    assert out.valid and out.harness == "" and out.observation


@needs_textworld
def test_first_observation_and_task_description(cache):
    env = _env(cache, "tw-coin_collector", admissible_actions=True)
    first = env.reset(_task())
    assert first.task_description and first.observation.startswith(first.task_description)
    assert "-= " in first.observation  # then the first room
    assert not BANNER_CHARS.search(first.observation) and first.observation == first.observation.strip()
    assert first.admissible_actions and "look" in first.admissible_actions
    assert first.info["max_score"] == 1 and first.info["points"] == 0 and first.harness == ""
    assert env.example_actions() == first.admissible_actions


@needs_textworld
def test_observation_cap(cache):
    env = _env(cache, "tw-cooking", max_observation_chars=40)
    first = env.reset(_task())
    assert len(first.observation) == 40 and "40 of" in first.harness
    out = env.step("examine cookbook")
    assert out.valid and len(out.observation) == 40
    assert re.fullmatch(r"\[observation truncated: 40 of \d+ characters shown\]", out.harness)
    short = env.step("inventory")
    assert len(short.observation) <= 40


@needs_textworld
def test_timeout(cache):
    env = _env(cache, "tw-cooking", max_steps=2)
    env.reset(_task())
    assert not env.step("look").done
    out = env.step("xyzzy")
    assert out.done and not out.success and out.info["timeout"] and out.harness == HARNESS_TIMEOUT
    assert out.observation == "That's not a verb I recognise."


@needs_textworld
def test_fast_and_admissible_modes_agree(cache):
    """Same random walk (admissible commands and junk) in both modes: identical text, validity, score."""
    fast, full = _env(cache, "tw-treasure_hunter"), _env(cache, "tw-treasure_hunter", admissible_actions=True)
    a, b = fast.reset(_task()), full.reset(_task())
    assert a.observation == b.observation and a.admissible_actions is None
    rng, admissible, seen_valid, seen_invalid = random.Random(0), b.admissible_actions, 0, 0
    for _ in range(40):
        action = rng.choice(admissible) if rng.random() < 0.7 else rng.choice(["jump", "go up", "take all", "xyzzy"])
        x, y = fast.step(action), full.step(action)
        assert (x.observation, x.valid, x.score, x.done) == (y.observation, y.valid, y.score, y.done)
        assert x.admissible_actions is None and y.admissible_actions
        seen_valid, seen_invalid = seen_valid + x.valid, seen_invalid + (not x.valid)
        admissible = y.admissible_actions
        if x.done:
            break
    assert seen_valid and seen_invalid
    examples = fast.example_actions()
    assert examples[:2] == ["look", "inventory"] and 6 < len(examples) <= 16


@needs_textworld
def test_same_seed_same_bytes_and_text(cache, tmp_path):
    """Regenerating a game (another process, another folder) gives byte-identical files; two fresh
    instances start with the same text."""
    settings = challenge_settings("tw-coin_collector", "train", level=3)
    old, _ = ensure_game(cache, "tw-coin_collector", settings, "train", 0)
    new, generated = ensure_game(tmp_path, "tw-coin_collector", settings, "train", 0)
    assert generated and new != old
    assert new.read_bytes() == old.read_bytes()
    assert new.with_suffix(".json").read_bytes() == old.with_suffix(".json").read_bytes()
    assert not list(new.parent.glob(".tmp*"))  # the private generation folder is gone
    a, b = _env(cache, "tw-coin_collector"), TextWorldEnv(challenge="tw-coin_collector", level=3, cache_dir=str(tmp_path))
    assert a.reset(_task()).observation == b.reset(_task()).observation


@needs_textworld
def test_train_and_test_games_differ(cache):
    env = _env(cache, "tw-coin_collector")
    train, test = Path(env.game_file(_task())), Path(env.game_file(_task("test")))
    assert train.name == "tw-coin_collector-train-0.z8" and test.name == "tw-coin_collector-test-0.z8"
    assert train.read_bytes() != test.read_bytes()
    assert env.reset(_task()).observation != env.reset(_task("test")).observation
    assert env.games_generated == 0


@needs_textworld
def test_cache_reuse_and_interpreter_reuse(cache):
    """A cached game is not generated again (file untouched); resets reuse one interpreter, also
    across games."""
    path = Path(_env(cache, "tw-treasure_hunter").game_file(_task()))
    before = path.stat().st_mtime_ns
    env = _env(cache, "tw-treasure_hunter")
    env.reset(_task())
    engine, frotz = env._env, env._env.unwrapped._jericho
    env.step("look")
    again = env.reset(_task())
    assert env._env is engine and env._env.unwrapped._jericho is frotz
    assert again.observation == env.reset(_task()).observation
    other = _env(cache, "tw-coin_collector")
    train = other.reset(_task())
    frotz = other._env.unwrapped._jericho
    test = other.reset(_task("test"))  # another game: loaded into the same interpreter
    assert other._env.unwrapped._jericho is frotz and test.observation != train.observation
    assert env.games_generated == 0 and other.games_generated == 0 and path.stat().st_mtime_ns == before
    env.close()
    env.close()
    assert env._env is None
    assert env.reset(_task()).observation == again.observation  # a fresh interpreter after close


@needs_textworld
@pytest.mark.slow  # two fresh generations (~5 s idle, 15 s on a busy machine)
def test_racing_processes_generate_one_good_game(tmp_path):
    """Two processes generating the same missing game at once both succeed and leave one complete,
    identical pair of files."""
    code = (
        "import sys; from cope.envs.textworld.games import ensure_game, challenge_settings; "
        "p, g = ensure_game(sys.argv[1], 'tw-coin_collector', challenge_settings('tw-coin_collector', 'train', level=1),"
        " 'train', 3); print(p.stat().st_size)"
    )
    procs = [subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], stdout=subprocess.PIPE, text=True)
             for _ in range(2)]
    outs = [p.communicate(timeout=240)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0]
    files = sorted(f.name for f in tmp_path.rglob("*") if f.is_file())
    assert files == ["tw-coin_collector-train-3.json", "tw-coin_collector-train-3.z8"]
    assert outs[0] == outs[1]


def test_config_mirrors_the_constructor(compose, tmp_path):
    from hydra.utils import instantiate

    cfg = compose(["env=textworld"], tmp_path)
    env = instantiate(cfg.env)()
    assert isinstance(env, TextWorldEnv) and env.challenge == "tw-cooking" and env.name == "textworld"
    assert env.cache_dir == f"{cfg.paths.cache_dir}/textworld" and env.admissible is False
    assert env.reward_mode == "score_delta" and env.max_steps == cfg.env.max_steps


def test_lazy_import_error_names_the_extra(tmp_path):
    code = (
        "import sys; sys.modules['textworld'] = None\n"
        "from cope.envs.base import Task\n"
        "from cope.envs.textworld.env import TextWorldEnv\n"
        f"env = TextWorldEnv(cache_dir={str(tmp_path)!r})\n"
        "try:\n    env.reset(Task('textworld', 'train', 0))\n"
        "except ImportError as e:\n    print(e)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert "pip install 'cope-trainer[textworld]'" in result.stdout


def test_imports_without_torch():
    code = "import sys; sys.modules['torch'] = None; import cope.envs.textworld.env, cope.envs.textworld.games; print('ok')"
    result = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"


@needs_textworld
def test_one_epoch_of_training(run_train, cache, tmp_path):
    """The tiny model trains one epoch on TextWorld games (the module's cached coin-collector games)."""
    result = run_train(
        ["env=textworld", f"env.cache_dir={cache}", "env.challenge=tw-coin_collector", "env.level=3",
         "env.num_train_tasks=1", "env.num_test_tasks=1", "model.max_context=2048", "data.max_context=2048",
         "model.tokenizer_episodes=4", "model.warm_start_walks=4", "model.warm_start_steps=2", "data.tasks_per_epoch=1",
         "data.group_size=2", "data.minibatch_size=2", "data.val_tasks=1", "data.val_batch_size=1",
         "trainer.max_epochs=1", "env.max_steps=3", "validate_before_fit=false"],
        tmp_path,
    )
    assert result["counters/episodes"] == 2


def test_a_forked_game_continues_as_the_original_and_independently(cache):
    """fork() copies the running game (Jericho): a branched rollout's child takes no replayed env steps."""
    env = _env(cache, "tw-simple", max_steps=12)
    with pytest.raises(RuntimeError, match="before reset"):
        env.fork()
    env.reset(_task())
    plan = env.walkthrough()
    assert len(plan) >= 3
    for action in plan[:2]:
        env.step(action)
    fork, twin = env.fork(), env.fork()
    try:
        off = fork.step("go west")  # the fork leaves the plan: the original does not notice
        assert not off.done and fork.expert_action() is None and env.expert_action() == plan[2]
        for action in [*plan[2:], "look"][:4]:  # the original and a twin say the same things, rewards included
            a, b = env.step(action), twin.step(action)
            assert (a.observation, a.reward, a.done, a.success, a.valid) == (b.observation, b.reward, b.done, b.success, b.valid)
            if a.done:
                break
    finally:
        for e in (fork, twin, env):
            e.close()


def test_a_fork_of_a_fork_before_its_first_step_and_a_fork_with_admissible_actions(cache):
    """A fork holds a snapshot until its first step: a fork of it (a branched rollout's snapshot forked per child)
    starts from the same state; with admissible actions the whole stack is copied and the lists agree."""
    for admissible in (False, True):
        env = _env(cache, "tw-simple", max_steps=12, admissible_actions=admissible)
        env.reset(_task())
        plan = env.walkthrough()
        env.step(plan[0])
        snap = env.fork()
        child, original = snap.fork(), env.fork()
        try:
            for action in plan[1:3]:
                a, b = original.step(action), child.step(action)
                assert (a.observation, a.reward, a.admissible_actions) == (b.observation, b.reward, b.admissible_actions)
        finally:
            for e in (snap, child, original, env):
                e.close()
