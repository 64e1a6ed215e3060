"""Env instances in a pool of worker processes, behind the env-batch interface of :mod:`cope.envs.runtime.batch`
(``reset(items)``, ``submit(items) -> Pending``). Submitting one half of the live episodes while the
actor generates for the other half is how generation and env steps overlap (``data.env_runtime.chunks=2``).

:class:`EnvWorkerPool` (``data.env_runtime.workers > 0``): slot ``s`` lives in worker ``s % num_workers``, a
``python -m cope.envs.runtime.worker`` child; every request has a deadline. The failure rule (docs/envs/README.md):
an env that *raises* (construction, reset, step) aborts that episode, the worker lives on; a worker
that *dies*, closes its channel or answers garbage (``env/crashes``), or *hangs* (``env/timeouts``)
is killed with its process group and restarted (``env/restarts``): the episode whose request it was
serving is aborted (a ``make`` is served for the request it precedes), its other live episodes are
replayed from reset on the new worker and kept only if the replay ends on the same observation
(``env/replays``, ``env/replay_failures``); a worker that does not close cleanly is ``close_failures``.
What a worker prints reaches the run's log only up to ``max_output_bytes`` (:mod:`cope.envs.runtime.output`);
a worker that prints more is logged once and counted (``env/output_capped``), the rest of its output dropped.

One path carries every request (``make``, ``describe``, ``reset``, ``step``, replays): queued per
worker (``_todo``), sent by :meth:`_flush`, answered in order (``_sent``), read by :meth:`_pump`. Any
failure on the way goes to :meth:`_fail`, which drops the worker handle for good (a killed handle
refuses use), blames one request (none for a worker found dead between requests) and queues the
replays and the unanswered rest for the next worker. Each blamed request is settled, so recovery
ends; so a crash never kills the run, and every episode lost to one is counted.
"""
from __future__ import annotations

import logging
import select
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable

from cope.envs.base import Env, Task
from cope.envs.runtime.batch import STATS, Pending
from cope.envs.runtime.output import MAX_OUTPUT_BYTES
from cope.envs.runtime.worker import WorkerFailure, WorkerProcess, WorkerTimeout

log = logging.getLogger(__name__)


@dataclass
class _Request:
    cmd: str  # make, describe, reset, step
    slot: int
    arg: Any
    pending: Pending | None = None  # None: a replay request, whose outcome only the slot sees
    index: int = 0
    replay: bool = False  # restores its slot on a new worker
    last: bool = False  # the last request of a replay: its observation must match
    then: "_Request | None" = None  # a make: the request it was sent for (fails with it)
    settled: bool = False

    def settle(self, value: Any) -> None:
        if not self.settled and self.pending is not None:
            self.pending.set(self.index, value)
        self.settled = True


@dataclass
class _Slot:
    made_on: int = -1  # the worker generation whose instance of this slot was made
    task: Task | None = None  # None: nothing to replay (no live episode)
    actions: list[str] = field(default_factory=list)
    last_observation: str = ""
    lost: bool = False  # its env holds no episode (lost in a restart): a step must fail, a reset is fine


