"""ScienceWorld (Wang et al., 2022) behind the `cope.envs.base.Env` protocol: the real benchmark.

The simulator is the ``scienceworld`` package (pinned 1.2.3; extra ``scienceworld``): a Scala program in a
JVM, driven over a py4j socket. Each env instance owns one JVM, started at its first ``reset`` and reused
by every later reset (a reset only reloads the task: ~0.1 s); ``close()`` ends it.

Tasks (see `cope.envs.scienceworld.tasks`): ``tasks`` selects task names or paper ids (default all 30);
our ``train`` split is ScienceWorld's train variations, ``test`` its ``dev`` (default) or ``test``
variations (``test_split``); the selected tasks' variations are interleaved over ``Task.index``.
``simplifications`` is the simulator's flag string (``"easy"`` or e.g. ``"teleportAction,openDoors"``).

Lean steps: the package's ``ScienceWorldEnv.step`` also fetches look/inventory/task text and the full
valid-action list on every call (8-20 steps/s). The adapter calls the simulator's ``step``, ``getScore``
and ``getCompleted`` only; the valid-action list (one list call) is fetched only when
``admissible_actions=True`` (optionally capped to ``max_admissible_actions``, a deterministic sample).

Scores and rewards: ``score`` is the simulator's score divided by 100, i.e. in [0, 1] (the package's
integer 0..100 is in ``info["score100"]``), and -1.0 once the task has failed (e.g. ``focus on`` a wrong
object), which ends the episode with ``success=False``. ``success`` is the simulator's completion flag
(``getCompleted``: every ordered subgoal done; it coincides with score 1.0). Per-step ``reward``:

* ``reward_mode="sparse"``: 1.0 on the step that completes the task, else 0.0;
* ``reward_mode="score_delta"``: the change of ``score`` on this step (so an episode's rewards sum to its
  final score; a failure step pays ``-1 - previous score``).

Validity: an action that is not encodable text is refused with the notice of
`cope.envs.actions.unencodable` (py4j would raise ``Py4JError`` on it); otherwise it is cleaned with
`cope.envs.actions.single_line`; an empty or multi-line action is malformed (not sent; empty
observation, harness notice). The simulator's own refusals are read from its
reply (`cope.envs.scienceworld.text`): parse failures are invalid, known no-effect refusals too unless
``no_effect_invalid=False``. An ambiguous command is *valid*: with ``ambiguity="menu"`` (the benchmark's
behaviour) the observation is the simulator's numbered menu, the admissible actions are the menu numbers
and the next action should be one of them; with ``ambiguity="first"`` the adapter answers ``0`` itself
(the gold agent's choice) and says so in harness text.

Observation vs harness: ``observation`` is the simulator's text only (at reset: the task description, a
blank line, then ``look around``); the adapter's notices (malformed action, observation cut at
``max_observation_chars``, step limit) go to ``harness`` (also at reset: ``EnvReset.harness``).

JVM: ``-Xmx{jvm_heap_mb}m`` plus ``jvm_args``; the defaults (384 MB, SerialGC) keep one JVM at ~300 MB
RSS instead of ~750 MB. ``-XX:hashCode=2`` fixes Java's identity hashes, which makes the order of objects in
the simulator's sets (room descriptions; grow-fruit's bees: otherwise different from JVM to JVM) and so
every transcript reproducible; every instance's JVM gets it (before ``jvm_args``; another ``-XX:hashCode`` in
them is refused): ``expert_action`` and the replays of branched rollouts (``forks_by_replay``) rely on it.
"""
from __future__ import annotations

import random
from collections.abc import Sequence

from cope.envs.actions import single_line, unencodable
from cope.envs.base import SPLITS, EnvReset, EnvStep, Task, TaskEnv
from cope.envs.scienceworld import text as sw_text
from cope.envs.scienceworld.jvm import DEFAULT_JVM_ARGS, HASH_CODE, REPRODUCIBLE_JVM_ARGS, Simulator, backend
from cope.envs.scienceworld.tasks import (
    TEST_SPLITS,
    TaskMap,
    parse_simplifications,
    resolve_tasks,
)

