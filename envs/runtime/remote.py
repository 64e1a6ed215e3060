"""One env in another Python process (``RemoteEnv``): for envs whose dependencies cannot live in the
trainer's environment (AppWorld pins pydantic 1) or that should be isolated from it.

``RemoteEnv`` implements the Env protocol by forwarding every call to a child
``python -m cope.envs.runtime.worker`` started with ``python`` (default: this interpreter). The child builds
the real env from ``target`` (``module.Class``) and ``kwargs``, which must be plain data. The other
interpreter needs the project itself, without its dependencies::

    python3 -m venv .venv-other && .venv-other/bin/pip install --no-deps -e . && .venv-other/bin/pip install <env package>

Every call has a deadline (``timeout_s``); a child that dies or hangs raises
:class:`cope.envs.runtime.worker.WorkerFailure`, which the rollout engine treats like any env error (the
episode is aborted and counted); the next ``reset`` starts a fresh child.

Config (``_partial_``: the trainer makes one instance per episode)::

    _target_: cope.envs.runtime.remote.RemoteEnv
    _partial_: true
    python: .venv-appworld/bin/python
    target: cope.envs.appworld.AppWorldEnv
    kwargs: {split_train: train}
"""
from __future__ import annotations

import functools
import importlib
import os
from typing import Any

from cope.envs.base import EnvReset, EnvStep, Task
from cope.envs.runtime.worker import WorkerFailure, WorkerProcess


def build(target: str, kwargs: dict[str, Any]):
    """The env named by ``target`` (``package.module.Class``) built with ``kwargs`` (runs in the child)."""
    module, _, name = target.rpartition(".")
    if not module:
        raise ValueError(f"target must be 'module.Class', got {target!r}")
    return getattr(importlib.import_module(module), name)(**kwargs)


def plain(x: Any) -> Any:
    """Config containers (OmegaConf) as plain dicts/lists, so another interpreter can unpickle them."""
    if hasattr(x, "items"):
        return {str(k): plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)) or type(x).__name__ == "ListConfig":
        return [plain(v) for v in x]
    return x


class RemoteEnv:
    """Forwards the Env protocol to ``target(**kwargs)`` living in a child process of ``python``.

    Args:
        target: dotted path of the env class, importable in the child's interpreter.
        kwargs: constructor arguments (plain data).
        python: the child's interpreter; relative paths are taken from the current directory.
        timeout_s: deadline of one reset or step.
        start_timeout_s: deadline of the first call (interpreter start, imports, env construction).
        env_vars: extra environment variables for the child.
    """

    def __init__(self, target: str, kwargs: dict[str, Any] | None = None, python: str | None = None,
                 timeout_s: float = 120.0, start_timeout_s: float = 300.0, env_vars: dict[str, str] | None = None):
        if timeout_s <= 0 or start_timeout_s <= 0:
            raise ValueError("timeout_s and start_timeout_s must be > 0")
        if python is not None and not os.path.exists(python):
            raise FileNotFoundError(f"RemoteEnv python={python!r} does not exist (create that venv first; see the env's docs)")
        self.target, self.kwargs, self.python = target, plain(kwargs or {}), python
        self.timeout_s, self.start_timeout_s, self.env_vars = timeout_s, start_timeout_s, plain(env_vars or {})
        self._worker: WorkerProcess | None = None
        try:
            info = self._call("describe", None, start_timeout_s)
        except BaseException:
            self.close()  # do not leave the child running until garbage collection
            raise
        self.name, self.max_steps = info["name"], info["max_steps"]
        self._instructions, self._num_tasks = info["instructions"], info["num_tasks"]
        self._has_examples = info["has_example_actions"]

    def _start(self) -> WorkerProcess:
        w = WorkerProcess(self.python, self.env_vars)
        w.send("make", 0, functools.partial(build, self.target, self.kwargs))
        return w

    def _call(self, cmd: str, arg: Any, timeout: float) -> Any:
        first = self._worker is None
        if first:
            self._worker = self._start()
        try:
            if first:  # the answer to 'make'
                _, ok, value = self._worker.recv(timeout)
                if not ok:
                    raise RuntimeError(value)
            return self._worker.call(cmd, 0, arg, timeout)
        except WorkerFailure:
            self._worker.kill()
            self._worker = None  # the next call starts a fresh child
            raise

    @property
    def instructions(self) -> str:
        return self._instructions

    def num_tasks(self, split: str) -> int:
        if split not in self._num_tasks:
            raise ValueError(f"unknown split {split!r}; expected one of {sorted(self._num_tasks)}")
        return self._num_tasks[split]

    def reset(self, task: Task) -> EnvReset:
        return self._call("reset", task, self.start_timeout_s if self._worker is None else self.timeout_s)

    def step(self, action: str) -> EnvStep:
        if self._worker is None:
            raise WorkerFailure("the env process is gone (it failed earlier); reset to start a new one")
        return self._call("step", action, self.timeout_s)

    def example_actions(self) -> list[str]:
        if not self._has_examples:
            raise AttributeError(f"{self.target} has no example_actions()")
        return self._call("call", ("example_actions", ()), self.timeout_s)

    def close(self) -> None:
        if self._worker is not None:
            self._worker.close()
            self._worker = None

    def __del__(self):  # best effort; close() is the contract
        try:
            self.close()
        except Exception:  # noqa: BLE001
            pass
