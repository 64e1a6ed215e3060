"""Env instances in a pool of worker processes, behind the env-batch interface of :mod:`cope.envbatch`
(``reset(items)``, ``submit(items) -> Pending``). Submitting one half of the live episodes while the
actor generates for the other half is how generation and env steps overlap (``data.rollout_chunks=2``).

:class:`EnvWorkerPool` (``data.env_workers > 0``): slot ``s`` lives in worker ``s % num_workers``,
a ``python -m cope.envs.worker`` child. Every request has a deadline (``step_timeout_s``,
``reset_timeout_s``). The failure rule, one for all envs:

* an env that *raises* is an env error: that episode is aborted (excluded from the loss, counted in
  ``env/aborted_episodes``), the worker lives on;
* a worker that *dies* or *hangs* past the deadline is killed (with its process group, e.g. a JVM)
  and restarted (``env/restarts``; hangs also count in ``env/timeouts``). The episode whose request
  it was serving is aborted. The worker's other live episodes are restored on the new worker by
  replaying their actions from reset (envs are deterministic given the task); the replay must end on
  the same observation text, else that episode is aborted too (``env/replay_failures``).

So a crash never kills the run, and every episode lost to one is counted, never silently dropped.
"""
from __future__ import annotations

import logging
import select
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable

from cope.envbatch import STATS, Pending
from cope.envs.base import Env, Task
from cope.envs.worker import WorkerFailure, WorkerProcess, WorkerTimeout

log = logging.getLogger(__name__)


@dataclass
class _Request:
    rid: int
    cmd: str
    slot: int
    arg: Any
    pending: Pending
    index: int


@dataclass
class _Slot:
    made_on: int = -1  # the worker generation this slot's factory was sent to
    task: Task | None = None  # None: nothing to replay (no live episode)
    actions: list[str] = field(default_factory=list)
    last_observation: str = ""
    lost: bool = False  # its env state was lost in a restart and could not be replayed


