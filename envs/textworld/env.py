"""TextWorld (Microsoft's text-game generator, ``textworld==1.7.0``) behind the `cope.envs.base.Env` protocol.

The games are the real TextWorld challenges (``tw-simple``, ``tw-cooking``, ``tw-coin_collector``,
``tw-treasure_hunter``), generated on demand by seed into a cache folder (:mod:`cope.envs.textworld.games`:
seed mapping, cache layout) and played through TextWorld's own Inform 7 / Jericho runtime.

Episode: ``reset(task)`` loads the task's game (generating it once), the first observation is the
game's opening text without TextWorld's ASCII-art banner: the objective, then the first room.
``task_description`` is the game's objective (``""`` for ``tw-simple`` with ``simple_goal: none``).
The episode ends when the game is won (``success``), lost (e.g. a burnt meal in ``tw-cooking``), or
after ``max_steps`` actions (``info["timeout"]``).

Score and reward: ``score`` is the running score normalized by the game's maximum, ``points /
max_score`` in [0, 1] (the raw numbers are in ``info``). ``reward_mode``:

* ``score_delta`` (default): ``(points_t - points_{t-1}) / max_score``; an episode's rewards sum to its
  final ``score`` (a won game sums to 1.0);
* ``sparse``: 1.0 on the step that wins the game, else 0.0.

Validity (``valid``): an action is valid iff the game carried out one of TextWorld's own game actions
for it: the actions of the game's logic (go, take, open, examine, look, inventory, cook, slice, ...),
the ones its admissible-command lists are made of, whatever the phrasing ("x trunk", "look at trunk",
"get knife" count). Everything else is invalid: parser errors ("That's not a verb I recognise.",
"You can't see any such thing."), refusals ("You can't go that way.", "That's already open.",
"That's fixed in place."), and Inform 7 verbs outside TextWorld's logic ("jump", "wait", "x me",
"help", "goal", "score"). It is read from the game's Inform 7 action trace (turned on at reset;
``[opening the antique trunk - succeeded]``, stripped from the observation): valid iff a top-level
action succeeded and matches one of the game's action patterns (``opening the {c}``, ...) over its
entities. The same rule in both modes; it does not use the admissible list (TextWorld's own state
tracker misses some actions the game did carry out, e.g. "get knife" from a table, or "examine
potato" once the game calls it "raw potato").

Before anything reaches the game the action is cleaned with :func:`cope.envs.actions.single_line`
(lower-cased) and refused, without a game turn, with an empty observation and a *harness* notice when
it is not encodable text (:func:`cope.envs.actions.unencodable`), is empty, spans several lines (or holds
another control character), is longer than the interpreter's input buffer (198 bytes), holds a
backslash (below), chains commands (``.``, ``,``, ``;``, `` then ``), or is a game-system command (quit,
restart, save, restore, undo, version, verbose/brief, script, ``tw-*`` and TextWorld's other framework
commands: they would desync the episode from the tracker).

Interpreter escapes. Jericho runs the games in its build of dumb-frotz, whose input routine
(``frotz/src/dumb/dumb_input.c``: ``dumb_read_line``, ``translate_special_chars``) reads some input
itself before the game sees it. Only the backslash does that, and every use of it is harmful, so an
action holding one anywhere is refused (``HARNESS_ESCAPE``):

* a leading ``\\`` followed by a lower-case letter is a runtime command (``\\help``,
  ``\\set``, ``\\s``, ``\\w``, ...; actions are lower-cased, so ``\\N wh sto fridge`` is one too). Jericho
  feeds the same line again after each, so the interpreter never returns: ``\\help`` wrote 16 GB of
  help text to stdout in 20 s, an unknown one repeats "DUMB-FROTZ: unknown command" on stderr;
* anywhere else ``\\x`` is a key escape: ``\\_`` is Return (``go\\_north`` runs ``go``, and ``north``
  then replaces the *next* action: the episode and the game drift apart), ``\\[`` Escape, ``\\?``
  Backspace, ``\\^ \\. \\< \\>`` arrows, ``\\1``..``\\0`` function keys, and with capitals (never
  reached after lower-casing) the hot keys undo, restart, quit, record, playback and seed.

Nothing else is special to the interpreter: ``#``, ``/``, ``*``, ``!``, ``@``, non-ASCII letters all reach
the game's Inform 7 parser ("That's not a verb I recognise."), the games are release builds without
Inform's debugging verbs (``purloin``, ``gonear``, ``abstract``, ``actions``, ``rules``, ``trace``,
``tree``, ``showme``, ``scope`` are unknown verbs), and ``again``/``g``, ``oops``, ``score``,
``pronouns`` are harmless game verbs (invalid: not game actions). Words that end, rewind or restart the
game outside our episode bookkeeping are the game-system commands above. ALFWorld runs on TextWorld's
PDDL engine, not on this interpreter: it matches commands exactly against its admissible list and has
no escapes (:mod:`cope.envs.alfworld.env`).

Observation vs harness: the game's text is the observation, tidied (the opening banner removed, runs
of blank lines collapsed to one, centring and trailing spaces and surrounding whitespace stripped,
and after a win or loss the "Would you like to RESTART, RESTORE ...?" prompt dropped); our notices
(refusals above, truncation at ``max_observation_chars``, the step limit) go to ``harness``
(``EnvReset.harness`` for the first observation).

Speed: one Jericho interpreter per env instance, started on the first reset and reused: a reset to
the same game only restarts it, another game is loaded into the same interpreter.
"""
from __future__ import annotations

