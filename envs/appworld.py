"""AppWorld (the real benchmark, PyPI ``appworld==0.1.3.post1``): an agent completes everyday tasks
for a "supervisor" by writing Python that calls the APIs of nine simulated apps (spotify, gmail,
venmo, amazon, ...); hidden tests on the final app databases decide success.

AppWorld pins pydantic 1, so it cannot live in the trainer's venv. It runs in its own venv, one
child process per env instance, through `cope.envs.runtime.remote.RemoteEnv` (:class:`RemoteAppWorldEnv`,
the ``env=appworld`` config); :class:`AppWorldEnv` is the in-process adapter that runs inside it::

    python3 -m venv .venv-appworld
    .venv-appworld/bin/pip install appworld==0.1.3.post1
    .venv-appworld/bin/appworld install            # unpacks the app code shipped in the package (offline)
    .venv-appworld/bin/pip install --no-deps -e .   # this project, so cope.envs imports there
    .venv-appworld/bin/appworld download data --root /path/to/appworld   # needs internet
    export APPWORLD_ROOT=/path/to/appworld          # or env.root=...

Tasks: the dataset files of the data folder (``data/datasets/<name>.txt``: ``train``, ``dev``,
``test_normal``, ``test_challenge``); our ``train`` split is ``train_dataset`` (default ``train``),
``test`` is ``test_dataset`` (default ``dev``), task ids in file order.

Actions: Python code, run by ``world.execute`` in the task's persistent IPython shell (a code fence
around it is dropped; indentation is kept). Observation: AppWorld's output (what the code printed,
``Execution successful.``, or ``Execution failed. Traceback: ...``). Invalid: an action that is not
encodable text (not run; `cope.envs.actions.unencodable`'s notice), an empty action (not run; harness
notice) and code whose execution failed (AppWorld's traceback is the observation).
The episode ends when the supervisor's task is marked complete (``apis.supervisor.complete_task``)
or after ``max_steps`` actions (``info["timeout"]``); then AppWorld's hidden tests run (``world.evaluate()``).
``success`` = all tests pass; ``score`` = fraction of tests passed. Reward at the end only:
``reward_mode=sparse`` pays 1.0 on success, ``pass_rate`` pays the score.

Native tool calls (``action_format=native``): one tool, ``python(code)`` (:data:`NATIVE_TOOLS`, also in
``EnvReset.info["tools"]``), called in the model's own format; the code is the argument as given. A turn without a
call, and a call the rollout loop refused, are invalid (not run; harness notice).

Each instance writes its AppWorld outputs under its own experiment name
(``<experiment_name>/<random id>``: episodes of one task run concurrently) and deletes them after
the evaluation unless ``keep_outputs``.
"""
from __future__ import annotations

import os
import re
import shutil
import sys
import textwrap
import uuid
from pathlib import Path

from cope.envs.actions import unencodable
from cope.envs.base import EnvReset, EnvStep, Task, TaskEnv
from cope.envs.runtime.remote import RemoteEnv
from cope.envs.tool_calls import check_action_format, function_tool, read_action, refusal_notice

DATASETS = ("train", "dev", "test_normal", "test_challenge")
REWARD_MODES = ("sparse", "pass_rate")
VENV_RECIPE = ("python3 -m venv .venv-appworld && .venv-appworld/bin/pip install appworld==0.1.3.post1 && "
               ".venv-appworld/bin/appworld install && .venv-appworld/bin/pip install --no-deps -e .")
DATA_RECIPE = ("on a machine with internet run `.venv-appworld/bin/appworld download data --root <dir>` and "
               "point APPWORLD_ROOT (or env.root) at <dir>")
