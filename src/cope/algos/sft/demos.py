"""Where SFT's demonstrations come from, checked before any work (``sft.source``).

* ``expert``: the env's own expert, the optional ``expert_action()`` of :class:`cope.envs.base.Env` (the maze's
  shortest path; TextWorld's walkthrough, ALFWorld's expert plan, ScienceWorld's gold path). An env without it is
  refused by name from the class the factory makes (:func:`check_expert`), so no env is started for the check.
* ``file``: a ``trajectories.jsonl`` of this trainer (:func:`read_trajectories`), e.g. the successful episodes of a
  stronger run (rejection-sampling fine-tuning). Two row shapes are read, one per line, mixed freely:

  - a *turn row*, as training writes them (:mod:`cope.callbacks.trajectory_table`): ``epoch``, ``task``,
    ``episode``, ``step``, ``action`` (other keys, such as ``valid``, ``reward``, ``observation``, are ignored).
    An episode is the rows of one ``(epoch, episode)`` whose ``step`` runs 0, 1, 2, ... in file order; a ``step``
    0 starts a new one (files of several runs may be concatenated);
  - an *episode row*, as ``eval.py`` writes them (:mod:`cope.run.evaluate`): ``task`` and ``turns``, a non-empty
    list of objects with an ``action``.

  A task id (``<env>/<split>/<index>``, :attr:`cope.envs.base.Task.id`) maps back to the Task of that env, split and
  index: the env must be the run's (``env.name``), the split the one training draws from (``data.train_split``:
  a demonstration of a held-out task would train on the validation panel), the index inside it. Bad input fails
  before any model is built, naming ``sft.path`` and the line: a missing or empty file, a line that is not UTF-8
  text or not a JSON object, a row without a key its shape needs, an unknown task, an action that is not a string, a
  step out of order.

  Which episodes are kept (:func:`replay_outcome`): each is replayed through a fresh env episode on its actions
  alone (no model, before training): it must end exactly at its last action (an episode cut short, by the context
  or another step budget, or one the env ends earlier, is dropped as not replayable) and, with ``sft.keep=success``
  (the default), succeed: the env's verdict on the replay, not a flag of the file (turn rows carry none). One whose
  replay raised is kept and judged when drawn (:func:`select_demos`).
"""
from __future__ import annotations

import functools
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from cope.envs.base import Env, Task, env_declares

log = logging.getLogger(__name__)

SOURCES = ("expert", "file")
KEEP = ("success", "all")
TURN_KEYS = ("epoch", "task", "episode", "step", "action")
EPISODE_KEYS = ("task", "turns")


@dataclass(frozen=True)
class Demo:
    """One demonstration read from a file: its task, its actions in order, and where it starts (``path:line``)."""

    task: Task
    actions: tuple[str, ...]
    where: str


def env_class(env_factory: Callable[[], Env]) -> type | None:
    """The class an env factory makes (a class, or a ``functools.partial`` of one, as Hydra's ``_partial_`` gives);
    None when the factory is something else."""
    target = env_factory.func if isinstance(env_factory, functools.partial) else env_factory
    return target if isinstance(target, type) else None


def check_expert(env_factory: Callable[[], Env], key: str = "sft.source") -> None:
    """Refuses ``sft.source=expert`` for an env without ``expert_action()`` (ValueError naming the env and the key),
    looked up on the class the factory makes; only a factory that is no class is probed (built and closed, no
    episode started)."""
    has, name = env_declares(env_factory, "expert_action")
    if not has:
        raise ValueError(f"{key}=expert needs an env with an expert_action() method (the optional expert of "
                         f"cope.envs.base.Env: maze, textworld, alfworld, scienceworld); {name} has none: give "
                         f"demonstrations as a file instead ({key}=file sft.path=<trajectories.jsonl>)")


def parse_task(text: Any, env_name: str, split: str, num_tasks: int) -> Task:
    """The Task of a task id ``<env>/<split>/<index>``; ValueError (without the line) when it is not one of this
    run's training tasks."""
    parts = text.rsplit("/", 2) if isinstance(text, str) else []
    if len(parts) != 3 or not parts[2].isdigit():
        raise ValueError(f"unknown task {text!r}: a task id is <env>/<split>/<index>, e.g. {env_name}/{split}/0")
    name, task_split, index = parts[0], parts[1], int(parts[2])
    if name != env_name:
        raise ValueError(f"unknown task {text!r}: this run's env is {env_name!r} (env.name)")
    if task_split != split:
        raise ValueError(f"unknown task {text!r}: training draws from the {split!r} split (data.train_split); "
                         f"demonstrations of other tasks would train on the held-out panel")
    if not 0 <= index < num_tasks:
        raise ValueError(f"unknown task {text!r}: the {split!r} split of {env_name} has tasks 0..{num_tasks - 1}")
    return Task(env_name, split, index)