import copy
import os
import random
import re

from cope.envs.actions import single_line, unencodable
from cope.envs.base import EnvReset, EnvStep, Task, TaskEnv
from cope.envs.textworld.games import (
    TRACED_KEY,
    action_patterns,
    challenge_settings,
    ensure_game,
    make_env,
    restore,
    snapshot,
)

INSTRUCTIONS = (
    "You are playing a text adventure game. Reach the goal it gives you. "
    "Each turn, answer with exactly one command, for example: look, inventory, go north, examine cookbook, "
    "open fridge, take apple, take apple from table, put apple on table, insert apple into box, drop apple, "
    "eat apple, unlock door with key."
)
HARNESS_MALFORMED = "Invalid action: answer with one game command on one line, e.g. 'go north'."
HARNESS_CHAINED = "Invalid action: one command per turn (no '.', ',', ';' or 'then')."
HARNESS_SYSTEM = "Invalid action: '{}' is a game-system command and is not available."
HARNESS_ESCAPE = "Invalid action: game commands have no backslash ('\\')."
HARNESS_TRUNCATED = "[observation truncated: {} of {} characters shown]"
HARNESS_TIMEOUT = "Step limit reached."
REWARD_MODES = ("sparse", "score_delta")
MAX_COMMAND_BYTES = 198  # Jericho cuts longer input (INPUT_BUFFER_SIZE)
SYSTEM_VERBS = frozenset((
    "quit", "q", "die", "restart", "restore", "save", "undo", "script", "transcript", "unscript", "noscript",
    "verify", "version", "verbose", "brief", "superbrief", "long", "short", "normal", "notify", "print_state",
))
SYSTEM_PHRASES = ("restrict commands", "enable print state option", "disable print state option")
_CHAIN = re.compile(r"[.,;]|\bthen\b")
_TRACE_TAG = re.compile(r"\[[^]]+\]\n?")  # the tags TextWorld itself strips (its _detect_i7_events_debug_tags)
_BANNER_LINE = re.compile(r"[\s_|\\/$<>]*")  # the ASCII-art title: no letters, no digits
_REPLAY = re.compile(r"\n*Would you like to RESTART, RESTORE a saved game, QUIT or UNDO the last command\?\s*$")
_BLANKS = re.compile(r"\n\s*\n")
_PADDING = re.compile(r"^ {4,}|[ \t]+$", re.MULTILINE)  # centring spaces ("*** The End ***"), trailing spaces


