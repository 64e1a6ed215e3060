"""Terminal tasks: an agent solves small shell tasks with bash commands in a bubblewrap sandbox.

A self-made, TerminalBench-*style* suite (not TerminalBench itself, which needs Docker): seeded task
families over files, text processing, small scripts and git (:mod:`cope.envs.terminal.tasks`). Each
command runs in a fresh sandbox (:mod:`cope.envs.terminal.sandbox`: no network, no host files, capped time,
memory, processes and disk) on the episode's work dir ``/work``, which persists from command to
command as an archive; nothing else persists (each command starts in ``/work`` with a fresh shell).

Actions: one shell command line, or a short multi-line bash script, run with ``bash -c``. Model noise is
removed first: a surrounding code fence (```` ```bash ````), single backticks around the whole
action, an ``Action:``/``Command:`` label, a ``$ `` prompt. Unlike :func:`~cope.envs.actions.clean_action`,
inner spaces and quotes are kept (they mean something to bash); ``clean_action`` decides only whether
the action is the finishing word ``submit`` (any case, quotes, trailing period).

Validity: an empty action, one longer than ``max_command_chars``, one that no program argument can
hold (a NUL byte, an unpaired surrogate: byte-level tokenizers emit them; not run), a bash syntax error
(the command is parsed first and then not run), exit code 127 (command not found; the earlier parts of
a command list may have run) and a command whose sandbox report or archive is refused as forged or
malformed (``info["sandbox_rejected"]``; its result is discarded) are invalid (``valid=False``, a harness
notice). Any other exit code is a valid action whose feedback is its output. ``submit`` is valid.

Success and reward (sparse): the task's checker runs on the work dir at ``submit`` and, when the agent
never submits, after the ``max_steps``-th action (``info["timeout"]`` when that check fails); either ends
the episode. ``success`` is the checker's verdict; ``reward`` = ``score`` = 1.0 on that final step when it
passes, else 0.0.

Observation vs harness: the observation is what the shell printed (stdout and stderr interleaved,
at most ``max_output_chars`` characters) followed by ``[exit code N]``; at ``submit`` it is the env's
verdict line. Harness text (never an ECHO target): truncation, time-out, invalid-action and step-limit
notices. Reset observation: the instruction and the top-level entries of ``/work``.

Native tool calls (``action_format=native``): two tools, ``bash(command)`` and ``submit()``
(:data:`NATIVE_TOOLS`, also in ``EnvReset.info["tools"]``), called in the model's own format; the command is the
argument as given (no clean-up: JSON leaves no noise to strip), a turn without a call is invalid, a call the rollout
loop refused (malformed, unknown tool, bad arguments) is invalid with its reason as harness text. Validity, output and
rewards are the same as in the text format.
"""
from __future__ import annotations

import os
import random
import re
import shutil

from cope.envs.actions import clean_action, unencodable
from cope.envs.base import EnvReset, EnvStep, Task, TaskEnv
from cope.envs.terminal import tasks as suite
from cope.envs.terminal.sandbox import Sandbox, SandboxResult, unavailable_reason, unpassable
from cope.envs.terminal.tasks import TerminalTask, make_task
from cope.envs.terminal.workdir import Snapshot, add_files, pack
from cope.envs.tool_calls import check_action_format, function_tool, read_action, refusal_notice

INSTRUCTIONS = (
    "You are in a Linux bash shell in the directory /work. Solve the task with shell commands. Each turn, answer "
    "with one command (or a short bash script); you will see its output and exit code. Every command starts in "
    "/work with a fresh shell: only files persist. There is no network. When the task is done, answer: submit"
)
NATIVE_INSTRUCTIONS = (
    "You are in a Linux bash shell in the directory /work. Solve the task with the bash tool: each call runs one "
    "command (or a short bash script) and shows its output and exit code. Every command starts in /work with a fresh "
    "shell: only files persist. There is no network. When the task is done, call submit."
)
NATIVE_TOOLS = [
    function_tool("bash", "Run a bash command (or a short script) in /work; returns its output and exit code.",
                  {"command": {"type": "string", "description": "The command line or script."}}, ["command"]),
    function_tool("submit", "Submit the work dir: the task is checked and the episode ends."),
]
HARNESS_NO_CALL = "[Invalid action: call a tool (bash or submit).]"
SUBMIT = "submit"
SOLVED, NOT_SOLVED = "Submitted: the task is solved.", "Submitted: the task is not solved."
HARNESS_EMPTY = "[Invalid action: empty. Answer with a shell command, or submit when done.]"
HARNESS_SYNTAX = "[Invalid action: bash syntax error; the command was not run.]"
HARNESS_NOT_FOUND = "[Invalid action: command not found (exit code 127).]"
HARNESS_STEP_LIMIT = "[Step limit reached: the task was checked.]"
_LABEL = re.compile(r"^(?:action|command|cmd)\s*:\s*", re.IGNORECASE)
_LANG = re.compile(r"[A-Za-z0-9_+-]*")


