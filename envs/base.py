"""The environment protocol every env implements, and :class:`TaskEnv`, the bookkeeping they share.

An env instance runs one episode at a time: ``reset(task)`` then ``step(action)`` until ``done``.
The trainer creates one instance per concurrent episode from a factory (a Hydra ``_partial_``),
so per-episode state lives on the instance and nothing is shared between episodes.

Text coming back from an env is split in two so the ECHO objective can tell them apart:

* ``observation``: what the world said (env output; a training target for ECHO);
* ``harness``: what our adapter added (format warnings, truncation notices); never a target.

The whole contract (what the rollout engine, the DataModule and the tiny warm start rely on) is in
the docstring of :class:`Env`; :class:`TaskEnv` implements the parts that are the same for every env
(split and task-index checks, the step budget, the reset/step order), so an env keeps only its own logic.

This module and every env module import without torch.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

SPLITS = ("train", "test")


def check_split(split: str) -> str:
    """``split`` itself, or a ValueError naming the known splits."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    return split


@dataclass(frozen=True)
class Task:
    """One task: a split and an index inside it. The env turns the index into a concrete task
    (for mazes, the layout seed). Episodes of one GRPO group share the same Task."""

    env: str
    split: str
    index: int

    @property
    def id(self) -> str:
        return f"{self.env}/{self.split}/{self.index}"


@dataclass
class EnvReset:
    observation: str  # env output shown to the agent first (role: observation)
    task_description: str = ""  # goal in words (already contained in `observation` if the env shows it)
    admissible_actions: list[str] | None = None  # None when the env does not know them
    info: dict[str, Any] = field(default_factory=dict)
    harness: str = ""  # adapter-added text (e.g. a truncation notice), shown after `observation`, never a target


@dataclass
class EnvStep:
    observation: str  # env output (ECHO target); may be empty, e.g. when the action was unparsable
    reward: float
    done: bool
    valid: bool  # False: the action was malformed or had no effect the env considers legal
    success: bool  # the env's own success flag; CoPE builds forecast targets only from successes
    score: float  # running task score (for mazes: 1.0 on success else 0.0)
    harness: str = ""  # adapter-added text (warnings), shown after `observation`, never an ECHO target
    admissible_actions: list[str] | None = None
    info: dict[str, Any] = field(default_factory=dict)