def tidy(text: str, first: bool = False) -> str:
    """Game text as the agent sees it (banner removed when ``first``, blank-line runs collapsed)."""
    if first:
        lines = text.split("\n")
        while lines and _BANNER_LINE.fullmatch(lines[0]):
            lines.pop(0)
        text = "\n".join(lines)
    text = _PADDING.sub("", _REPLAY.sub("", text))
    return _BLANKS.sub("\n\n", text).strip()


class TextWorldEnv(TaskEnv):
    """TextWorld challenge games, generated by seed and cached; one episode at a time.

    Args:
        challenge: tw-simple | tw-cooking | tw-coin_collector | tw-treasure_hunter.
        cache_dir: Folder of the generated games (created when missing).
        level: Difficulty of tw-coin_collector (1-300) and tw-treasure_hunter (1-30).
        simple_rewards: tw-simple reward frequency: dense | balanced | sparse.
        simple_goal: tw-simple objective text: detailed | brief | none.
        cooking_recipe: tw-cooking ingredients in the recipe (1-5).
        cooking_take: tw-cooking ingredients to find (0..cooking_recipe).
        cooking_go: tw-cooking number of rooms: 1 | 6 | 9 | 12.
        cooking_open: tw-cooking containers/doors need opening.
        cooking_cook: tw-cooking ingredients need cooking.
        cooking_cut: tw-cooking ingredients need cutting.
        cooking_drop: tw-cooking inventory has limited capacity.
        max_steps: Actions per episode before a timeout.
        num_train_tasks: Number of tasks (games) in the train split.
        num_test_tasks: Number of tasks in the test split.
        admissible_actions: Report TextWorld's admissible commands (costs 25-45% of the steps/s).
        reward_mode: sparse | score_delta (see the module docstring).
        max_observation_chars: Longer game text is cut there, with a harness notice.
        name: Env name used in task ids.
    """

    # The optional fork capabilities (cope.train.collect.branching): fork() copies the running game (below); and a
    # generated game is deterministic, so a fresh instance that resets to the same task and replays an episode's
    # commands reaches the same state (checked there; what env workers use, where no copy crosses processes).
    forks_by_replay = True

    def __init__(
        self,
        challenge: str = "tw-cooking",
        cache_dir: str = "~/.cache/cope-trainer/textworld",
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
        max_steps: int = 30,
        num_train_tasks: int = 1_000,
        num_test_tasks: int = 100,
        admissible_actions: bool = False,
        reward_mode: str = "score_delta",
        max_observation_chars: int = 4000,
        name: str = "textworld",
    ) -> None:
        self._game_args = {
            "level": level, "simple_rewards": simple_rewards, "simple_goal": simple_goal,
            "cooking_recipe": cooking_recipe, "cooking_take": cooking_take, "cooking_go": cooking_go,
            "cooking_open": cooking_open, "cooking_cook": cooking_cook, "cooking_cut": cooking_cut,
            "cooking_drop": cooking_drop,
        }
        challenge_settings(challenge, "train", **self._game_args)  # validates every game argument
        if not cache_dir:
            raise ValueError("cache_dir must be a non-empty path")
        if max_steps < 1:
            raise ValueError(f"max_steps must be >= 1, got {max_steps!r}")
        if not 1 <= num_train_tasks <= 2**31:
            raise ValueError(f"num_train_tasks must be in [1, 2**31], got {num_train_tasks!r}")
        if not 1 <= num_test_tasks <= 2**31:
            raise ValueError(f"num_test_tasks must be in [1, 2**31], got {num_test_tasks!r}")
        if reward_mode not in REWARD_MODES:
            raise ValueError(f"reward_mode must be one of {REWARD_MODES}, got {reward_mode!r}")
        if max_observation_chars < 1:
            raise ValueError(f"max_observation_chars must be >= 1, got {max_observation_chars!r}")
        if not name:
            raise ValueError("name must be a non-empty string")
        self.challenge = challenge
        self.cache_dir = os.path.expanduser(str(cache_dir))
        self.max_steps = max_steps
        self.admissible = bool(admissible_actions)
        self.reward_mode = reward_mode
        self.max_observation_chars = max_observation_chars
        self.name = name
        self._num_tasks = {"train": num_train_tasks, "test": num_test_tasks}
        self._env = None  # the textworld environment (wrappers around one Jericho interpreter)
        self._path: str | None = None  # game file loaded into it
        self._patterns: re.Pattern | None = None  # the game's action patterns (fast path)
        self._state = None
        self._resume = None  # a fork's snapshot, restored into an interpreter of its own on its first step
        self._plan: list[str] = []  # the game's walkthrough (read at reset): expert_action follows it
        self._taken: list[str | None] = []  # this episode's commands as sent (None: refused before the game)
        self.games_generated = 0  # games this instance had to generate (cache misses)

    @property
    def instructions(self) -> str:
        return INSTRUCTIONS

    def game_file(self, task: Task) -> str:
        """The task's ``.z8`` game file, generated into the cache when missing."""
        self.check_index(task.split, task.index)
        settings = challenge_settings(self.challenge, task.split, **self._game_args)
        path, generated = ensure_game(self.cache_dir, self.challenge, settings, task.split, task.index)
        self.games_generated += generated
        return str(path)

    def reset(self, task: Task) -> EnvReset:
        self._reset_started()
        self._resume = None
        path = self.game_file(task)
        self._load(path)
        state = self._env.reset()
        self._env._send("tw-trace-actions")  # Inform 7 prints [action - succeeded/failed] tags from now on
        if self._patterns is None:
            self._patterns = action_patterns(state["game"])
        self._state = state
        self._plan, self._taken = list(state.get("extra.walkthrough") or []), []
        self._episode_started()
        obs, notice = self._cap(tidy(state["feedback"], first=True))
        return EnvReset(
            observation=obs,
            task_description=(state["objective"] or "").strip(),
            admissible_actions=self._admissible(state),
            info={"game_file": path, "max_score": state["max_score"], "points": state["score"]},
            harness=notice,
        )

    def step(self, action: str) -> EnvStep:
        self._step_started()
        prev = self._state
        command = single_line(action, lower=True)
        if self._resume is not None:  # a fork's first step: its own interpreter, at the snapshot
            self._env, self._resume = restore(self._resume, self._path), None
        refusal = unencodable(action) or self._refusal(command)
        if refusal:
            state, valid, obs, harness = prev, False, "", refusal
        else:
            state, _, _ = self._env.step(command)
            valid = self._traced_action(state[TRACED_KEY])
            obs, harness = self._cap(tidy(_TRACE_TAG.sub("", state["feedback"])))
        self._state = state
        self._taken.append(None if refusal else command)
        won, lost = bool(state["won"]), bool(state["lost"])
        timeout = self._step_ended(won or lost)
        if timeout:
            harness = f"{harness}\n{HARNESS_TIMEOUT}" if harness else HARNESS_TIMEOUT
        max_score = state["max_score"] or 1
        if self.reward_mode == "sparse":
            reward = 1.0 if won else 0.0
        else:
            reward = (state["score"] - prev["score"]) / max_score
        return EnvStep(
            observation=obs,
            reward=float(reward),
            done=self.episode_over,
            valid=valid,
            success=won,
            score=state["score"] / max_score,
            harness=harness,
            admissible_actions=self._admissible(state),
            info={"timeout": timeout, "won": won, "lost": lost, "points": state["score"], "max_score": state["max_score"]},
        )

    def fork(self) -> "TextWorldEnv":
        """An independent instance whose episode is where this one is now; stepping one never changes the other, and
        no command is replayed. The game's state is a snapshot (:func:`~cope.envs.textworld.games.snapshot`: the
        Z-machine's memory, stack and RNG, so the action-trace mode switched on at reset too): the fork starts its own
        interpreter on its first step, so a branched rollout that snapshots every step pays only for the forks it
        uses. With ``admissible_actions`` the state tracker's Python state goes too, so the whole stack is copied now
        (a second interpreter at once). This instance's bookkeeping (step count, commands taken, the walkthrough) is
        copied."""
        self._require_episode("fork")
        other = copy.copy(self)
        if self.admissible:
            other._env, other._resume = self._env.copy(), None
        else:
            other._env, other._resume = None, (snapshot(self._env) if self._env is not None else self._resume)
        other._state = type(self._state)(self._state)  # shallow: a state is replaced at each step, never changed
        other._plan, other._taken = list(self._plan), list(self._taken)
        return other

    def walkthrough(self) -> list[str]:
        """The game's own winning command sequence from the start (tests/benchmarks only)."""
        self._require_episode("walkthrough")
        return list(self._state["extra.walkthrough"])

    def expert_action(self) -> str | None:
        """The walkthrough's next command while this episode has followed it (the optional expert capability of
        `cope.envs.base.Env`, a plan expert: expert demonstrations, ``algo=sft``); None once a command left the
        walkthrough (compared lower-cased, as the game gets them), once it is used up, or when the episode is over.
        Reads nothing from the game: asking does not change the episode."""
        self._require_episode("expert_action")
        plan, taken = self._plan, self._taken
        if self.episode_over or len(taken) >= len(plan) or any(
                t != single_line(p, lower=True) for t, p in zip(taken, plan)):
            return None
        return plan[len(taken)]

    def example_actions(self) -> list[str]:
        """Well-formed commands of the current game (warm start only; see `cope.envs.base`): the
        admissible commands when they are on, else look, inventory, the four moves and 10 of the game's
        commands (TextWorld's ``possible_admissible_commands``: not all possible right now)."""
        base = ["look", "inventory", "go north", "go south", "go east", "go west"]
        if self._state is None:
            return base
        if self.admissible:
            return self._admissible(self._state)
        commands = sorted(self._state["possible_admissible_commands"])
        return base + random.Random(self._steps).sample(commands, min(10, len(commands)))

    def close(self) -> None:
        if self._env is not None:
            self._env.close()
        self._env, self._path, self._state, self._resume = None, None, None, None
        self._no_episode()

    # -- internals ---------------------------------------------------------------------------------

    def _load(self, path: str) -> None:
        """Start the interpreter on ``path``, or load ``path`` into the running one (same game: nothing)."""
        if self._env is not None and path == self._path:
            return
        if self._env is None:
            self._env = make_env(self.admissible)
        self._env.load(path)
        self._path, self._patterns = path, None

    def _admissible(self, state) -> list[str] | None:
        return list(state["admissible_commands"]) if self.admissible else None

    def _refusal(self, command: str | None) -> str:
        """Harness text when ``command`` must not reach the game, else ``""``."""
        if command is None or not command.isprintable() or len(command.encode()) > MAX_COMMAND_BYTES:
            return HARNESS_MALFORMED
        if "\\" in command:  # the interpreter's own escapes (see the module docstring): a hang or a desync
            return HARNESS_ESCAPE
        if _CHAIN.search(command):
            return HARNESS_CHAINED
        verb = command.split(" ", 1)[0]
        if verb in SYSTEM_VERBS or verb.startswith("tw-") or command in SYSTEM_PHRASES:
            return HARNESS_SYSTEM.format(verb)
        return ""

    def _traced_action(self, text: str) -> bool:
        """Whether the action trace in ``text`` shows a top-level game action that succeeded."""
        for tag in _TRACE_TAG.findall(text):
            event = tag.strip()[1:-1].lower()
            if (event.endswith(" - succeeded") and not event.startswith("(")
                    and self._patterns.fullmatch(event[: -len(" - succeeded")])):
                return True
        return False

    def _cap(self, text: str) -> tuple[str, str]:
        if len(text) <= self.max_observation_chars:
            return text, ""
        return text[: self.max_observation_chars], HARNESS_TRUNCATED.format(self.max_observation_chars, len(text))