INSTRUCTIONS = """You complete tasks for your supervisor by writing Python code that calls the APIs of everyday apps.
Each turn, answer with Python code only. It runs in a persistent Python shell; you see what it prints.
The apps' APIs are methods of the `apis` object: apis.<app_name>.<api_name>(...). Look them up with
print(apis.api_docs.show_app_descriptions())
print(apis.api_docs.show_api_descriptions(app_name='spotify'))
print(apis.api_docs.show_api_doc(app_name='spotify', api_name='login'))
Apps need a login first; your supervisor's passwords: apis.supervisor.show_account_passwords().
When the task is done, call apis.supervisor.complete_task() (with answer=... if the task asks a question).
That ends the episode."""
NATIVE_INSTRUCTIONS = INSTRUCTIONS.replace(
    "Each turn, answer with Python code only. It runs in a persistent Python shell; you see what it prints.",
    "Each turn, call the python tool with code. It runs in a persistent Python shell; you see what it prints.")
NATIVE_TOOLS = [function_tool("python", "Run Python code in the persistent shell (the `apis` object is defined); "
                              "returns what it prints.", {"code": {"type": "string"}}, ["code"])]
_FENCE = re.compile(r"^```[A-Za-z0-9_+-]*[ \t]*\n(.*?)\n?```$", re.DOTALL)


def strip_code(text: str) -> str:
    """The code in ``text``: surrounding blank lines, one Markdown code fence and a common indentation
    removed; relative indentation kept (unlike `cope.envs.actions.clean_action`, which strips lines)."""
    s = text.strip("\n").rstrip()
    if s.lstrip().startswith("```"):
        match = _FENCE.match(s.strip())
        if match:
            s = match.group(1)
    lines = s.split("\n")
    while lines and not lines[0].strip():
        lines.pop(0)
    return textwrap.dedent("\n".join(lines)).rstrip()


def _appworld():
    try:
        import appworld
        from appworld import AppWorld, load_task_ids
    except ImportError as e:
        raise ImportError(f"AppWorld is not installed in this interpreter ({sys.executable}). It pins pydantic 1, "
                          f"so it needs its own venv: {VENV_RECIPE}; then use env=appworld, which runs the env in "
                          "that venv (docs/envs/appworld.md)") from e
    try:
        _ = appworld.apps.api_docs
    except (AttributeError, ModuleNotFoundError) as e:
        raise ImportError("the appworld package is not fully installed: run `.venv-appworld/bin/appworld install` "
                          "(offline: it unpacks the app code shipped in the package)") from e
    return AppWorld, load_task_ids


