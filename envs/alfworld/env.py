"""ALFWorld (text-only household tasks, ``alfworld==0.4.2``) behind the `cope.envs.base.Env` protocol.

The engine is ALFWorld's own: textworld's ``PddlEnv`` (fast-downward for the PDDL state) with
alfworld's ``alfred.pddl`` domain, its ``alfred.twl2`` grammar and its ``AlfredDemangler`` naming
("cabinet 3"), wrapped the way ``AlfredTWEnv`` wraps it (:mod:`cope.envs.alfworld.engine`). An env takes an
engine on its first reset (from a per-process pool of engines parked by closed envs) and keeps it: a reset
to the game already loaded only restarts it. With ``engine_memo`` (default) the engine's pure text ->
structure conversions are memoized per process (same outputs): a reset to a game translated before skips
fast-downward's PDDL translation (~85% of a reset's time) and steps run ~1.9x faster.

Two sources of games (``source``):

* ``official``: the ALFWorld benchmark games from ``alfworld-download`` (not shipped with the package),
  under ``data_dir`` (default ``$ALFWORLD_DATA``, else ``~/.cache/alfworld``):
  ``json_2.1.1/<split>/<task_type>-<obj>-<mrecep>-<parent>-<scene>/trial_*/game.tw-pddl``. Train is
  ``train``; test is ``valid_unseen`` (default) or ``valid_seen`` (``test_split``). Games are kept like
  ``AlfredTWEnv`` keeps them: ``solvable`` ones of the chosen task types, no movable/sliced ones;
  task ``index`` = position in the sorted path list. Name ``alfworld``.
* ``generated``: alfworld-style (generated) games (:mod:`cope.envs.alfworld.games`), built offline
  from the package's floor plans, domain and grammar and run by the same engine. NOT the ALFWorld
  benchmark: name ``alfworld-generated``, never report results on them as ALFWorld results. Train and
  test use disjoint floor plans.

Episode: the first observation is the engine's intro (the room's receptacles, then "Your task is to:
..."); ``task_description`` is that last line. ``success`` = the engine's ``won``; ``score`` = 1.0 once
won, else 0.0 (ALFWorld has no partial score); ``reward`` is sparse: 1.0 on the winning step, else 0.0.
The episode ends when won or after ``max_steps`` actions (``info["timeout"]``, harness notice).

Validity: the action is cleaned with :func:`cope.envs.actions.single_line` (lower-cased). Empty or
multi-line -> invalid, no engine turn, empty observation, harness notice. Otherwise it goes to the
engine; it is valid iff it is one of the engine's admissible commands for the current state (the
engine answers anything else with "Nothing happens.", which stays the observation: that is the
world's text). The engine has no interpreter of its own (TextWorld's z-machine games do:
:mod:`cope.envs.textworld.env` refuses their backslash escapes): it looks the command up in its admissible
list, so ``\\help``, ``#``, ``restart`` or ``save`` are commands it does not know, answered with "Nothing
happens." and no change. An action that is not encodable text is refused before the engine
(:func:`cope.envs.actions.unencodable`). ``admissible_actions`` are the engine's, minus ``hidden_commands``
(default: ``help``, whose output is a fixed manual; typing it still works and is valid); ``look``,
``inventory`` and ``examine ...`` are kept.

Observation vs harness: the engine's text is the observation (cut at ``max_observation_chars``);
our notices (malformed action, truncation, step limit) go to ``harness``.
"""
from __future__ import annotations

import functools
import json
import os
from collections.abc import Sequence
from typing import Any

from cope.envs.actions import single_line, unencodable
from cope.envs.alfworld.engine import engine_call, import_engine, park_engine, take_engine
from cope.envs.alfworld.scenes import TASK_TYPES
from cope.envs.base import EnvReset, EnvStep, Task, TaskEnv