class EnvWorkerPool:
    """Env instances in ``num_workers`` child processes with deadlines, restarts and replay.

    Args:
        env_factory: picklable factory (a Hydra partial of an env class).
        num_workers: worker processes.
        step_timeout_s: deadline of one step (and of a worker's clean exit at :meth:`close`).
        reset_timeout_s: deadline of one reset (and of a worker's start plus an env's construction).
        python: interpreter of the workers (default: this one).
        max_output_bytes: what one worker process may print into the run's log; the rest is counted.
    """

    def __init__(self, env_factory: Callable[[], Env], num_workers: int, step_timeout_s: float = 60.0,
                 reset_timeout_s: float = 300.0, python: str | None = None, max_output_bytes: int = MAX_OUTPUT_BYTES):
        if num_workers < 1:
            raise ValueError(f"data.env_runtime.workers must be >= 1 for a worker pool, got {num_workers}")
        if step_timeout_s <= 0 or reset_timeout_s <= 0:
            raise ValueError("data.env_runtime.step_timeout_s and data.env_runtime.reset_timeout_s must be > 0")
        from cope.envs.runtime.remote import plain

        if hasattr(env_factory, "keywords"):  # a functools.partial: make its config containers plain data
            import functools

            env_factory = functools.partial(env_factory.func, *env_factory.args, **plain(env_factory.keywords))
        self.factory, self.num_workers, self.python = env_factory, num_workers, python
        self.max_output_bytes = max_output_bytes
        self.step_timeout_s, self.reset_timeout_s = step_timeout_s, reset_timeout_s
        self.stats = dict.fromkeys(STATS, 0)
        self._workers: list[WorkerProcess | None] = [None] * num_workers
        self._generation = [0] * num_workers
        self._answered = [0] * num_workers  # answers from the current worker (0: it never worked)
        self._todo: list[deque[_Request]] = [deque() for _ in range(num_workers)]
        self._sent: list[deque[_Request]] = [deque() for _ in range(num_workers)]
        self._deadline = [0.0] * num_workers  # of the head of _sent[w]
        self._capped = [0] * num_workers  # the last generation of worker w whose output cap was counted
        self._slots: dict[int, _Slot] = {}
        info = self._describe()
        self.name, self.max_steps, self.instructions = info["name"], info["max_steps"], info["instructions"]

    def _describe(self) -> dict:
        for _ in range(3):  # a worker that fails while building the first env is retried, then reported
            (info,) = self._submit("describe", [(0, None)]).results()
            if not isinstance(info, WorkerFailure):
                break
        if isinstance(info, BaseException):
            self.close()
            raise type(info)(f"env worker pool: cannot build and describe the env: {info}") from info
        return info

    # -- the env-batch interface ------------------------------------------------------------------
    def reset(self, items: list[tuple[int, Task]]) -> list[Any]:
        return self._submit("reset", items).results()

    def submit(self, items: list[tuple[int, str]]) -> Pending:
        return self._submit("step", items)

    def ensure(self, n: int) -> None:
        """Build the instances of slots ``0..n-1`` now (so that later timings exclude construction)."""
        gen = self._generation
        todo = [(s, self.factory) for s in range(n) if self._slots.get(s, _Slot()).made_on != gen[s % self.num_workers]]
        for r in self._submit("make", todo).results():
            if isinstance(r, BaseException):
                raise r

    def close(self) -> None:
        for w, wp in enumerate(self._workers):
            if wp is not None:
                problem = wp.close(timeout=self.step_timeout_s)
                self._note_output(w)
                if problem is not None:
                    self.stats["close_failures"] += 1
                    log.warning("env worker %d did not close cleanly: %s", w, problem)
                self._workers[w] = None
            self._todo[w].clear()
            self._sent[w].clear()
        self._slots.clear()

    # -- the one request path ---------------------------------------------------------------------
    def _submit(self, cmd: str, items: list[tuple[int, Any]]) -> Pending:
        p = Pending(len(items), self._pump)
        for i, (slot, arg) in enumerate(items):
            req = _Request(cmd, slot, arg, p, i)
            if cmd == "step" and self._slots.setdefault(slot, _Slot()).lost:
                req.settle(self._lost(slot))
            else:
                self._todo[slot % self.num_workers].append(req)
        self._flush()
        return p

    def _timeout(self, cmd: str) -> float:
        return self.step_timeout_s if cmd == "step" else self.reset_timeout_s

    def _lost(self, slot: int) -> WorkerFailure:
        return WorkerFailure(f"slot {slot}: env state lost in a worker restart")

    def _flush(self) -> None:
        """Send every queued request, each after a ``make`` of its slot where the worker lacks one."""
        for w in range(self.num_workers):
            while self._todo[w]:
                req = self._todo[w][0]
                if req.settled:
                    self._todo[w].popleft()
                    continue
                wp = self._workers[w]
                if wp is None:
                    try:
                        wp = self._workers[w] = WorkerProcess(self.python, max_output_bytes=self.max_output_bytes)
                    except WorkerFailure as e:  # no process at all: fail what waits for it, restart nothing
                        self._starve(w, e)
                        break
                    self._generation[w] += 1
                    self._answered[w] = 0
                st = self._slots.setdefault(req.slot, _Slot())
                sending = req
                try:
                    if st.made_on != self._generation[w] and req.cmd != "make":
                        sending = _Request("make", req.slot, self.factory, then=req)
                        self._send(w, wp, sending)
                        sending = req
                    self._send(w, wp, req)
                except WorkerFailure as e:  # dead before answering anything: what it was given is the culprit
                    self._fail(w, True, str(e), hint=None if self._answered[w] else sending)
                    continue
                self._todo[w].popleft()

    def _send(self, w: int, wp: WorkerProcess, req: _Request) -> None:
        if req.cmd == "make":
            self._slots[req.slot].made_on = self._generation[w]
        if not self._sent[w]:
            self._deadline[w] = time.monotonic() + self._timeout(req.cmd)
        wp.send(req.cmd, req.slot, req.arg)
        self._sent[w].append(req)

    def _pump(self, pending: Pending) -> None:
        """Send and read until ``pending`` is complete."""
        while pending.left:
            self._flush()
            ws = [w for w in range(self.num_workers) if self._sent[w]]
            if not ws:
                raise RuntimeError(f"env worker pool: {pending.left} results awaited but no request is in flight")
            wait = max(0.0, min(self._deadline[w] for w in ws) - time.monotonic())
            fds = {self._workers[w].fileno: w for w in ws}
            ready, _, _ = select.select(list(fds), [], [], wait)
            for fd in ready:
                self._read_one(fds[fd])
            now = time.monotonic()
            for w in ws:
                if self._sent[w] and now >= self._deadline[w]:
                    self._fail(w, False, f"no answer within {self._timeout(self._sent[w][0].cmd):g}s")

    def _read_one(self, w: int) -> None:
        try:
            _, ok, value = self._workers[w].recv(self._deadline[w] - time.monotonic())
        except WorkerFailure as e:
            self._fail(w, not isinstance(e, WorkerTimeout), str(e))
            return
        self._note_output(w)
        req = self._sent[w].popleft()
        self._answered[w] += 1
        if self._sent[w]:
            self._deadline[w] = time.monotonic() + self._timeout(self._sent[w][0].cmd)
        self._answer(req, ok, value)

    def _answer(self, req: _Request, ok: bool, value: Any) -> None:
        st = self._slots[req.slot]
        if req.cmd == "make":
            if not ok:  # the env's construction raised: the request it was made for fails as an env error
                st.made_on = -1
                self._culprit(req.then or req, RuntimeError(value))
            elif req.then is None:
                req.settle(value)
            return
        if req.replay:
            if st.task is None:
                return  # this replay failed already
            if not ok:
                self._replay_failed(req.slot, f"the env raised: {value}")
            elif req.last and value.observation != st.last_observation:
                self._replay_failed(req.slot, "it ended on a different observation (env not deterministic?)")
            return
        if req.settled:
            return
        if req.cmd == "step" and st.lost:  # its replay failed after it was sent
            req.settle(self._lost(req.slot))
            return
        if not ok:
            st.task = None  # env error: the engine aborts the episode; nothing to replay
            req.settle(RuntimeError(value))
            return
        if req.cmd == "reset":
            st.task, st.actions, st.lost = req.arg, [], False
            st.last_observation = value.observation
        elif req.cmd == "step":
            st.actions.append(req.arg)
            st.last_observation = value.observation
            if value.done:
                st.task = None
        req.settle(value)

    # -- failures ---------------------------------------------------------------------------------
    def _culprit(self, req: _Request, err: BaseException) -> None:
        """The request a failure is blamed on: its episode is aborted (a replay: its slot is lost)."""
        if req.replay:
            self._replay_failed(req.slot, repr(err))
            return
        st = self._slots[req.slot]
        st.task = None
        st.lost = st.lost or req.cmd == "step"
        req.settle(err)

    def _replay_failed(self, slot: int, why: str) -> None:
        st = self._slots[slot]
        self.stats["replay_failures"] += 1
        log.warning("slot %d: replay after a worker restart failed (%s); its episode is aborted", slot, why)
        st.task, st.lost = None, True

    def _fail(self, w: int, crashed: bool, why: str, hint: _Request | None = None) -> None:
        """Kill worker ``w`` for good, blame the request it was serving (else ``hint``), and queue the
        replays of its live slots and then its unanswered requests for the next worker."""
        self.stats["restarts"] += 1
        self.stats["crashes" if crashed else "timeouts"] += 1
        sent, todo = list(self._sent[w]), list(self._todo[w])
        self._sent[w].clear()
        self._todo[w].clear()
        if self._workers[w] is not None:
            self._note_output(w)
            self._workers[w].kill()
            self._workers[w] = None
        culprit = sent.pop(0) if sent else hint
        log.warning("env worker %d %s (%s): restarting it%s", w, "died" if crashed else "hung", why,
                    f"; slot {culprit.slot}'s {culprit.cmd} fails" if culprit else "")
        if culprit is not None:
            err = (WorkerFailure if crashed else WorkerTimeout)(f"{why} (worker {w}, slot {culprit.slot}, {culprit.cmd})")
            self._culprit(culprit.then or culprit, err)
        rest = [r for r in sent + todo if not r.settled and not r.replay and not (r.cmd == "make" and r.then)]
        first: dict[int, str] = {}
        for r in rest:
            first.setdefault(r.slot, r.cmd)
        queue: list[_Request] = []
        for s, st in self._slots.items():
            if s % self.num_workers != w:
                continue
            if st.task is None or first.get(s) == "reset":
                st.lost, st.task = True, None  # its env is gone; only a reset may use the slot again
                continue
            self.stats["replays"] += 1
            queue.append(_Request("reset", s, st.task, replay=True, last=not st.actions))
            queue += [_Request("step", s, a, replay=True, last=j == len(st.actions) - 1) for j, a in enumerate(st.actions)]
        for r in rest:
            if r.cmd == "step" and self._slots[r.slot].lost:
                r.settle(self._lost(r.slot))
            else:
                queue.append(r)
        self._todo[w] = deque(queue)

    def _note_output(self, w: int) -> None:
        """Counts and logs, once per worker process, that worker ``w`` printed more than its cap."""
        wp = self._workers[w]
        if wp is not None and wp.output.capped and self._capped[w] != self._generation[w]:
            self._capped[w] = self._generation[w]
            self.stats["output_capped"] += 1
            log.warning("env worker %d (pid %d) printed more than %d bytes: the rest of its output is dropped "
                        "(env/output_capped)", w, wp.proc.pid, wp.output.limit)

    def _starve(self, w: int, err: WorkerFailure) -> None:
        """No worker process can be started for ``w``: everything waiting for it fails."""
        log.warning("env worker %d cannot be started (%s): its requests fail", w, err)
        for r in self._todo[w]:
            if not (r.replay and self._slots[r.slot].task is None):  # (a replay that failed already)
                self._culprit(r, err)
        self._todo[w].clear()