class AppWorldEnv(TaskEnv):
    """AppWorld behind the `cope.envs.base.Env` protocol (runs where ``appworld`` is installed).

    Args:
        train_dataset: AppWorld dataset used as our ``train`` split.
        test_dataset: AppWorld dataset used as our ``test`` split.
        root: AppWorld root (the folder holding ``data/``); None: ``$APPWORLD_ROOT``, else the cwd.
        experiment_name: Prefix of the per-instance AppWorld experiment (output folder) name.
        max_steps: Actions per episode; the tests run after the last one.
        max_observation_chars: Cap on one observation; the cut is announced in the harness text.
        reward_mode: ``sparse`` (1.0 when all tests pass) or ``pass_rate`` (fraction passed).
        timeout_seconds: AppWorld's limit on one code execution.
        keep_outputs: Keep AppWorld's output folder (logs, final databases) after an episode.
        name: Env name used in task ids.
        action_format: ``text`` (code as the turn's text) or ``native`` (the ``python`` tool in the model's own
            tool-call format; needs a chat template with tool support).
    """

    # No fork capability (no fork(), no forks_by_replay): an action is arbitrary Python in a live shell, whose output
    # may show what differs from run to run (object addresses in reprs, unseeded random numbers, timings), and the
    # world lives in AppWorld's own process and files (no copy); branched rollouts refuse this env (and
    # RemoteAppWorldEnv, env=appworld) by name.

    def __init__(self, train_dataset: str = "train", test_dataset: str = "dev", root: str | None = None,
                 experiment_name: str = "cope", max_steps: int = 40, max_observation_chars: int = 6000,
                 reward_mode: str = "sparse", timeout_seconds: int = 100, keep_outputs: bool = False,
                 name: str = "appworld", action_format: str = "text") -> None:
        for arg, value in (("train_dataset", train_dataset), ("test_dataset", test_dataset)):
            if value not in DATASETS:
                raise ValueError(f"{arg} must be one of {DATASETS}, got {value!r}")
        if reward_mode not in REWARD_MODES:
            raise ValueError(f"reward_mode must be one of {REWARD_MODES}, got {reward_mode!r}")
        for arg, value in (("max_steps", max_steps), ("max_observation_chars", max_observation_chars),
                           ("timeout_seconds", timeout_seconds)):
            if value < 1:
                raise ValueError(f"{arg} must be >= 1, got {value!r}")
        if not experiment_name or not name:
            raise ValueError("experiment_name and name must be non-empty strings")
        self.action_format = check_action_format(action_format, "action_format")
        self.datasets = {"train": train_dataset, "test": test_dataset}
        self.root = os.path.abspath(root or os.environ.get("APPWORLD_ROOT") or os.getcwd())
        self.experiment = f"{experiment_name}/{uuid.uuid4().hex[:12]}"
        self.max_steps, self.max_observation_chars, self.reward_mode = max_steps, max_observation_chars, reward_mode
        self.timeout_seconds, self.keep_outputs, self.name = timeout_seconds, bool(keep_outputs), name
        self._ids: dict[str, list[str]] = {}
        self._world = None

    @property
    def instructions(self) -> str:
        return NATIVE_INSTRUCTIONS if self.action_format == "native" else INSTRUCTIONS

    @property
    def tools(self) -> list[dict] | None:
        """The ``python`` tool in the native format (None in the text format)."""
        return NATIVE_TOOLS if self.action_format == "native" else None

    def _task_ids(self, split: str) -> list[str]:
        if split not in self._ids:
            _, load_task_ids = _appworld()
            data = Path(self.root, "data")
            dataset = data / "datasets" / f"{self.datasets[split]}.txt"
            if not (data / "tasks").is_dir() or not dataset.is_file():
                raise FileNotFoundError(f"AppWorld data not found: no {dataset} or {data / 'tasks'} (APPWORLD_ROOT="
                                        f"{self.root}). The data is a separate download: {DATA_RECIPE}")
            os.environ["APPWORLD_ROOT"] = self.root  # appworld's path store reads it on every use
            self._ids[split] = load_task_ids(self.datasets[split])
        return self._ids[split]

    def _count_tasks(self, split: str) -> int:
        return len(self._task_ids(split))

    def example_actions(self) -> list[str]:
        """Well-formed code actions (format only) for the tiny model's random-walk warm start."""
        return ["print(apis.api_docs.show_app_descriptions())",
                "print(apis.api_docs.show_api_descriptions(app_name='supervisor'))",
                "print(apis.api_docs.show_api_doc(app_name='supervisor', api_name='show_profile'))",
                "print(apis.supervisor.show_profile())", "apis.supervisor.complete_task()"]

    def reset(self, task: Task) -> EnvReset:
        self._reset_started()
        task_id = self._task_ids(task.split)[self.check_index(task.split, task.index)]
        self._close_world()
        AppWorld, _ = _appworld()
        self._world = AppWorld(task_id=task_id, experiment_name=self.experiment, timeout_seconds=self.timeout_seconds)
        self._episode_started()
        t, s = self._world.task, self._world.task.supervisor
        observation = (f"Task: {t.instruction}\nSupervisor: {s.first_name} {s.last_name}, email {s.email}, "
                       f"phone {s.phone_number}")
        return EnvReset(observation=observation, task_description=t.instruction,
                        info={"task_id": t.id, "dataset": self.datasets[task.split],
                              **({"tools": NATIVE_TOOLS} if self.tools else {})})

    def step(self, action: str) -> EnvStep:
        self._step_started()
        refused = unencodable(action)
        if refused is None and self.action_format == "native":
            code, refused = native_code(action)
        else:
            code = "" if refused else strip_code(action)
        harness, valid = "", bool(code)
        if code:
            output = self._world.execute(code)
            valid = not output.startswith("Execution failed")
        else:
            output, harness = "", refused or "Invalid action: empty. Answer with Python code to run."
        if len(output) > self.max_observation_chars:
            harness = f"[observation truncated: first {self.max_observation_chars} of {len(output)} characters shown]"
            output = output[: self.max_observation_chars]
        completed = self._world.task_completed()
        timeout = self._step_ended(completed)
        done = self.episode_over
        success, score, info = False, 0.0, {"completed": completed, "timeout": timeout}
        if done:
            tracker = self._world.evaluate()
            success = bool(tracker.success)
            score = tracker.pass_count / tracker.num_tests if tracker.num_tests else float(success)
            info.update(pass_count=tracker.pass_count, num_tests=tracker.num_tests)
            self._close_world()
        reward = (1.0 if success else 0.0) if self.reward_mode == "sparse" else score
        return EnvStep(observation=output, reward=reward if done else 0.0, done=done, valid=valid,
                       success=success, score=score, harness=harness, info=info)

    def close(self) -> None:
        self._no_episode()
        self._close_world()

    def _close_world(self) -> None:
        world, self._world = self._world, None
        if world is None:
            return
        try:
            world.close()
        finally:
            if not self.keep_outputs:
                shutil.rmtree(Path(self.root, "experiments", "outputs", self.experiment), ignore_errors=True)