@runtime_checkable
class Env(Protocol):
    """What the rollout engine needs from an environment.

    Required (checked by ``isinstance(env, Env)``):

    * ``name``: the env name in task ids and metrics.
    * ``max_steps``: the step budget. Every action counts, valid or not. The env ends the episode itself
      on the ``max_steps``-th action (``done=True``; an env with a final evaluation, such as a checker or
      hidden tests, runs it on that step) and sets ``info["timeout"] = True`` when the budget, not the
      task, ended it. The engine also stops after ``max_steps`` actions, as a safety net.
    * ``instructions``: the system prompt (the rules and the action format).
    * ``num_tasks(split)``: how many tasks ``split`` (one of :data:`SPLITS`) has, indexed ``0..n-1``; an
      unknown split is a ValueError. ``reset`` of an index outside ``0..n-1`` is a ValueError.
    * ``reset(task) -> EnvReset``: starts an episode. A reset that raises leaves no episode to step.
    * ``step(action) -> EnvStep``: one action (the decoded text the policy sampled). ``step`` before any
      successful ``reset``, or after a step that returned ``done=True``, is a RuntimeError (``"... called
      before reset"`` / ``"... called after the episode ended; call reset first"``). An action that is not
      encodable text (an unpaired surrogate: :func:`cope.envs.actions.unencodable`) is an invalid action
      with that function's notice as ``harness``, refused before it reaches the engine, never an exception.
    * ``close()``: frees what the instance holds (processes, files); safe to call twice and before reset.

    Every ``EnvStep.info`` has ``"timeout"`` (bool): True only on the step that ends the episode
    because ``max_steps`` ran out (the engine records ``end_reason="max_steps"`` then, else ``"done"``).
    Optional: ``info["projected"]`` (bool) when the env read the action out of free text rather than its
    strict format (``action_parsing="project"``, see :mod:`cope.envs.actions`); the engine records it in
    ``Step.projected`` (``valid`` stays the env's verdict on the move). Other ``info`` keys are the env's own.

    Optional (looked up with ``getattr``/``hasattr``, not part of the protocol check):

    * ``example_actions() -> list[str]``: an env whose steps report no admissible actions (a shell, tool
      calls, code) lists a few well-formed actions for the current state. Only the tiny model's
      format-only warm start (random walks) uses them.
    * ``expert_action() -> str | None``: the expert's next action in the current episode, in the format
      ``step`` accepts (an admissible action where the env lists them); None when the episode is over or the
      expert has no action. Two kinds of expert answer it: a *state* expert plans from wherever the episode is
      (the maze: the next move of a shortest path); a *plan* expert follows one fixed winning sequence by
      position (TextWorld: the game's walkthrough; ALFWorld: the game's stored expert plan; ScienceWorld: the
      simulator's gold action sequence) and answers the plan's next entry while every earlier action of the
      episode was the plan's, None once one was not (or the plan is used up). Asking must not change the
      episode. Users: expert demonstrations for supervised fine-tuning (``algo=sft``,
      :mod:`cope.algos.sft`) and the tiny model's ``model.warm_start_policy=expert`` warm start (noisy expert
      walks, :mod:`cope.models.warm_start`; after a random move a plan expert has no answer, so the walk goes
      on at random). Looked up on the class, so a run is refused before any env starts.
    * ``tools`` and ``EnvReset.info["tools"]``: OpenAI function schemas of the env's tools in the native tool-call
      format (``env.action_format=native``); the rollout loop renders them with the model's chat template, reads
      calls in its syntax and hands ``step`` one JSON envelope (:mod:`cope.envs.tool_calls`: ``{"tool_call": ...}``,
      ``{"message": ...}``, ``{"refused": ...}``); a refused call is an invalid step with the reason as harness
      text, still counted against ``max_steps``. Absent in the text format.
    * ``fork() -> Env`` (a cheap copy of the current episode: the maze's, TextWorld's interpreter snapshot) or the
      class attribute ``forks_by_replay = True`` (the env is deterministic given the task: a fresh instance reset on
      the same task and given the same actions says the same: the maze, TextWorld, ALFWorld, ScienceWorld, WebShop,
      tau2 with the canned user or solo mode outside telecom) and, optionally, the static method
      ``replay_problem(kwargs) -> (argument, why) | None`` where the replay holds only for some constructor arguments
      (tau2's: not with an LLM user; the config check and the collector name ``env.<argument>``): branched rollouts
      (``+collector=branching``, :mod:`cope.train.collect.branching`) fork an episode mid-way with either; a replay
      is checked observation by observation, and one that differs aborts that branch (counted). The terminal
      sandbox, AppWorld and OpenEnv declare neither (the clock and randomness reach their output, or the served env
      is unknown), so branching refuses them by name (tests/envs/test_env_forks.py holds the decisions).
    * ``max_instances: int | None`` (class attribute; :class:`TaskEnv` says None): a memory-heavy env (one
      JVM per instance) says how many instances should live at once. With ``data.env_runtime.max_live_episodes=null``
      the DataModule runs an epoch's episodes in waves of that many, and the tiny warm start walks with
      at most that many.

    Raising in ``reset`` or ``step`` is allowed: the engine aborts that episode, logs and counts it.
    """

    name: str
    max_steps: int

    @property
    def instructions(self) -> str:
        """System prompt: the rules and the action format."""
        ...

    def num_tasks(self, split: str) -> int:
        """How many distinct tasks the split has (tasks are indexed 0..n-1)."""
        ...

    def reset(self, task: Task) -> EnvReset: ...

    def step(self, action: str) -> EnvStep: ...

    def close(self) -> None: ...


