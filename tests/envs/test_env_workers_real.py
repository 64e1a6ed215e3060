"""The worker pool with the real adapters: a worker killed mid-episode, between two steps (as an
OOM-killed JVM or a segfaulting engine would be), is restarted; both live episodes on it are replayed
onto the new worker and go on exactly as an undisturbed env does; nothing the dead worker started (a
JVM, a game interpreter) survives it. (A worker that dies *during* a step fails that step's episode:
tests/envs/test_envpool.py.) Each case skips when its package or system program is missing."""
from __future__ import annotations

import functools
import importlib.util
import os
import shutil
import signal
import time

import pytest

from cope.envs.base import Task
from cope.envs.runtime.batch import InProcessEnvs
from cope.envs.runtime.pool import EnvWorkerPool

pytestmark = pytest.mark.long  # real env engines: seconds to a minute per test (make test-fast leaves them out)


def _factory(name: str, tmp_path):
    if name == "scienceworld":
        from cope.envs.scienceworld.env import ScienceWorldEnv

        return functools.partial(ScienceWorldEnv, tasks=["boil"], max_steps=20)
    if name == "textworld":
        from cope.envs.textworld.env import TextWorldEnv

        return functools.partial(TextWorldEnv, challenge="tw-coin_collector", level=1, cache_dir=str(tmp_path / "tw"),
                                 max_steps=20)
    if name == "alfworld":
        from cope.envs.alfworld.env import AlfWorldEnv

        return functools.partial(AlfWorldEnv, source="generated", task_types=["pick_and_place_simple"],
                                 cache_dir=str(tmp_path / "alf"), max_steps=20)
    if name == "webshop":
        from cope.envs.webshop.env import WebShopEnv

        return functools.partial(WebShopEnv, max_steps=20)
    if name == "terminal":
        from cope.envs.terminal.env import TerminalEnv

        return functools.partial(TerminalEnv, max_steps=20, families=["create_file"])
    raise KeyError(name)


REQUIRES = {  # env: (python package, system program)
    "scienceworld": ("scienceworld", "java"),
    "textworld": ("textworld", None),
    "alfworld": ("alfworld", None),
    "webshop": (None, None),
    "terminal": (None, "bwrap"),
}


def _group_pids(pgid: int) -> set[int]:
    out = set()
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                if int(fields[2]) == pgid and fields[0] != "Z":
                    out.add(int(d))
            except (OSError, IndexError, ValueError):
                pass
    return out


def _action(first) -> str:
    if first.admissible_actions:
        return sorted(first.admissible_actions)[0]
    return "look around" if "look around" in first.observation else "ls"


@pytest.mark.parametrize("name", sorted(REQUIRES))
def test_killed_worker_mid_episode(name, tmp_path):
    pkg, prog = REQUIRES[name]
    if pkg and importlib.util.find_spec(pkg) is None:
        pytest.skip(f"needs the extra `{name}`")
    if prog and shutil.which(prog) is None:
        pytest.skip(f"needs `{prog}` on PATH")
    factory = _factory(name, tmp_path)
    tasks = [Task(name, "train", 0), Task(name, "train", 1)]
    pool = EnvWorkerPool(factory, num_workers=1, step_timeout_s=60, reset_timeout_s=300)
    ref = InProcessEnvs(factory)
    try:
        firsts = pool.reset(list(enumerate(tasks)))
        assert not any(isinstance(r, BaseException) for r in firsts), firsts
        if name == "terminal":
            a0 = a1 = "echo hello > note.txt"
        else:
            a0, a1 = _action(firsts[0]), _action(firsts[1])
        res = pool.submit([(0, a0), (1, a1)]).results()
        assert not any(isinstance(r, BaseException) for r in res), res
        worker = pool._workers[0].proc.pid
        started = _group_pids(worker)  # the worker and what it started (JVM, interpreters)
        if name == "scienceworld":  # its JVM runs in the worker's process group, so a restart can reap it
            assert any(open(f"/proc/{p}/cmdline", "rb").read().startswith(b"java") for p in started - {worker})
        os.kill(worker, signal.SIGKILL)  # the crash, between two steps of both episodes
        time.sleep(0.2)
        after = pool.submit([(0, a0), (1, a1)]).results()
        assert not any(isinstance(r, BaseException) for r in after), after
        assert pool.stats["restarts"] == 1 and pool.stats["crashes"] == 1
        assert pool.stats["replays"] == 2 and pool.stats["replay_failures"] == 0
        # both episodes continued exactly as undisturbed envs do
        ref.reset(list(enumerate(tasks)))
        ref.submit([(0, a0), (1, a1)]).results()
        want = ref.submit([(0, a0), (1, a1)]).results()
        assert [(r.observation, r.valid) for r in after] == [(r.observation, r.valid) for r in want]
        deadline = time.monotonic() + 10
        while _group_pids(worker) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _group_pids(worker), f"processes of the dead worker survive: {_group_pids(worker)} (were {started})"
        assert pool._workers[0].alive() and pool._workers[0].proc.pid != worker
    finally:
        pool.close()
        ref.close()