def native_code(action: str) -> tuple[str, str | None]:
    """``(code, refused)`` of a native-format action: the ``python`` call's code, or the harness text of a refusal."""
    a = read_action(action)
    if a.kind == "call" and a.name == "python" and isinstance(a.arguments.get("code"), str):
        return a.arguments["code"].strip("\n").rstrip(), None
    if a.kind == "message":
        return "", "Invalid action: call the python tool with code to run."
    return "", refusal_notice(a.text if a.kind == "refused" else f"unknown tool {a.name!r} or bad arguments")


def _find_python(python: str) -> str:
    """``python`` as given, else relative to the project root; a clear error with the venv recipe."""
    for candidate in (Path(python), Path(__file__).resolve().parents[1] / python):
        if candidate.exists():
            return str(candidate)
    raise FileNotFoundError(f"the AppWorld interpreter {python!r} does not exist. Create its venv first: {VENV_RECIPE}")


class RemoteAppWorldEnv(RemoteEnv):
    """:class:`AppWorldEnv` in a child process of the AppWorld venv's interpreter (``env=appworld``).

    Args:
        python: Interpreter of the AppWorld venv; a relative path is tried from the cwd, then from
            the project root.
        timeout_s: Deadline of one reset or step (AppWorld's own code timeout is ``timeout_seconds``).
        start_timeout_s: Deadline of the child's start (imports, first task list).
        Other args: as :class:`AppWorldEnv`.
    """

    # No fork capability, as AppWorldEnv (see there): branched rollouts refuse env=appworld by name.

    def __init__(self, python: str = ".venv-appworld/bin/python", train_dataset: str = "train",
                 test_dataset: str = "dev", root: str | None = None, experiment_name: str = "cope",
                 max_steps: int = 40, max_observation_chars: int = 6000, reward_mode: str = "sparse",
                 timeout_seconds: int = 100, keep_outputs: bool = False, name: str = "appworld",
                 timeout_s: float = 300.0, start_timeout_s: float = 600.0, action_format: str = "text") -> None:
        kwargs = {"action_format": action_format, "train_dataset": train_dataset, "test_dataset": test_dataset,
                  "root": os.path.abspath(root) if root else None, "experiment_name": experiment_name,
                  "max_steps": max_steps, "max_observation_chars": max_observation_chars, "reward_mode": reward_mode,
                  "timeout_seconds": timeout_seconds, "keep_outputs": keep_outputs, "name": name}
        AppWorldEnv(**kwargs)  # argument errors surface here, as a ValueError, before a child starts
        super().__init__(target="cope.envs.appworld.AppWorldEnv", kwargs=kwargs, python=_find_python(python),
                         timeout_s=timeout_s, start_timeout_s=start_timeout_s)