def read_trajectories(path: str | Path, env_name: str, split: str, num_tasks: int, key: str = "sft.path") -> list[Demo]:
    """Every episode of a ``trajectories.jsonl`` (both row shapes, see the module docstring), in file order.

    Args:
        path: the file.
        env_name, split, num_tasks: the run's env name, training split and its task count (task ids are checked).
        key: the config key named in errors.

    Raises:
        FileNotFoundError: no such file. ValueError: ``<key>=<path>: line <n>: <what>`` for the first bad line, or
            an empty file.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{key}={str(path)!r}: no such file (a trajectories.jsonl of a training or eval.py run)")
    demos: list[tuple[Task, list[str], str]] = []
    open_episodes: dict[tuple[Any, Any], int] = {}  # (epoch, episode) of turn rows -> its index in demos
    with path.open("rb") as f:  # bytes, decoded per line: a bad byte is named by its line
        for n, raw in enumerate(f, 1):
            try:
                line = _decode(raw)
                if not line.strip():
                    continue
                _read_row(line, f"{path}:{n}", demos, open_episodes, env_name, split, num_tasks)
            except ValueError as e:
                raise ValueError(f"{key}={str(path)!r}: line {n}: {e}") from None
    if not demos:
        raise ValueError(f"{key}={str(path)!r}: the file is empty (no demonstration rows)")
    return [Demo(task, tuple(actions), where) for task, actions, where in demos]


def _read_row(line: str, where: str, demos: list, open_episodes: dict, env_name: str, split: str,
              num_tasks: int) -> None:
    """Adds one line's row to ``demos`` (a new episode, or the next turn of an open one); ValueError on bad input."""
    try:
        row = json.loads(line)
    except json.JSONDecodeError as e:
        raise ValueError(f"not valid JSON ({e.msg} at column {e.colno})") from None
    if not isinstance(row, dict):
        raise ValueError(f"not a JSON object but {type(row).__name__}")
    shape, needed = ("an episode row", EPISODE_KEYS) if "turns" in row else ("a turn row", TURN_KEYS)
    missing = [k for k in needed if k not in row]
    if missing:
        raise ValueError(f"missing key(s) {', '.join(map(repr, missing))} ({shape} needs {', '.join(needed)}; "
                         f"an episode row has 'turns')")
    task = parse_task(row["task"], env_name, split, num_tasks)
    if shape == "an episode row":
        turns = row["turns"]
        if not isinstance(turns, list) or not turns or not all(isinstance(t, dict) and "action" in t for t in turns):
            raise ValueError("'turns' must be a non-empty list of objects with an 'action'")
        demos.append((task, [_action(t["action"]) for t in turns], where))
        return
    ep, step = (_hashable(row["epoch"]), _hashable(row["episode"])), row["step"]
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise ValueError(f"'step' must be an int >= 0, got {step!r}")
    if step == 0:
        open_episodes[ep] = len(demos)
        demos.append((task, [_action(row["action"])], where))
        return
    i = open_episodes.get(ep)
    have = len(demos[i][1]) if i is not None else 0
    if i is None or step != have:
        raise ValueError(f"step {step} of (epoch {row['epoch']!r}, episode {row['episode']!r}) follows "
                         f"{'no step 0' if i is None else f'step {have - 1}'} (steps run 0, 1, 2, ... in file order)")
    if demos[i][0] != task:
        raise ValueError(f"task {task.id!r} in (epoch {row['epoch']!r}, episode {row['episode']!r}), "
                         f"whose step 0 was {demos[i][0].id!r}")
    demos[i][1].append(_action(row["action"]))


def _decode(raw: bytes) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"not UTF-8 text ({e.reason}: byte {raw[e.start]:#04x} at byte {e.start + 1} of the line)") from None


def _action(value: Any) -> str:
    if not isinstance(value, str):
        raise ValueError(f"'action' must be a string, got {value!r}")
    return value


def _hashable(value: Any) -> Any:
    return json.dumps(value, sort_keys=True) if isinstance(value, (list, dict)) else value


def replay_outcome(env: Env, demo: Demo) -> str:
    """Replays ``demo``'s actions through ``env`` (one episode, no model) and says what happened: ``success``,
    ``failure`` (ended exactly at its last action, not a success), ``cut`` (the env goes on after the last action: the
    recorded episode was cut short), ``early`` (the env ended before the last action) or ``error`` (the env raised)."""
    try:
        env.reset(demo.task)
        for i, action in enumerate(demo.actions):
            out = env.step(action)
            if out.done:
                return ("success" if out.success else "failure") if i == len(demo.actions) - 1 else "early"
        return "cut"
    except Exception as e:  # noqa: BLE001 - an env error drops that demonstration, never the run
        log.warning("replaying the demonstration at %s raised %r: dropped", demo.where, e)
        return "error"


def select_demos(demos: list[Demo], env_factory: Callable[[], Env], keep: str,
                 key: str = "sft.path") -> tuple[list[Demo], dict[str, int]]:
    """The demonstrations kept (:func:`replay_outcome` ``success``, and ``failure`` too with ``keep="all"``) and
    how many of each outcome there were; ValueError naming ``key`` and ``sft.keep`` when none replays to a kept outcome.

    A demonstration whose replay raised (``error``) is kept too: whether it succeeds is left to the epochs that draw
    it, which replay it again and skip it as ``broken`` if the env raises again. An env error is no property of the
    demonstration: dropping it here would make the kept list, so the draws and the resume fingerprint, depend on a
    transient failure (a resume refused; under DDP, ranks drawing from different lists)."""
    env = env_factory()
    try:
        outcomes = [replay_outcome(env, d) for d in demos]
    finally:
        env.close()
    counts = {o: outcomes.count(o) for o in ("success", "failure", "cut", "early", "error")}
    wanted = ("success",) if keep == "success" else ("success", "failure")
    kept = [d for d, o in zip(demos, outcomes) if o in wanted or o == "error"]
    log.info("%s: %d episodes read, %d kept (sft.keep=%s; %d whose replay raised, retried when drawn); replayed: %s",
             key, len(demos), len(kept), keep, counts["error"], counts)
    if not any(o in wanted for o in outcomes):
        raise ValueError(f"{key}: none of its {len(demos)} episodes is kept with sft.keep={keep} (replayed through "
                         f"the env: {counts}; 'cut': the episode goes on after its last recorded action)")
    return kept, counts
