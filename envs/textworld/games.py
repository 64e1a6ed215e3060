"""TextWorld games generated on demand, by seed, into a cache folder (used by :mod:`cope.envs.textworld.env`).

Each ``(challenge, settings, split, index)`` names exactly one game. The game seed is a pure function
of the split and the index, and the two seed spaces are disjoint::

    train: seed = index            (index < 2**31)
    test:  seed = 2**31 + index

TextWorld draws its four generation seeds (map, objects, quest, grammar) from
``numpy.random.RandomState(seed)``, so the same seed gives the same game. Byte-identical files need one
more thing: TextWorld iterates over Python sets while writing the Inform 7 source and the ``.json``, so
with hash randomization two processes write the same game with branches and lists in another order
(same behaviour, other bytes). Games are therefore generated in a child process
(``python -m cope.envs.textworld.games``) with ``PYTHONHASHSEED=0``: the same seed gives the same
``.z8`` and ``.json`` bytes in every process and run (tested). Two challenges also have their own
held-out distribution, which the test split uses: ``tw-cooking`` draws its foods from TextWorld's
``train`` / ``test`` food splits, ``tw-simple`` sets its ``test`` flag. For ``tw-coin_collector`` and
``tw-treasure_hunter`` the splits differ only by seed (their small levels have few distinct layouts).

Cache layout (``textworld_version`` in the path, so a TextWorld upgrade never reuses old files)::

    <cache_dir>/tw<version>/<challenge>/<settings slug>/<challenge>-<split>-<index>.z8  (+ .json: its logic)

The file name must start with ``tw-``: Jericho recognises TextWorld games by that prefix of the story
file's name only, and treats any other name as an unknown game (no clean-up of the interpreter's
prompt and status line, no score or victory detection).

A game is generated into a private temporary folder next to its final place and moved in with
``os.replace`` (``.json`` first, ``.z8`` last): a ``.z8`` that exists is complete. Two processes that
race on the same game both generate it and the second rename replaces identical bytes.

Playing a game: :func:`make_env` builds TextWorld's wrapper stack for its Inform 7 games, and
:func:`action_patterns` the regex of a game's action events (validity; see :mod:`cope.envs.textworld.env`).

This module imports TextWorld lazily (inside the functions), like every env module.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

CHALLENGES = ("tw-simple", "tw-cooking", "tw-coin_collector", "tw-treasure_hunter")
TEST_SEED_OFFSET = 2**31
SIMPLE_REWARDS = ("dense", "balanced", "sparse")
SIMPLE_GOALS = ("detailed", "brief", "none")
COOKING_GO = (1, 6, 9, 12)
LEVELS = {"tw-coin_collector": (1, 300), "tw-treasure_hunter": (1, 30)}
GENERATION_TIMEOUT_S = 600
TRACED_KEY = "cope_traced_feedback"  # game-state key: the game text with its Inform 7 action-trace tags
EXTRA_HINT = "install the extra: pip install 'cope-trainer[textworld]'"


def import_textworld():
    """``textworld`` (and its challenges), or an ImportError that names the extra."""
    try:
        import textworld
        import textworld.challenges  # registers tw-simple, tw-cooking, ...
        import textworld.generator
    except ImportError as e:
        raise ImportError(f"the textworld env needs the textworld package ({e}); {EXTRA_HINT}") from e
    return textworld


def game_seed(split: str, index: int) -> int:
    """The TextWorld seed of task ``index`` of ``split`` (train and test never share a seed)."""
    if split not in ("train", "test"):
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")
    if not 0 <= index < TEST_SEED_OFFSET:
        raise ValueError(f"task index must be in [0, 2**31), got {index!r}")
    return index if split == "train" else TEST_SEED_OFFSET + index


def challenge_settings(
    challenge: str,
    split: str,
    *,
    level: int = 1,
    simple_rewards: str = "dense",
    simple_goal: str = "detailed",
    cooking_recipe: int = 1,
    cooking_take: int = 1,
    cooking_go: int = 1,
    cooking_open: bool = False,
    cooking_cook: bool = False,
    cooking_cut: bool = False,
    cooking_drop: bool = False,
) -> dict[str, Any]:
    """The ``settings`` mapping TextWorld's ``make(settings, options)`` of ``challenge`` expects (the
    same keys as ``tw-make <challenge> --help``). Every argument is checked, also those that only other
    challenges use; a bad value raises ValueError naming the argument."""
    if challenge not in CHALLENGES:
        raise ValueError(f"challenge must be one of {CHALLENGES}, got {challenge!r}")
    lo, hi = LEVELS.get(challenge, (1, 300))
    if not _is_int(level) or not lo <= level <= hi:
        raise ValueError(f"level must be an int in [{lo}, {hi}] for {challenge}, got {level!r}")
    if challenge == "tw-coin_collector" and ((level - 1) // 100 + 1) * ((level - 1) % 100 + 1) > 100:
        raise ValueError(f"level {level} of tw-coin_collector needs more than 100 rooms (TextWorld 1.7 limit)")
    if simple_rewards not in SIMPLE_REWARDS:
        raise ValueError(f"simple_rewards must be one of {SIMPLE_REWARDS}, got {simple_rewards!r}")
    if simple_goal not in SIMPLE_GOALS:
        raise ValueError(f"simple_goal must be one of {SIMPLE_GOALS}, got {simple_goal!r}")
    if not _is_int(cooking_recipe) or not 1 <= cooking_recipe <= 5:
        raise ValueError(f"cooking_recipe must be an int in [1, 5], got {cooking_recipe!r}")
    if not _is_int(cooking_take) or not 0 <= cooking_take <= cooking_recipe:
        raise ValueError(f"cooking_take must be an int in [0, cooking_recipe], got {cooking_take!r}")
    if cooking_go not in COOKING_GO:
        raise ValueError(f"cooking_go must be one of {COOKING_GO}, got {cooking_go!r}")
    if challenge in LEVELS:
        return {"level": level}
    if challenge == "tw-simple":
        return {"rewards": simple_rewards, "goal": simple_goal, "test": split == "test"}
    return {
        "recipe": cooking_recipe, "take": cooking_take, "go": cooking_go, "open": bool(cooking_open),
        "cook": bool(cooking_cook), "cut": bool(cooking_cut), "drop": bool(cooking_drop),
        "recipe_seed": 0, "split": split,
    }


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def settings_slug(settings: Mapping[str, Any]) -> str:
    """A folder name for ``settings`` (the split-derived keys excluded: the file name has the split)."""
    parts = []
    for key in sorted(settings):
        if key in ("split", "test", "recipe_seed"):
            continue
        value = settings[key]
        parts.append(f"{key}{int(value) if isinstance(value, bool) else value}")
    return "_".join(parts) or "default"


def game_path(cache_dir: str | os.PathLike, version: str, challenge: str, settings: Mapping[str, Any],
              split: str, index: int) -> Path:
    """Where the ``.z8`` of that game lives (its ``.json`` sits next to it)."""
    return Path(cache_dir) / f"tw{version}" / challenge / settings_slug(settings) / f"{challenge}-{split}-{index}.z8"


def generate_game(path: Path, challenge: str, settings: Mapping[str, Any], seed: int) -> None:
    """Generate and compile one game into ``path`` (``.z8``) and ``path.with_suffix('.json')``,
    atomically, in a child process with ``PYTHONHASHSEED=0`` (see the module docstring)."""
    path = Path(path).absolute()
    cmd = [sys.executable, "-m", "cope.envs.textworld.games", "--path", str(path), "--challenge", challenge,
           "--settings", json.dumps(dict(settings)), "--seed", str(seed)]
    env = {**os.environ, "PYTHONHASHSEED": "0"}
    path.parent.mkdir(parents=True, exist_ok=True)
    try:  # cwd: the cache folder, so that no `textworld` folder in the caller's cwd shadows the package
        result = subprocess.run(cmd, check=False, env=env, cwd=path.parent, capture_output=True, text=True,
                                timeout=GENERATION_TIMEOUT_S)
    except subprocess.TimeoutExpired as e:
        raise RuntimeError(f"generating {challenge} seed {seed} into {path} took over {GENERATION_TIMEOUT_S} s") from e
    if result.returncode != 0 or not path.is_file():
        raise RuntimeError(f"generating {challenge} seed {seed} into {path} failed:\n{result.stderr[-3000:]}")


def _generate_here(path: Path, challenge: str, settings: Mapping[str, Any], seed: int) -> None:
    """The child's part of :func:`generate_game`: make, compile, move into place."""
    textworld = import_textworld()
    from textworld.challenges import CHALLENGES as REGISTRY
    from textworld.generator import compile_game

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{path.stem}-", dir=path.parent))
    try:
        options = textworld.GameOptions()
        options.seeds = seed
        options.path = str(tmp / "game.z8")
        options.file_ext = ".z8"
        _, make, _ = REGISTRY[challenge]
        game = make(settings=dict(settings), options=options)
        compiled = Path(compile_game(game, options))
        os.replace(compiled.with_suffix(".json"), path.with_suffix(".json"))
        os.replace(compiled, path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def ensure_game(cache_dir: str | os.PathLike, challenge: str, settings: Mapping[str, Any], split: str,
                index: int) -> tuple[Path, bool]:
    """The ``.z8`` path of that game, generating it first when it is not in the cache.
    Returns ``(path, generated)``."""
    version = import_textworld().__version__
    path = game_path(cache_dir, version, challenge, settings, split, index)
    if path.is_file() and path.with_suffix(".json").is_file():
        return path, False
    generate_game(path, challenge, settings, game_seed(split, index))
    return path, True


def make_env(track_state: bool):
    """TextWorld's wrapper stack for its Inform 7 games (what ``textworld.start`` builds for a ``.z8``
    with its ``.json``), plus :class:`_KeepTrace` under the state tracker, so that the action trace
    reaches us in both modes. The state tracker (admissible commands) only when ``track_state``."""
    textworld = import_textworld()
    from textworld.envs.wrappers.tw_inform7 import GameData, Inform7Data, StateTracking
    from textworld.envs.zmachine.jericho import JerichoEnv

    class _KeepTrace(textworld.core.Wrapper):
        """Copies the game text, action-trace tags included, to ``state[TRACED_KEY]``."""

        def step(self, command: str):
            state, score, done = self._wrapped_env.step(command)
            state[TRACED_KEY] = state["feedback"]
            return state, score, done

        def copy(self) -> "_KeepTrace":
            """The wrapped stack copied at its state (Jericho copies the interpreter: memory, stack, RNG)."""
            return _KeepTrace(self._wrapped_env.copy())

    infos = textworld.EnvInfos(
        feedback=True, score=True, max_score=True, won=True, lost=True, objective=True, game=True,
        admissible_commands=track_state, possible_admissible_commands=True,  # (GameData adds extra.walkthrough)
    )
    env = _KeepTrace(Inform7Data(GameData(JerichoEnv(infos))))
    return StateTracking(env) if track_state else env


@dataclasses.dataclass(frozen=True)
class Snapshot:
    """A running game's state without a second interpreter: Jericho's machine state (memory, stack, program counter,
    RNG: the action-trace mode switched on at reset included) and the Inform 7 wrapper's own (the state the next step
    carries over, the infos it tracks). Taking one costs a copy of the memory; :func:`restore` starts the one
    interpreter a fork needs, only when the fork is used."""

    machine: Any
    state: Any
    tracked: tuple[str, ...]


def _layers(env) -> tuple[Any, Any]:
    """(the Inform 7 wrapper, the Jericho env) of :func:`make_env`'s stack without the state tracker."""
    inform7, jericho = env._wrapped_env, env.unwrapped
    return inform7, jericho


def snapshot(env) -> Snapshot:
    """The state of ``env`` (:func:`make_env`'s stack, ``track_state=False``, reset)."""
    inform7, jericho = _layers(env)
    # a shallow copy: the wrappers replace their state at every step, never change one in place (a deep copy would
    # copy the whole game object each time)
    return Snapshot(jericho._jericho.get_state(), type(inform7.state)(inform7.state), tuple(inform7._tracked_infos))


def restore(snap: Snapshot, path: str):
    """A new stack (``track_state=False``) on the game at ``path``, at ``snap``'s state: its next step says what the
    snapshotted game's next step said."""
    env = make_env(False)
    env.load(path)
    inform7, jericho = _layers(env)
    jericho._jericho.set_state(snap.machine)
    jericho._reset = True
    inform7.state, inform7._tracked_infos, inform7._prev_state = type(snap.state)(snap.state), list(snap.tracked), None
    return env


def action_patterns(game) -> re.Pattern:
    """One regex matching the Inform 7 events of the game's logic actions (``opening the {c}``,
    ``going north``, ...) with every variable standing for one of the game's named entities, possibly
    after state words the game prints in front of it (``examining the sliced fried red potato``)."""
    names = sorted({info.name.lower() for info in game.infos.values() if info.name}, key=len, reverse=True)
    entity = r"(?:[a-z-]+ )*(?:" + "|".join(re.escape(n) for n in names) + ")" if names else "(?!)"
    alternatives = []
    for event in sorted(set(game.kb.inform7_events.values())):
        parts = re.split(r"\{[^}]*\}", event.lower())
        alternatives.append(entity.join(re.escape(p) for p in parts))
    return re.compile("|".join(alternatives))


def main(argv: list[str] | None = None) -> None:
    """Child entry point of :func:`generate_game` (``python -m cope.envs.textworld.games``)."""
    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--path", required=True, type=Path)
    parser.add_argument("--challenge", required=True, choices=CHALLENGES)
    parser.add_argument("--settings", required=True, type=json.loads)
    parser.add_argument("--seed", required=True, type=int)
    args = parser.parse_args(argv)
    if os.environ.get("PYTHONHASHSEED") != "0":
        raise SystemExit("run with PYTHONHASHSEED=0 (generate_game does): otherwise the bytes depend on the process")
    _generate_here(args.path, args.challenge, args.settings, args.seed)


if __name__ == "__main__":
    main()
