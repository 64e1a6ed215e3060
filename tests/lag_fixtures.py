"""A fast stand-in for a server engine in the lag tests: every synced version is a frozen copy of the policy's model.

:class:`CopyEngine` keeps what ``data.max_lag`` needs of a server (``overlaps``, ``reports_logprobs``, versions held
while queued collections need them, each calling thread on its own env slots) with the in-process sampler, so the
tests run in seconds without vLLM. The sampler's log-probs are the copy's own, teacher-forced at the sampling
temperature over the whole vocabulary, as a vLLM server run with ``--logprobs-mode processed_logprobs`` reports them.
Every rollout call is recorded (thread, version) in :attr:`CopyEngine.calls`, of the newest instance
(:attr:`CopyEngine.last`)."""
from __future__ import annotations

import copy
import threading
from collections import Counter
from types import SimpleNamespace

import torch

from cope.episode import Role
from cope.rollout.engine import HFEngine
from cope.train.batch import collate
from cope.train.logprobs import causal_lm_logprobs


class CopyEngine:
    overlaps = True
    reports_logprobs = True
    last: "CopyEngine | None" = None

    def __init__(self, env, runtime, max_context, instructions=None):
        self.args = (env, runtime, max_context, instructions)
        self.lanes: dict[int, HFEngine] = {}  # thread id -> its own env slots
        self.versions: dict[int, torch.nn.Module] = {}
        self.holds: Counter = Counter()
        self.newest: int | None = None
        self.calls: list[tuple[str, int]] = []  # (thread name, version) of every rollout
        self.unloaded: list[int] = []
        self.lock = threading.Lock()
        self.policy = None
        CopyEngine.last = self

    def connect(self, policy, rank: int = 0) -> None:
        self.policy = policy

    def sync(self, version: int) -> None:
        if version == self.newest:
            return
        model = copy.deepcopy(self.policy.model).eval()
        with self.lock:
            old, self.newest = self.newest, version
            self.versions[version] = model
            if old is not None and not self.holds[old]:
                self._unload(old)

    def _unload(self, version: int) -> None:
        del self.versions[version]
        self.unloaded.append(version)

    def hold(self, version: int) -> None:
        with self.lock:
            if version not in self.versions:
                raise KeyError(f"version {version} is not loaded")
            self.holds[version] += 1

    def release(self, version: int) -> None:
        with self.lock:
            self.holds[version] -= 1
            if not self.holds[version] and version != self.newest:
                self._unload(version)

    def _lane(self) -> HFEngine:
        with self.lock:
            return self.lanes.setdefault(threading.get_ident(), HFEngine(*self.args))

    def rollout(self, tasks, groups, sampling, progress=None, version=None):
        v = self.newest if version is None else version
        with self.lock:
            model = self.versions[v]
            self.calls.append((threading.current_thread().name, v))
        p = self.policy
        lane = self._lane()
        lane.policy = SimpleNamespace(model=model, pad_id=p.pad_id, chat=p.chat, tokenizer=p.tokenizer)
        eps, stats = lane.rollout(tasks, groups, sampling, progress=progress)
        with torch.no_grad():
            for e in eps:
                b = collate([e], p.pad_id)
                lp, _ = causal_lm_logprobs(model, b["input_ids"], b["attention_mask"], b["position_ids"],
                                           tempered=b["roles"] == int(Role.ACTION), temperature=sampling.temperature)
                for s in e.steps:
                    s.sampler_logprobs = lp[0, s.action_start:s.action_end].tolist()
        return eps, stats

    def env_stats(self) -> dict[str, int]:
        total: Counter = Counter()
        for lane in list(self.lanes.values()):
            total.update(lane.env_stats())
        return dict(total) or HFEngine(*self.args).env_stats()

    def close(self) -> None:
        for lane in list(self.lanes.values()):
            lane.close()