class EnvWorkerPool:
    """Env instances in ``num_workers`` child processes with deadlines, restarts and replay.

    Args:
        env_factory: picklable factory (a Hydra partial of an env class).
        num_workers: worker processes.
        step_timeout_s: deadline of one step.
        reset_timeout_s: deadline of one reset (and of a worker's start).
        python: interpreter of the workers (default: this one).
    """

    def __init__(self, env_factory: Callable[[], Env], num_workers: int, step_timeout_s: float = 60.0,
                 reset_timeout_s: float = 300.0, python: str | None = None):
        if num_workers < 1:
            raise ValueError(f"data.env_workers must be >= 1 for a worker pool, got {num_workers}")
        if step_timeout_s <= 0 or reset_timeout_s <= 0:
            raise ValueError("data.env_step_timeout_s and data.env_reset_timeout_s must be > 0")
        from cope.envs.remote import plain

        if hasattr(env_factory, "keywords"):  # a functools.partial: make its config containers plain data
            import functools

            env_factory = functools.partial(env_factory.func, *env_factory.args, **plain(env_factory.keywords))
        self.factory, self.num_workers, self.python = env_factory, num_workers, python
        self.step_timeout_s, self.reset_timeout_s = step_timeout_s, reset_timeout_s
        self.stats = dict.fromkeys(STATS, 0)
        self._workers: list[WorkerProcess | None] = [None] * num_workers
        self._generation = [0] * num_workers
        self._inflight: list[deque[_Request]] = [deque() for _ in range(num_workers)]
        self._head_deadline = [0.0] * num_workers
        self._slots: dict[int, _Slot] = {}
        info = self._worker(0).call("describe", 0, None, reset_timeout_s)
        self.name, self.max_steps, self.instructions = info["name"], info["max_steps"], info["instructions"]

    # -- workers and slots ------------------------------------------------------------------------
    def _worker(self, w: int) -> WorkerProcess:
        if self._workers[w] is None:
            self._workers[w] = WorkerProcess(self.python)
            self._generation[w] += 1
        wp = self._workers[w]
        slot0 = self._slots.setdefault(w, _Slot())  # slot w is the first slot of worker w
        if slot0.made_on != self._generation[w]:
            wp.call("make", w, self.factory, self.reset_timeout_s)
            slot0.made_on = self._generation[w]
        return wp

    def _ready_slot(self, slot: int) -> WorkerProcess:
        w = slot % self.num_workers
        wp = self._worker(w)
        st = self._slots.setdefault(slot, _Slot())
        if st.made_on != self._generation[w]:
            if self._inflight[w]:
                self._pump(None, only=w)  # keep request order simple: make while the worker is idle
            wp.call("make", slot, self.factory, self.reset_timeout_s)
            st.made_on = self._generation[w]
        return wp

    def ensure(self, n: int) -> None:
        for s in range(n):
            self._ready_slot(s)

    # -- requests ---------------------------------------------------------------------------------
    def _submit(self, cmd: str, items: list[tuple[int, Any]]) -> Pending:
        p = Pending(len(items), self._pump)
        for i, (slot, arg) in enumerate(items):
            st = self._slots.setdefault(slot, _Slot())
            if cmd == "step" and st.lost:
                p.set(i, WorkerFailure(f"slot {slot}: env state lost in a worker restart"))
                continue
            w = slot % self.num_workers
            for attempt in range(2):  # a worker found dead between requests is restarted (its slots replayed) once
                try:
                    wp = self._ready_slot(slot)
                    if not self._inflight[w]:
                        self._head_deadline[w] = time.monotonic() + self._timeout(cmd)
                    rid = wp.send(cmd, slot, arg)
                except WorkerFailure as e:  # the worker died: the request it was serving (if any) is the culprit
                    self._restart(w, self._inflight[w][0] if self._inflight[w] else None, crashed=True, why=str(e))
                    if attempt or (cmd == "step" and st.lost):
                        p.set(i, e)
                        break
                    continue
                self._inflight[w].append(_Request(rid, cmd, slot, arg, p, i))
                break
        return p

    def _timeout(self, cmd: str) -> float:
        return self.reset_timeout_s if cmd == "reset" else self.step_timeout_s

    def reset(self, items: list[tuple[int, Task]]) -> list[Any]:
        return self._submit("reset", items).results()

    def submit(self, items: list[tuple[int, str]]) -> Pending:
        return self._submit("step", items)

    def _pump(self, pending: Pending | None, only: int | None = None) -> None:
        """Read answers until ``pending`` is complete (or worker ``only`` is idle)."""
        def busy() -> list[int]:
            ws = [only] if only is not None else range(self.num_workers)
            return [w for w in ws if self._inflight[w]]

        while (pending.left if pending is not None else busy()) and busy():
            now = time.monotonic()
            ws = busy()
            wait = max(0.0, min(self._head_deadline[w] for w in ws) - now)
            fds = {self._workers[w].fileno: w for w in ws}
            ready, _, _ = select.select(list(fds), [], [], wait)
            for fd in ready:
                self._read_one(fds[fd])
            now = time.monotonic()
            for w in busy():
                if self._inflight[w] and now >= self._head_deadline[w]:
                    self._restart(w, self._inflight[w][0], crashed=False,
                                  why=f"no answer within {self._timeout(self._inflight[w][0].cmd):.0f}s")

    def _read_one(self, w: int) -> None:
        req = self._inflight[w][0]
        try:
            rid, ok, value = self._workers[w].recv()
        except WorkerFailure as e:
            self._restart(w, req, crashed=True, why=str(e))
            return
        assert rid == req.rid, (rid, req.rid)
        self._inflight[w].popleft()
        if self._inflight[w]:
            self._head_deadline[w] = time.monotonic() + self._timeout(self._inflight[w][0].cmd)
        st = self._slots[req.slot]
        if not ok:
            st.task = None  # env error: the engine aborts the episode; nothing to replay
            req.pending.set(req.index, RuntimeError(value))
            return
        if req.cmd == "reset":
            st.task, st.actions, st.lost = req.arg, [], False
            st.last_observation = value.observation
        elif req.cmd == "step":
            st.actions.append(req.arg)
            st.last_observation = value.observation
            if value.done:
                st.task = None
        req.pending.set(req.index, value)

    def _restart(self, w: int, culprit: _Request | None, crashed: bool, why: str) -> None:
        """Kill worker ``w``, fail ``culprit``, start a new worker, replay its other live slots, resend the rest."""
        self.stats["restarts"] += 1
        self.stats["crashes" if crashed else "timeouts"] += 1
        log.warning("env worker %d %s (%s): restarting it", w, "died" if crashed else "hung", why)
        queue = list(self._inflight[w])
        self._inflight[w].clear()
        if self._workers[w] is not None:
            self._workers[w].kill()
            self._workers[w] = None
        if culprit is not None:
            queue.remove(culprit)
            self._slots[culprit.slot].task = None
            err = (WorkerFailure if crashed else WorkerTimeout)(f"env worker {w} {why} (slot {culprit.slot}, {culprit.cmd})")
            culprit.pending.set(culprit.index, err)
        live = [s for s, st in self._slots.items() if s % self.num_workers == w and st.task is not None]
        for s in live:
            self._replay(s)
        for s in live:  # a replay that killed the worker took the slots replayed before it along
            st = self._slots[s]
            if st.task is not None and st.made_on != self._generation[w]:
                self.stats["replay_failures"] += 1
                st.task, st.lost = None, True
        for req in queue:  # their slots' factories first, while the new worker is idle
            if not (req.cmd == "step" and self._slots[req.slot].lost):
                self._ready_slot(req.slot)
        for req in queue:  # not started yet: send again, in order
            if req.cmd == "step" and self._slots[req.slot].lost:
                req.pending.set(req.index, WorkerFailure(f"slot {req.slot}: env state lost in a worker restart"))
                continue
            wp = self._ready_slot(req.slot)
            if not self._inflight[w]:
                self._head_deadline[w] = time.monotonic() + self._timeout(req.cmd)
            req.rid = wp.send(req.cmd, req.slot, req.arg)
            self._inflight[w].append(req)

    def _replay(self, slot: int) -> None:
        st = self._slots[slot]
        self.stats["replays"] += 1
        try:
            wp = self._ready_slot(slot)
            obs = wp.call("reset", slot, st.task, self.reset_timeout_s).observation
            for a in st.actions:
                obs = wp.call("step", slot, a, self.step_timeout_s).observation
            if obs != st.last_observation:
                raise RuntimeError("the replay ended on a different observation (env not deterministic?)")
        except (WorkerFailure, RuntimeError) as e:
            self.stats["replay_failures"] += 1
            log.warning("slot %d: replay after a worker restart failed (%r); its episode is aborted", slot, e)
            st.task, st.lost = None, True
            w = slot % self.num_workers
            if isinstance(e, WorkerFailure):
                if self._workers[w] is not None:
                    self._workers[w].kill()
                    self._workers[w] = None
                self._generation[w] += 1  # every slot made on the dead worker must be made again

    def close(self) -> None:
        for w, wp in enumerate(self._workers):
            if wp is not None:
                wp.close()
                self._workers[w] = None
        self._slots.clear()