INSTRUCTIONS = (
    "You are in a household and must complete the task given in the first message. "
    "Each turn, answer with exactly one command, using object names as written, for example: "
    "go to cabinet 1, open drawer 2, close drawer 2, take apple 1 from countertop 1, move apple 1 to diningtable 1, "
    "heat apple 1 with microwave 1, cool apple 1 with fridge 1, clean apple 1 with sinkbasin 1, use desklamp 1, "
    "examine countertop 1, look, inventory."
)
HARNESS_MALFORMED = "Invalid action: answer with one command on one line, e.g. 'go to cabinet 1'."
HARNESS_TRUNCATED = "[observation truncated: {} of {} characters shown]"
HARNESS_TIMEOUT = "Step limit reached."
NOTHING_HAPPENS = "Nothing happens."
SOURCES = ("official", "generated")
TEST_SPLITS = ("valid_unseen", "valid_seen")


def missing_data_message(root: str) -> str:
    return (
        f"ALFWorld game files not found under {root!r} (expected json_2.1.1/train, json_2.1.1/valid_unseen, "
        "json_2.1.1/valid_seen with game.tw-pddl files). The alfworld package does not ship them: on a machine "
        "with internet run `pip install 'cope-trainer[alfworld]'` then `alfworld-download` (it writes to "
        "$ALFWORLD_DATA, default ~/.cache/alfworld), bring that folder here and set ALFWORLD_DATA (or env.data_dir) "
        "to it. Without them, env.source=generated trains on alfworld-style (generated) games, which are not the "
        "ALFWorld benchmark."
    )


def default_data_dir() -> str:
    return os.path.expanduser(os.environ.get("ALFWORLD_DATA") or "~/.cache/alfworld")


@functools.cache
def official_games(root: str, split: str, task_types: tuple[str, ...]) -> tuple[str, ...]:
    """Sorted ``game.tw-pddl`` paths of one official split, filtered the way ``AlfredTWEnv`` filters them."""
    base = os.path.join(root, "json_2.1.1", split)
    games = []
    for folder, _, files in os.walk(base):
        if "game.tw-pddl" not in files or "traj_data.json" not in files:
            continue
        if "movable" in folder or "Sliced" in folder:
            continue
        if _task_type(os.path.join(folder, "game.tw-pddl")) not in task_types:
            continue
        path = os.path.join(folder, "game.tw-pddl")
        with open(path) as f:
            if not json.load(f).get("solvable"):
                continue
        games.append(path)
    return tuple(sorted(games))