REWARD_MODES = ("sparse", "score_delta")
AMBIGUITY_MODES = ("menu", "first")
HARNESS_MALFORMED = "Invalid action: answer with one command on one line, e.g. look around."
HARNESS_TIMEOUT = "Step limit reached: the episode ends."
_EXAMPLES = 16  # example_actions() size


class ScienceWorldEnv(TaskEnv):
    """ScienceWorld tasks behind the `cope.envs.base.Env` protocol; one episode (and one JVM) per instance.

    Args:
        tasks: Task names (``boil``) or paper ids (``1-1``); None or empty: all 30.
        test_split: ScienceWorld variation split used as our ``test`` split: ``dev`` or ``test``.
        simplifications: The simulator's flags, comma-separated (``easy``, ``teleportAction``, ...).
        max_variations_per_task: Use only the first N variations of each task per split (0: all).
        max_steps: Actions per episode before a timeout.
        reward_mode: ``sparse`` or ``score_delta`` (see the module docstring).
        admissible_actions: Report the simulator's valid actions after every reset/step (slower).
        max_admissible_actions: Cap on that list (0: no cap); a deterministic sample per step.
        ambiguity: ``menu`` (show the numbered menu, the agent answers) or ``first`` (adapter picks 0).
        no_effect_invalid: Known no-effect refusals ("The door is already open.") count as invalid.
        max_observation_chars: Longer observations are cut (harness notice).
        jvm_heap_mb: JVM max heap (``-Xmx``); 0 leaves the JVM default (~1/4 of RAM).
        jvm_args: Further JVM options (``-XX:+UnlockExperimentalVMOptions -XX:hashCode=2`` always come first).
        name: Env name used in task ids.
    """

    max_instances = 16  # one JVM (~300-450 MB) per instance: the trainer runs at most this many episodes at once
    forks_by_replay = True  # a task variation replays exactly, on a fresh or a reused JVM, given -XX:hashCode=2 (always set)

    def __init__(
        self,
        tasks: Sequence[str] | None = None,
        test_split: str = "dev",
        simplifications: str = "",
        max_variations_per_task: int = 0,
        max_steps: int = 50,
        reward_mode: str = "sparse",
        admissible_actions: bool = False,
        max_admissible_actions: int = 0,
        ambiguity: str = "menu",
        no_effect_invalid: bool = True,
        max_observation_chars: int = 4000,
        jvm_heap_mb: int = 384,
        jvm_args: Sequence[str] = DEFAULT_JVM_ARGS,
        name: str = "scienceworld",
    ) -> None:
        self.tasks = resolve_tasks(tasks)
        if test_split not in TEST_SPLITS:
            raise ValueError(f"test_split must be one of {TEST_SPLITS}, got {test_split!r}")
        self.simplifications = parse_simplifications(simplifications, self.tasks)
        for arg, v, low in (("max_variations_per_task", max_variations_per_task, 0), ("max_steps", max_steps, 1),
                            ("max_admissible_actions", max_admissible_actions, 0),
                            ("max_observation_chars", max_observation_chars, 1), ("jvm_heap_mb", jvm_heap_mb, 0)):
            if not isinstance(v, int) or isinstance(v, bool) or v < low:
                raise ValueError(f"{arg} must be an int >= {low}, got {v!r}")
        if 0 < jvm_heap_mb < 128:
            raise ValueError(f"jvm_heap_mb must be 0 (JVM default) or >= 128, got {jvm_heap_mb!r}")
        if reward_mode not in REWARD_MODES:
            raise ValueError(f"reward_mode must be one of {REWARD_MODES}, got {reward_mode!r}")
        if ambiguity not in AMBIGUITY_MODES:
            raise ValueError(f"ambiguity must be one of {AMBIGUITY_MODES}, got {ambiguity!r}")
        if isinstance(jvm_args, str) or any(not isinstance(a, str) or not a.startswith("-") for a in jvm_args):
            raise ValueError(f"jvm_args must be a list of JVM options (each starting with '-'), got {jvm_args!r}")
        if any(a.startswith("-XX:hashCode=") and a != HASH_CODE for a in jvm_args):
            raise ValueError(f"jvm_args must not change {HASH_CODE} (identity hashes order the simulator's objects: "
                             f"without it a task does not replay the same), got {jvm_args!r}")
        if not name:
            raise ValueError("name must be a non-empty string")
        backend()  # fail at construction, naming the extra, when the package is missing
        self.test_split, self.max_variations_per_task, self.max_steps = test_split, max_variations_per_task, max_steps
        self.reward_mode, self.admissible, self.max_admissible = reward_mode, bool(admissible_actions), max_admissible_actions
        self.ambiguity, self.no_effect_invalid = ambiguity, bool(no_effect_invalid)
        self.max_observation_chars, self.name = max_observation_chars, name
        # determinism is not optional: the unlock first, so that it precedes any experimental option of jvm_args
        self.javaopts = (([f"-Xmx{jvm_heap_mb}m"] if jvm_heap_mb else []) + list(REPRODUCIBLE_JVM_ARGS)
                         + [a for a in jvm_args if a not in REPRODUCIBLE_JVM_ARGS])
        self._maps = {s: TaskMap.build(self.tasks, s, test_split, max_variations_per_task) for s in SPLITS}
        flags = self.simplifications.split(",")
        self._instructions = sw_text.instructions(teleport="teleportAction" in flags or "easy" in flags,
                                                  menus=ambiguity == "menu")
        self._sim: Simulator | None = None
        self._task: Task | None = None
        self._pair: tuple[str, int] = ("", 0)
        self._score, self._menu = 0.0, None
        self._sent: list[str | None] = []  # this episode's commands as the simulator got them (None: malformed, not sent)
        self._gold: dict[tuple[str, int], list[str]] = {}  # gold action sequences read so far (expert_action)

    # -- protocol -------------------------------------------------------------------------------
    @property
    def instructions(self) -> str:
        return self._instructions

    def _count_tasks(self, split: str) -> int:
        return len(self._maps[split])

    def task_pair(self, task: Task) -> tuple[str, int]:
        """The (ScienceWorld task name, variation) of ``task``."""
        return self._maps[task.split].pairs[self.check_index(task.split, task.index)]

    def reset(self, task: Task) -> EnvReset:
        self._reset_started()
        self._task = None
        name, variation = self._load(task, gold=False)
        server = self._sim.server
        description = server.getTaskDescription()
        look = server.step("look around")
        self._task, self._pair = task, (name, variation)
        self._score, self._menu, self._sent = 0.0, None, []
        self._episode_started()
        observation, cut = self._cap(f"{description}\n\n{look}")
        return EnvReset(
            observation=observation,
            task_description=description,
            admissible_actions=self._admissible() if self.admissible else None,
            info={"task_name": name, "variation": variation},
            harness=f"[Observation cut at {self.max_observation_chars} characters.]" if cut else "",
        )

    def step(self, action: str) -> EnvStep:
        self._step_started()
        refused = unencodable(action)  # py4j cannot send it: Py4JError would abort the episode
        command = None if refused else single_line(action)
        notes: list[str] = []
        ambiguous = False
        if command is None:
            observation, valid = "", False
            notes.append(refused or HARNESS_MALFORMED)
            self._sent.append(None)
        else:
            server = self._sim.server
            observation = server.step(command)
            self._sent.append(command)
            menu = sw_text.parse_menu(observation)
            ambiguous = menu is not None
            if ambiguous and self.ambiguity == "first":
                notes.append(f"(Ambiguous command: the harness chose option 0, '{menu[0]}'.)")
                observation, menu = server.step("0"), None
                self._sent.append("0")  # the gold path lists the menu's answer as a step of its own
            self._menu = menu
            valid = menu is not None or not (
                sw_text.is_parse_failure(observation) or (self.no_effect_invalid and sw_text.is_no_effect(observation))
            )
        score100, completed = self._progress()
        score, previous = score100 / 100, self._score
        self._score = score
        failed = score < 0
        success = completed and not failed
        timeout = self._step_ended(success or failed)
        observation, cut = self._cap(observation)
        if cut:
            notes.append(f"[Observation cut at {self.max_observation_chars} characters.]")
        if timeout:
            notes.append(HARNESS_TIMEOUT)
        reward = (1.0 if success else 0.0) if self.reward_mode == "sparse" else score - previous
        return EnvStep(
            observation=observation,
            reward=reward,
            done=self.episode_over,
            valid=valid,
            success=success,
            score=score,
            harness=" ".join(notes),
            admissible_actions=self._admissible() if self.admissible and not self.episode_over else None,
            info={"score100": score100, "failed": failed, "timeout": timeout, "ambiguous": ambiguous,
                  "task_name": self._pair[0], "variation": self._pair[1]},
        )

    def close(self) -> None:
        sim, self._sim, self._task = self._sim, None, None
        self._no_episode()
        if sim is not None:
            sim.close()

    # -- extras (warm start, tests, benchmarks) ----------------------------------------------------
    def example_actions(self) -> list[str]:
        """A few actions the simulator accepts now (menu numbers inside a menu); for the tiny model's
        warm start when ``admissible_actions`` is off. Fetches the valid-action list (slow)."""
        self._require_episode("example_actions")
        return self._admissible(cap=_EXAMPLES)

    def gold_actions(self, task: Task) -> list[str]:
        """The simulator's gold action sequence for ``task``. Loading with the gold path runs it to its end,
        so the episode in progress is over: call ``reset`` before stepping again."""
        gold = self._read_gold(task)
        self._task = None
        self._no_episode()
        return gold

    def expert_action(self) -> str | None:
        """The gold action sequence's next action while this episode has followed it (the optional expert capability
        of `cope.envs.base.Env`, a plan expert: expert demonstrations, ``algo=sft``); None once a command left the
        gold path, once it is used up, or when the episode is over. With ``ambiguity="first"`` the menu answer the
        adapter gave (``0``) counts as the gold path's next step, which lists it. The first call of a task reads its
        gold path (loading the task with it runs it to its end), then reloads the task and replays this episode's
        commands, so asking does not change the episode (the simulator is deterministic: ``-XX:hashCode=2``)."""
        self._require_episode("expert_action")
        if self.episode_over:
            return None
        if self._pair not in self._gold:
            self._gold[self._pair] = self._read_gold(self._task)
            self._load(self._task, gold=False)  # back to the episode: the reset's look, then its commands
            for command in ["look around", *(c for c in self._sent if c is not None)]:
                self._sim.server.step(command)
        plan, sent = self._gold[self._pair], self._sent
        if len(sent) >= len(plan) or any(c != single_line(p) for c, p in zip(sent, plan)):
            return None
        return plan[len(sent)]

    @property
    def jvm_pid(self) -> int | None:
        return self._sim.proc.pid if self._sim is not None and self._sim.alive else None

    @property
    def jvm_start_seconds(self) -> float | None:
        return self._sim.start_seconds if self._sim is not None else None

    # -- internals --------------------------------------------------------------------------------
    def _read_gold(self, task: Task) -> list[str]:
        """``task``'s gold action sequence; the simulator is left at the gold path's end."""
        self._load(task, gold=True)
        return [str(a) for a in self._sim.server.getGoldActionSequence()]

    def _load(self, task: Task, gold: bool) -> tuple[str, int]:
        name, variation = self.task_pair(task)
        if self._sim is None or not self._sim.alive:  # first use, or the JVM died: (re)start it
            self.close()
            self._sim = Simulator(self.javaopts)
        error = self._sim.server.load(name, variation, self.simplifications, gold)
        if error:
            raise RuntimeError(f"ScienceWorld load({name!r}, {variation}, {self.simplifications!r}): {error}")
        return name, variation

    def _progress(self) -> tuple[int, bool]:
        """(score in 0..100 as the package rounds it, completion flag)."""
        server = self._sim.server
        return round(100 * server.getScore()), bool(server.getCompleted())

    def _admissible(self, cap: int | None = None) -> list[str]:
        if self._menu is not None:
            return [str(i) for i in range(len(self._menu))]
        # the plain list call: same set as the JSON call with templates, 2-4x cheaper (measured)
        actions = sorted(set(self._sim.server.getValidActionObjectCombinations()))
        cap = self.max_admissible if cap is None else cap
        if 0 < cap < len(actions):
            actions = sorted(random.Random(f"{self._task.id}/{self._steps}").sample(actions, cap))
        return actions

    def _cap(self, text: str) -> tuple[str, bool]:
        if len(text) <= self.max_observation_chars:
            return text, False
        return text[: self.max_observation_chars], True

    def __getstate__(self) -> dict:  # a pickled copy starts its own JVM on its first reset
        state = dict(self.__dict__)
        state.update(_sim=None, _task=None, _live=None)
        return state

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass
