"""A vLLM server that dies mid-rollout (slow: a restart is another server start, 35-65 s here).

The server's process group is SIGKILLed while a rollout runs (between two turns of the first wave, and
with requests in flight): the rollout returns, the episodes whose requests were lost are aborted and
counted like env crashes, the server is restarted with the adapter loaded again, the later wave and the
next rollout run normally. No mock: the real server really dies."""
from __future__ import annotations

import threading
import time

import pytest
from vllm_fixtures import SERVER_KW, maze6

from cope.envs.base import Task
from cope.rollout.engine import EnvRuntime, Sampling

pytestmark = pytest.mark.slow

TASKS = [Task("maze", "train", i // 2) for i in range(8)]
GROUPS = [i // 2 for i in range(8)]


@pytest.fixture(scope="module")
def waves_engine(vllm_python, served_policy, tmp_path_factory):
    from cope.rollout.vllm.engine import VLLMEngine

    eng = VLLMEngine(maze6, EnvRuntime(max_live_episodes=4), max_context=1024, python=vllm_python,
                     workdir=str(tmp_path_factory.mktemp("vllm-faults")), **SERVER_KW)
    eng.connect(served_policy)
    yield eng
    eng.shutdown()


def test_server_killed_mid_rollout_is_restarted_and_counted(waves_engine, monkeypatch):
    eng = waves_engine
    real, calls = eng._complete, []

    def kill_on_second_turn(requests):
        calls.append(len(requests))
        if len(calls) == 2:  # wave 1, turn 2: the server dies with this turn's requests in flight
            threading.Timer(0.05, eng.server.kill).start()
            time.sleep(0.01)
        return real(requests)

    monkeypatch.setattr(eng, "_complete", kill_on_second_turn)
    pid_before = eng.server.server_pid
    eps, stats = eng.rollout(TASKS, GROUPS, Sampling(1.0, 1.0, 8, seed=1))
    aborted = [e for e in eps if e.aborted]
    assert len(eps) == 8 and 1 <= len(aborted) <= 4 and all(i < 4 for i, e in enumerate(eps) if e.aborted), \
        [e.end_reason for e in eps]
    assert stats.env_errors == len(aborted) and any("generate" in m for m in stats.errors)
    assert not any(e.aborted for e in eps[4:]), "the second wave runs on the restarted server"
    assert eng.env_stats()["server_restarts"] == 1 and eng.server.server_pid != pid_before
    monkeypatch.undo()
    again, stats = eng.rollout(TASKS, GROUPS, Sampling(1.0, 1.0, 8, seed=2))
    assert stats.env_errors == 0 and not any(e.aborted for e in again)
    models = {m["id"] for m in eng.client.get("/v1/models")["data"]}
    assert eng.lora_name in models, "the adapter is loaded again after the restart"


def test_restarts_are_bounded(waves_engine, monkeypatch):
    from cope.rollout.vllm.server import VLLMError

    eng = waves_engine
    monkeypatch.setattr(eng, "max_restarts", eng.server.restarts)  # no restart left
    eng.server.kill()
    with pytest.raises(VLLMError, match="max_restarts"):
        eng.rollout(TASKS, GROUPS, Sampling(1.0, 1.0, 8, seed=3))
    monkeypatch.undo()