class AlfWorldEnv(TaskEnv):
    """ALFWorld's text engine behind the `cope.envs.base.Env` protocol; one episode at a time.

    Args:
        source: ``official`` (benchmark games from ``alfworld-download``) or ``generated``
            (alfworld-style generated games; not the benchmark).
        task_types: ALFWorld task types to keep (any of the six).
        max_steps: Actions per episode before a timeout (ALFWorld's usual budget is 50).
        max_observation_chars: Longer observations are cut (harness notice).
        hidden_commands: Engine commands left out of ``admissible_actions`` (still valid when typed).
        data_dir: Official data folder; None = ``$ALFWORLD_DATA`` or ``~/.cache/alfworld``.
        test_split: Official split used as our ``test``: ``valid_unseen`` or ``valid_seen``.
        cache_dir: Generated games' cache folder; None = ``$COPE_CACHE/alfworld_generated``
            (``~/.cache/cope-trainer`` without ``COPE_CACHE``).
        num_train_tasks: Generated games in ``train`` (ignored for ``official``).
        num_test_tasks: Generated games in ``test`` (ignored for ``official``).
        seed: Generator seed (``generated``).
        engine_memo: Memoize the engine's PDDL->SAS translations and grammar parses per process
            (same outputs; resets to known games ~10x, steps ~1.9x faster); False = the engine untouched.
        name: Env name in task ids and metrics; None = ``alfworld`` / ``alfworld-generated``.
    """

    # Branched rollouts (cope.train.collect.branching) rebuild a child by replay: the engine has no randomness (the
    # PDDL state, the grammar's first matching rule, sorted commands, names demangled without shuffling), so a fresh
    # instance, pooled engine or not, says the same for the same game and commands, in any process (checked).
    forks_by_replay = True

    def __init__(
        self,
        source: str = "official",
        task_types: Sequence[str] = TASK_TYPES,
        max_steps: int = 50,
        max_observation_chars: int = 4000,
        hidden_commands: Sequence[str] = ("help",),
        data_dir: str | None = None,
        test_split: str = "valid_unseen",
        cache_dir: str | None = None,
        num_train_tasks: int = 10_000,
        num_test_tasks: int = 200,
        seed: int = 0,
        engine_memo: bool = True,
        name: str | None = None,
    ) -> None:
        if source not in SOURCES:
            raise ValueError(f"source must be one of {SOURCES}, got {source!r}")
        task_types = tuple(task_types)
        if not task_types or any(t not in TASK_TYPES for t in task_types) or len(set(task_types)) != len(task_types):
            raise ValueError(f"task_types must be distinct names among {TASK_TYPES}, got {task_types!r}")
        if max_steps < 1:
            raise ValueError(f"max_steps must be >= 1, got {max_steps!r}")
        if max_observation_chars < 100:
            raise ValueError(f"max_observation_chars must be >= 100, got {max_observation_chars!r}")
        if isinstance(hidden_commands, str):
            raise ValueError(f"hidden_commands must be a list of commands, got {hidden_commands!r}")
        if test_split not in TEST_SPLITS:
            raise ValueError(f"test_split must be one of {TEST_SPLITS}, got {test_split!r}")
        if num_train_tasks < 1:
            raise ValueError(f"num_train_tasks must be >= 1, got {num_train_tasks!r}")
        if num_test_tasks < 1:
            raise ValueError(f"num_test_tasks must be >= 1, got {num_test_tasks!r}")
        if name is not None and not name:
            raise ValueError("name must be a non-empty string or null")
        self.source = source
        self.task_types = task_types
        self.max_steps = max_steps
        self.max_observation_chars = max_observation_chars
        self.hidden_commands = frozenset(hidden_commands)
        self.data_dir = os.path.expanduser(data_dir) if data_dir else default_data_dir()
        self.test_split = test_split
        cope_cache = os.environ.get("COPE_CACHE") or os.path.expanduser("~/.cache/cope-trainer")
        self.cache_dir = os.path.expanduser(cache_dir) if cache_dir else os.path.join(cope_cache, "alfworld_generated")
        self.seed = seed
        self.engine_memo = bool(engine_memo)
        self.name = name or ("alfworld" if source == "official" else "alfworld-generated")
        self._num_generated = {"train": num_train_tasks, "test": num_test_tasks}
        self._engine: Any = None
        self._loaded: str | None = None
        self._state: Any = None
        self._task_type = ""
        self._plan: tuple[str | None, list[str]] = (None, [])  # (game file, its stored walkthrough), read on demand
        self._taken: list[str | None] = []  # this episode's commands as sent (None: malformed, not sent)

    @property
    def instructions(self) -> str:
        return INSTRUCTIONS

    # -- tasks ------------------------------------------------------------------------------------
    def _official(self, split: str) -> tuple[str, ...]:
        folder = {"train": "train", "test": self.test_split}[split]
        if not os.path.isdir(os.path.join(self.data_dir, "json_2.1.1", folder)):
            raise FileNotFoundError(missing_data_message(self.data_dir))
        games = official_games(self.data_dir, folder, self.task_types)
        if not games:
            raise FileNotFoundError(missing_data_message(self.data_dir))
        return games

    def _count_tasks(self, split: str) -> int:
        return self._num_generated[split] if self.source == "generated" else len(self._official(split))

    def game_file(self, split: str, index: int) -> str:
        """The ``game.tw-pddl`` of task ``index`` of ``split`` (generated on first use for ``generated``)."""
        self.check_index(split, index)
        if self.source == "official":
            return self._official(split)[index]
        import_engine()
        from cope.envs.alfworld.games import ensure_game

        return ensure_game(self.cache_dir, split, index, self.task_types, self.seed)

    # -- episode ----------------------------------------------------------------------------------
    def reset(self, task: Task) -> EnvReset:
        self._reset_started()
        path = self.game_file(task.split, task.index)
        self._state = None
        if self._engine is None:
            self._engine, self._loaded = take_engine()
        with engine_call(memo=self.engine_memo):
            if path != self._loaded:
                self._loaded = None
                self._engine.load(path)
                self._loaded = path
            self._state = self._engine.reset()
        self._episode_started()
        self._taken = []
        self._task_type = _task_type(path)
        text = self._state["feedback"]
        observation, harness = self._cap(text)
        goal = [line for line in text.split("\n") if line.startswith("Your task is to:")]
        info = {"gamefile": path, "task_type": self._task_type, "source": self.source}
        return EnvReset(observation=observation, task_description=goal[-1] if goal else "",
                        admissible_actions=self._admissible(), info=info, harness=harness)

    def step(self, action: str) -> EnvStep:
        self._step_started()
        refused = unencodable(action)
        command = None if refused else single_line(action, lower=True)
        notes: list[str] = []
        if command is None:
            observation, valid, won = "", False, False
            notes.append(refused or HARNESS_MALFORMED)
        else:
            valid = command in self._state["admissible_commands"]
            with engine_call(memo=self.engine_memo):
                self._state, _, _ = self._engine.step(command)
            won = bool(self._state["won"])
            observation, cut = self._cap(self._state["feedback"])
            notes += [cut] if cut else []
        self._taken.append(command)
        timeout = self._step_ended(won)
        notes += [HARNESS_TIMEOUT] if timeout else []
        return EnvStep(
            observation=observation,
            reward=1.0 if won else 0.0,
            done=self.episode_over,
            valid=valid,
            success=won,
            score=1.0 if won else 0.0,
            harness="\n".join(notes),
            admissible_actions=self._admissible(),
            info={"timeout": timeout, "command": command, "task_type": self._task_type},
        )

    def expert_plan(self) -> list[str]:
        """The loaded game's stored walkthrough (``game.tw-pddl``; tests and benchmarks only)."""
        if self._loaded is None:
            raise RuntimeError("AlfWorldEnv.expert_plan called before reset")
        with open(self._loaded) as f:
            return list(json.load(f).get("walkthrough") or [])

    def expert_action(self) -> str | None:
        """The stored walkthrough's next command while this episode has followed it (the optional expert capability
        of `cope.envs.base.Env`, a plan expert: expert demonstrations, ``algo=sft``); None once a command left the
        walkthrough (compared lower-cased, as the engine gets them), once it is used up, or when the episode is over.
        Reads the game file once per game, never the engine: asking does not change the episode."""
        self._require_episode("expert_action")
        if self._plan[0] != self._loaded:
            self._plan = (self._loaded, self.expert_plan())
        plan, taken = self._plan[1], self._taken
        if self.episode_over or len(taken) >= len(plan) or any(
                t != single_line(p, lower=True) for t, p in zip(taken, plan)):
            return None
        return plan[len(taken)]

    def close(self) -> None:
        """Hands the engine to this process's idle pool (``cope.envs.alfworld.engine``); safe to call twice."""
        engine, loaded, self._engine, self._loaded, self._state = self._engine, self._loaded, None, None, None
        self._no_episode()
        if engine is not None:
            park_engine(engine, loaded)

    # -- helpers ----------------------------------------------------------------------------------
    def _admissible(self) -> list[str]:
        return [c for c in self._state["admissible_commands"] if c not in self.hidden_commands]

    def _cap(self, text: str) -> tuple[str, str]:
        text = text.strip()
        if len(text) <= self.max_observation_chars:
            return text, ""
        return text[: self.max_observation_chars], HARNESS_TRUNCATED.format(self.max_observation_chars, len(text))


def _task_type(game_file: str) -> str:
    """From the official folder name (``<task_type>-<obj>-...``), else from ``traj_data.json``."""
    folder = os.path.dirname(game_file)
    task_type = os.path.basename(os.path.dirname(folder)).split("-", 1)[0]
    if task_type in TASK_TYPES:
        return task_type
    with open(os.path.join(folder, "traj_data.json")) as f:
        return json.load(f)["task_type"]