class TaskEnv:
    """The bookkeeping every env shares; subclasses keep only their own logic.

    A subclass sets ``name`` and ``max_steps``, says how many tasks a split has (``_num_tasks`` as a
    ``{"train": n, "test": m}`` dict, or an override of :meth:`_count_tasks`), and calls:

    * :meth:`check_index` to turn ``(split, index)`` into a checked index (the split checked too);
    * :meth:`_reset_started` first in ``reset`` (a reset that raises then leaves no episode to step) and
      :meth:`_episode_started` once the episode exists;
    * :meth:`_step_started` first in ``step`` (the reset/step order guards; counts the action) and
      :meth:`_step_ended` with "did the task end this episode?" once the step is done: it returns the
      ``timeout`` flag (the budget ran out on this step and the task did not end it) for ``info["timeout"]``;
    * :meth:`_require_episode` in helpers that need a reset (walkthroughs, expert plans).

    ``close`` (the subclass's) calls :meth:`_no_episode`. Episode phase: ``None`` (no episode: never
    reset, reset failed, closed), ``True`` (running), ``False`` (over: done was returned).
    """

    name: str
    max_steps: int
    max_instances: int | None = None
    _num_tasks: dict[str, int]
    _steps: int = 0  # actions taken in the current episode
    _live: bool | None = None

    def num_tasks(self, split: str) -> int:
        return self._count_tasks(check_split(split))

    def _count_tasks(self, split: str) -> int:
        """Tasks in ``split`` (already checked); the default reads ``self._num_tasks``."""
        return self._num_tasks[split]

    def check_index(self, split: str, index: int) -> int:
        """``index`` itself, or a ValueError when it is not a task of ``split`` (or the split is unknown)."""
        n = self.num_tasks(split)
        if not 0 <= index < n:
            raise ValueError(f"task index {index} out of range for split {split!r} ({n} tasks)")
        return index

    @property
    def out_of_steps(self) -> bool:
        """Whether the current episode has used its whole step budget."""
        return self._steps >= self.max_steps

    def _reset_started(self) -> None:
        self._live = None

    def _episode_started(self) -> None:
        self._steps, self._live = 0, True

    def _no_episode(self) -> None:
        self._live = None

    def _require_episode(self, what: str) -> None:
        if self._live is None:
            raise RuntimeError(f"{type(self).__name__}.{what} called before reset")

    def _step_started(self) -> int:
        """Guards the reset/step order and counts the action; returns the step number (1-based)."""
        self._require_episode("step")
        if not self._live:
            raise RuntimeError(f"{type(self).__name__}.step called after the episode ended; call reset first")
        self._steps += 1
        return self._steps

    def _step_ended(self, ended: bool) -> bool:
        """Closes the step: the episode is over if ``ended`` (the task ended it: won, lost, submitted) or
        the budget ran out. Returns ``timeout``: the budget, not the task, ended it."""
        timeout = not ended and self.out_of_steps
        if ended or timeout:
            self._live = False
        return timeout

    @property
    def episode_over(self) -> bool:
        """True once a step returned ``done`` (until the next reset)."""
        return self._live is False


@dataclass(frozen=True)
class EnvFacts:
    """What the trainer must know of an env before any episode: its name, task counts and wave size."""

    name: str
    train_tasks: int
    test_tasks: int
    max_instances: int | None  # the class attribute (memory-heavy envs); None: no limit of its own


def env_facts(factory: Any) -> EnvFacts:
    """The :class:`EnvFacts` of the envs ``factory`` makes (a class or a ``functools.partial`` of one).

    ``max_instances`` is read from the class without building anything. Names and task counts depend on
    the constructor's arguments, so one instance is built and closed; no episode is started, and the
    envs here start their engines (a JVM, a game interpreter, a sandbox) at ``reset``, not at construction.
    A :class:`cope.envs.runtime.remote.RemoteEnv` is the exception: it asks its child interpreter."""
    cls = getattr(factory, "func", factory)
    limit = getattr(cls, "max_instances", None) if isinstance(cls, type) else None
    env = factory()
    try:
        if limit is None:
            limit = getattr(env, "max_instances", None)
        return EnvFacts(env.name, env.num_tasks("train"), env.num_tasks("test"), int(limit) if limit else None)
    finally:
        env.close()


def env_declares(factory: Any, attribute: str) -> tuple[bool, str]:
    """Whether the envs ``factory`` makes have ``attribute`` (an optional capability such as ``expert_action``), and
    their class name: looked up on the class when the factory is a class or a ``functools.partial`` of one (nothing
    built), else on one instance, built and closed (no episode started)."""
    cls = getattr(factory, "func", factory)
    if isinstance(cls, type):
        return hasattr(cls, attribute), cls.__name__
    probe = factory()
    try:
        return hasattr(probe, attribute), type(probe).__name__
    finally:
        probe.close()
