"""``env=openenv``: an OpenEnv environment (the example in envs/openenv/example.py, served locally by openenv-core's
own server, no container) behind the Env protocol: the type mapping (text and native), a server that is down at start,
timeouts, a server killed mid-rollout (only the episodes in flight abort, the server is restarted or reconnected)."""
from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
from tiny_fixtures import Scripted, tiny_tokenizer

from cope.chat import ChatFormat
from cope.envs.base import Env, Task
from cope.envs.tool_calls import NativeAction
from cope.rollout.loop import run_episodes

pytest.importorskip("openenv", reason="env=openenv needs openenv-core: pip install 'cope-trainer[openenv]'")
KW = dict(observation_field="feedback", admissible_field="choices")


def _env(**kw):
    from cope.envs.openenv.env import OpenEnvEnv

    return OpenEnvEnv(**{**KW, **kw})


def _secret(seed: int) -> int:
    import random

    return random.Random(seed).randint(1, 8)


def _serve(port: int, **env) -> subprocess.Popen:
    """The example served by hand on ``port`` (what a user does for env.url)."""
    from cope.envs.openenv.server import get_json

    proc = subprocess.Popen([sys.executable, "-m", "cope.envs.openenv.serve", "--app",
                             "cope.envs.openenv.example:create_app", "--factory", "--port", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env={**os.environ, **env},
                            start_new_session=True)
    for _ in range(150):
        try:
            get_json(f"http://127.0.0.1:{port}/health", 1.0)
            return proc
        except OSError:
            time.sleep(0.1)
    proc.kill()
    raise RuntimeError("the example server did not start")


def test_text_actions_map_to_the_action_type():
    env = _env()
    assert isinstance(env, Env) and env.num_tasks("train") == 10_000 and "guess only" in env.instructions
    task = Task("openenv", "train", 3)
    r = env.reset(task)
    assert r.admissible_actions == [str(n) for n in range(1, 9)] and "Guess the number" in r.observation
    assert "tools" not in r.info and env.tools is None
    bad = env.step("seven")
    assert not bad.valid and "must be of type integer" in bad.harness and not bad.done
    out = env.step("9")
    assert not out.valid and "within [1, 8]" in out.harness  # the action's own schema, checked here
    secret = _secret(3)
    wrong = 1 if secret != 1 else 2
    miss = env.step(str(wrong))
    assert miss.valid and not miss.done and ("higher" in miss.observation or "lower" in miss.observation)
    hit = env.step(str(secret))
    assert hit.done and hit.success and hit.reward == 1.0 and hit.score == 1.0
    test_reset = env.reset(Task("openenv", "test", 0))
    assert test_reset.info["seed"] == 1_000_000
    env.close()


def test_native_tool_and_step_budget():
    env = _env(action_format="native", max_steps=2)
    r = env.reset(Task("openenv", "train", 5))
    (tool,) = r.info["tools"]
    assert tool["function"]["name"] == "guess" and tool["function"]["parameters"]["required"] == ["guess"]
    assert "metadata" not in tool["function"]["parameters"]["properties"]
    msg = env.step(NativeAction("message", text="4").encode())
    assert not msg.valid and "call of the tool guess" in msg.harness
    wrong = 1 if _secret(5) != 1 else 2
    last = env.step(NativeAction("call", "guess", {"guess": wrong}).encode())
    assert last.done and last.info["timeout"] and not last.success
    env.close()


def test_a_server_that_is_down_at_start_is_a_clear_error():
    from cope.envs.openenv.server import free_port

    with pytest.raises(ConnectionError, match="env.url"):
        _env(url=f"http://127.0.0.1:{free_port()}", connect_timeout_s=1.0)
    with pytest.raises(ValueError, match="env.url"):
        _env(url=None, app=None)


def _far(n: int, start: int = 0) -> list[int]:
    """``n`` train tasks from ``start`` on whose secret is above 2 (still running at the second guess)."""
    return [i for i in range(start, start + 100) if _secret(i) > 2][:n]


def _rollout(envs, indices: list[int], kill=None):
    """One guessing episode per env with the tiny tokenizer: guess 1, 2, ... (``kill()`` before the 2nd turn)."""
    n = len(indices)
    tok = tiny_tokenizer()
    chat = ChatFormat.chatml(tok)
    guesses = [[*tok.encode(str(g), add_special_tokens=False), chat.stop_id] for g in range(1, 9)]

    class Killing(Scripted):
        calls = 0

        def __call__(self, contexts, admissible, keys):
            Killing.calls += 1
            if kill is not None and Killing.calls == 2:
                kill()
            return super().__call__(contexts, admissible, keys)

    tasks = [Task("openenv", "train", i) for i in indices]
    return run_episodes(envs, tasks, list(range(n)), Killing({k: guesses for k in range(n)}), tok, chat, 2048, 8)


def test_killed_local_server_aborts_the_episodes_in_flight_then_restarts():
    envs = [_env() for _ in range(3)]
    server = envs[0]._server
    assert all(e._server is server for e in envs)  # one server per process and app
    restarts = server.restarts
    eps, stats = _rollout(envs, _far(3), kill=server.kill)
    assert all(e.aborted for e in eps) and stats.env_errors == 3  # in flight when it died: counted, not raised
    eps, stats = _rollout(envs, _far(3, 10))  # the next resets restart the server and open new sessions
    assert server.restarts == restarts + 1 and stats.env_errors == 0
    assert all(not e.aborted and e.success == (_secret(i) <= 6) for e, i in zip(eps, _far(3, 10)))  # 6 tries
    for e in envs:
        e.close()


@pytest.fixture(scope="module")
def served():
    """The example served by hand (env.url), a guess of 8 taking 4 s (a hanging step)."""
    from cope.envs.openenv.server import free_port

    port = free_port()
    proc = _serve(port, COPE_EXAMPLE_SLOW_GUESS="8", COPE_EXAMPLE_SLOW_S="4")
    yield f"http://127.0.0.1:{port}"
    proc.kill()
    proc.wait()


@pytest.mark.slow  # two server starts (~10 s each on a loaded machine)
def test_url_server_restarted_by_its_owner_is_reconnected():
    from cope.envs.openenv.server import free_port

    port = free_port()
    proc = _serve(port)
    try:
        envs = [_env(url=f"http://127.0.0.1:{port}") for _ in range(2)]
        eps, stats = _rollout(envs, _far(2), kill=lambda: (proc.kill(), proc.wait()))
        assert all(e.aborted for e in eps) and stats.env_errors == 2
        proc = _serve(port)
        eps, stats = _rollout(envs, _far(2, 5))
        assert stats.env_errors == 0 and not any(e.aborted for e in eps)
    finally:
        proc.kill()
        proc.wait()


def test_a_step_past_its_deadline_aborts_only_its_episode(served):
    tok = tiny_tokenizer()
    chat = ChatFormat.chatml(tok)
    guesses = [[*tok.encode(str(g), add_special_tokens=False), chat.stop_id] for g in (8, 1, 2, 3, 4, 5, 6, 7)]
    env, fast = _env(url=served, timeout_s=1.0), _env(url=served, timeout_s=1.0)
    first_is_one = next(i for i in range(100) if _secret(i) == 1)
    eps, stats = run_episodes([env, fast], [Task("openenv", "train", first_is_one)] * 2, [0, 1],
                              Scripted({0: guesses, 1: guesses[1:]}), tok, chat, 2048, 8)
    assert eps[0].aborted and "Timeout" in stats.errors[0] and eps[1].success and stats.env_errors == 1
    again, _ = run_episodes([env], [Task("openenv", "train", first_is_one)], [0], Scripted({0: guesses[1:]}), tok, chat,
                            2048, 8)
    assert again[0].success  # a new session after the dropped one