def parse_command(text: str) -> str:
    """The shell command in an action, with model noise removed (see the module docstring)."""
    s = text.strip()
    if s.startswith("```") and s.endswith("```") and len(s) >= 6:
        s = s[3:-3]
        first, _, rest = s.partition("\n")
        if rest and _LANG.fullmatch(first.strip()):
            s = rest
    elif len(s) >= 2 and s[0] == s[-1] == "`" and "`" not in s[1:-1]:
        s = s[1:-1]
    s = _LABEL.sub("", s.strip(), count=1)
    return s.removeprefix("$ ").strip()


def program_available(name: str) -> bool:
    """Whether ``name`` exists inside the sandbox (on its PATH, resolving into the bound directories)."""
    found = shutil.which(name, path="/usr/local/bin:/usr/bin:/bin")
    return found is not None and os.path.realpath(found).startswith(("/usr/", "/bin/", "/lib/"))


class TerminalEnv(TaskEnv):
    """Seeded shell tasks in a bubblewrap sandbox behind the `cope.envs.base.Env` protocol.

    Args:
        name: Env name used in task ids.
        max_steps: Actions per episode; the task is checked after the last one.
        num_train_tasks: Tasks in the train split (index -> family ``index % F``, content seeded by index).
        num_test_tasks: Tasks in the test split (same families, other seeds).
        families: Family names to use (None: every family whose programs exist here, e.g. git).
        held_out_families: Families used only by the test split (train uses the others): a held-out-family
            evaluation. None: both splits use every family (with disjoint seeds).
        timeout_s: Wall-time limit of one command.
        memory_mb: Address-space limit per process.
        max_processes: Processes a command may have at once.
        work_size_mb: Size cap of the work dir.
        tmp_size_mb: Size cap of ``/tmp`` (fresh for each command).
        max_output_chars: Output characters shown per command (the rest is cut with a harness notice).
        max_command_chars: Longest accepted action.
        host_uid: Host uid for the sandboxes when running as root (None: automatic); see :class:`Sandbox`.
        bwrap: The bubblewrap executable.
        action_format: ``text`` (a command per turn) or ``native`` (the ``bash``/``submit`` tools in the model's own
            tool-call format; needs a chat template with tool support).
    """

    # No fork capability (no fork(), no forks_by_replay): what a command prints may hold the wall clock (date, the
    # mtimes of the files it makes, kept in the work dir), randomness ($RANDOM, mktemp, /dev/urandom) or a race with
    # timeout_s, so a replay of the same commands need not say the same; branched rollouts refuse this env by name.

    def __init__(self, name: str = "terminal", max_steps: int = 10, num_train_tasks: int = 10_000,
                 num_test_tasks: int = 500, families: list[str] | None = None,
                 held_out_families: list[str] | None = None, timeout_s: float = 10.0,
                 memory_mb: int = 1024, max_processes: int = 64, work_size_mb: int = 32, tmp_size_mb: int = 16,
                 max_output_chars: int = 2000, max_command_chars: int = 2000, host_uid: int | None = None,
                 bwrap: str = "bwrap", action_format: str = "text") -> None:
        if not name:
            raise ValueError("name must be a non-empty string")
        for arg, value in (("max_steps", max_steps), ("num_train_tasks", num_train_tasks),
                           ("num_test_tasks", num_test_tasks), ("max_output_chars", max_output_chars),
                           ("max_command_chars", max_command_chars)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{arg} must be an int >= 1, got {value!r}")
        if max_command_chars > 100_000:  # one argv string of the sandbox: keep far below the kernel's 128 KiB
            raise ValueError(f"max_command_chars must be <= 100000, got {max_command_chars!r}")
        known = suite.families()
        for arg, chosen in (("families", families), ("held_out_families", held_out_families)):
            unknown = [f for f in chosen or () if f not in known]
            if chosen is not None and (not list(chosen) or unknown):
                raise ValueError(f"{arg} must be a non-empty list of known families, unknown: {unknown}; "
                                 f"known: {sorted(known)}")
        pool = list(families or known)
        if held_out_families is not None and not [f for f in pool if f not in held_out_families]:
            raise ValueError("held_out_families leaves no family for the train split")
        if held_out_families is not None and not [f for f in pool if f in held_out_families]:
            raise ValueError("held_out_families must be among families")
        self.name, self.max_steps = name, max_steps
        self.action_format = check_action_format(action_format, "action_format")
        self.families = None if families is None else list(families)
        self.held_out_families = None if held_out_families is None else list(held_out_families)
        self.max_output_chars, self.max_command_chars = max_output_chars, max_command_chars
        self._num_tasks = {"train": num_train_tasks, "test": num_test_tasks}
        self.sandbox = Sandbox(timeout_s=timeout_s, memory_mb=memory_mb, max_processes=max_processes,
                               work_size_mb=work_size_mb, tmp_size_mb=tmp_size_mb,
                               max_output_bytes=4 * max_output_chars + 16, host_uid=host_uid, bwrap=bwrap)
        self._active: dict[str, list[str]] = {}
        self._task: TerminalTask | None = None
        self._state = b""

    @property
    def instructions(self) -> str:
        return NATIVE_INSTRUCTIONS if self.action_format == "native" else INSTRUCTIONS

    @property
    def tools(self) -> list[dict] | None:
        """``bash`` and ``submit`` in the native format (None in the text format)."""
        return NATIVE_TOOLS if self.action_format == "native" else None

    def active_families(self, split: str = "train") -> list[str]:
        """The families a split's tasks come from: the chosen ones (minus or only the held-out ones) whose
        programs exist in the sandbox."""
        if split not in self._active:
            table = suite.families()
            chosen = self.families or list(table)
            if self.held_out_families is not None:
                chosen = [f for f in chosen if (f in self.held_out_families) == (split == "test")]
            active = [f for f in chosen if all(program_available(p) for p in _needs(table[f]))]
            if not active:
                raise RuntimeError(f"no terminal task family can run here (families={chosen}); install git/python3")
            self._active[split] = active
        return self._active[split]

    def task(self, split: str, index: int) -> TerminalTask:
        """The task behind ``(split, index)``; the same pair always gives the same task."""
        self.check_index(split, index)
        active = self.active_families(split)
        return make_task(active[index % len(active)], split, index)

    def reset(self, task: Task) -> EnvReset:
        self._reset_started()
        t = self.task(task.split, task.index)
        reason = unavailable_reason(self.sandbox.bwrap)
        if reason is not None:
            raise RuntimeError(f"the terminal env needs a working bubblewrap sandbox: {reason}")
        state = pack(t.files, t.modes, t.dirs)
        if t.setup:
            res = self.sandbox.run("set -e\n" + "\n".join(f"( {c} )" for c in t.setup), state)
            if res.exit_code != 0 or res.state is None:
                raise RuntimeError(f"setup of {task.id} failed ({res.exit_code}, {res.error}): {res.output[-500:]}")
            state = res.state
        self._task, self._state = t, state
        self._episode_started()
        snap = Snapshot(state)
        entries = [n + "/" if snap.is_dir(n) else n for n in snap.listdir()]
        listing = f"Files in /work: {', '.join(entries)}." if entries else "The directory /work is empty."
        return EnvReset(observation=f"{t.instruction}\n{listing}", task_description=t.instruction,
                        info={"family": t.family, **({"tools": NATIVE_TOOLS} if self.tools else {})})

    def step(self, action: str) -> EnvStep:
        self._step_started()
        refused = unencodable(action)
        command, submit, problem = self._command(action) if refused is None else ("", False, None)
        refused = refused or problem
        info: dict = {"exit_code": None, "timed_out": False, "timeout": False}
        if refused is None and submit is True:
            success = self._check(info)
            self._step_ended(True)
            return self._end(SOLVED if success else NOT_SOLVED, "", True, success, info)
        if refused:
            observation, harness, valid = "", [refused], False
        elif not command:
            observation, harness, valid = "", [HARNESS_EMPTY], False
        elif len(command) > self.max_command_chars:
            observation, valid = "", False
            harness = [f"[Invalid action: longer than {self.max_command_chars} characters; not run.]"]
        elif (problem := unpassable(command)) is not None:
            observation, harness, valid = "", [f"[Invalid action: {problem}; not run.]"], False
        else:
            res = self.sandbox.run(command, self._state)
            observation, harness, valid = self._feedback(res, info)
        if self.out_of_steps:  # the last action: the task is checked as if submitted
            success = self._check(info)
            info["timeout"] = self._step_ended(success)
            return self._end(observation, "\n".join([*harness, HARNESS_STEP_LIMIT]), valid, success, info)
        self._step_ended(False)
        return EnvStep(observation=observation, reward=0.0, done=False, valid=valid, success=False, score=0.0,
                       harness="\n".join(harness), info=info)

    def _command(self, action: str) -> tuple[str, bool, str | None]:
        """``(command, submit, refused)`` of an action: ``refused`` is the harness text of an action refused
        before it ran (native format: a turn without a call, a call the rollout loop refused)."""
        if self.action_format != "native":
            command = parse_command(action)
            return command, clean_action(command, lower=True) == SUBMIT, None
        a = read_action(action)
        if a.kind != "call":
            return "", False, HARNESS_NO_CALL if a.kind == "message" else refusal_notice(a.text)
        if a.name == SUBMIT:
            return "", True, None
        if a.name == "bash" and isinstance(a.arguments.get("command"), str):
            return a.arguments["command"].strip(), False, None
        return "", False, refusal_notice(f"unknown tool {a.name!r} or bad arguments")

    def _feedback(self, res: SandboxResult, info: dict) -> tuple[str, list[str], bool]:
        if res.error and res.state is None and res.exit_code is None and not res.timed_out:
            raise RuntimeError(f"the sandbox failed: {res.error}")
        info.update(exit_code=res.exit_code, timed_out=res.timed_out, seconds=res.seconds, output_bytes=res.output_bytes)
        if res.rejected:  # what came back could only have been made by tampering with the sandbox's pid 1
            info["sandbox_rejected"] = res.rejected
            notice = (f"[Invalid action: what the sandbox returned was refused ({res.rejected}); the result is "
                      "discarded and the work dir is as it was before this command.]")
            return "", [notice], False
        harness: list[str] = []
        text = res.output
        if len(text) > self.max_output_chars or res.output_bytes > self.sandbox.max_output_bytes:
            text = text[:self.max_output_chars]
            harness.append(f"[Output truncated to its first {len(text)} characters; the command wrote "
                           f"{res.output_bytes} bytes.]")
        if text and not text.endswith("\n"):
            text += "\n"
        if res.timed_out:
            harness.append(f"[The command timed out after {self.sandbox.timeout_s:g} s and was killed.]")
        else:
            text += f"[exit code {res.exit_code}]"
        if res.state is not None:
            self._state = res.state
        else:
            info["workdir_error"] = res.error
            harness.append(f"[The work dir could not be saved ({res.error or 'too large?'}); it is as it was "
                           "before this command.]")
        valid = not res.syntax_error and res.exit_code != 127
        if res.syntax_error:
            harness.append(HARNESS_SYNTAX)
        elif res.exit_code == 127:
            harness.append(HARNESS_NOT_FOUND)
        return text, harness, valid

    def _check(self, info: dict) -> bool:
        """The task's checker on the current work dir (False when it raises)."""
        state = self._state

        def run(command: str, files=None) -> tuple[int | None, str]:
            res = self.sandbox.run(command, add_files(state, files) if files else state)
            return res.exit_code, res.output

        try:
            return bool(self._task.check(Snapshot(state), run))
        except Exception as exc:  # noqa: BLE001 -- a checker bug or an odd work dir counts as not solved
            info["check_error"] = repr(exc)
            return False

    def _end(self, observation: str, harness: str, valid: bool, success: bool, info: dict) -> EnvStep:
        reward = 1.0 if success else 0.0
        return EnvStep(observation=observation, reward=reward, done=True, valid=valid, success=success, score=reward,
                       harness=harness, info={**info, "checked": True})

    def example_actions(self) -> list[str]:
        """A few well-formed commands for the current work dir (the tiny model's warm start)."""
        files = Snapshot(self._state).files() if self._state else []
        actions = ["ls", "ls -la", "pwd"]
        for f in files[:2]:
            actions += [f"cat {f}", f"wc -l {f}", f"head -n 3 {f}"]
        return actions + [SUBMIT]

    def reference_solution(self) -> list[str]:
        """The current task's reference commands followed by ``submit`` (tests and benchmarks)."""
        self._require_episode("reference_solution")
        return [*self._task.solution, SUBMIT]

    def close(self) -> None:
        self._task, self._state = None, b""
        self._no_episode()


def _needs(family) -> tuple[str, ...]:
    """The programs a family needs (from one sample task; needs do not depend on the seed)."""
    return family(random.Random(0)).needs
