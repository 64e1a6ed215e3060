"""Native tool calls end to end in the rollout loop and the tool envs: the call syntaxes and the schema check, the
envelope an env gets, tau2 / terminal / AppWorld with ``action_format=native`` (tools in the reset info, results in the
template's tool turn as observations), CoPE's forecast targets being the next calls in the same native format, and
ECHO's targets being the tool results."""
from __future__ import annotations

import json

import pytest
from tiny_fixtures import Scripted
from tool_templates import GOOD_SCRIPT, ToolEnv, action_ids, call, family_tokenizer, run_tool_episodes

from cope.algos.cope.chunks import build_chunks
from cope.algos.cope.prompted import PlanPrompt, build_prompted
from cope.chat import ChatFormat
from cope.chat.calls import CallError, ToolCall, parse_calls
from cope.chat.conformance import check_transcript, episode_messages
from cope.envs.base import Task
from cope.envs.tool_calls import NativeAction, check_call, function_tool, read_action
from cope.episode import Role
from cope.rollout.loop import run_episodes

TOOLS = [function_tool("add", "Add.", {"a": {"type": "integer"}, "b": {"type": "integer", "minimum": 0}}, ["a", "b"]),
         function_tool("tag", "Tag.", {"tags": {"type": "array", "items": {"type": "string", "enum": ["x", "y"]}}})]


@pytest.mark.parametrize(("syntax", "text", "want"), [
    ("hermes", 'ok\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>',
     ("ok", [ToolCall("add", {"a": 1, "b": 2})])),
    ("hermes", '<tool_call>{"name": "add", "arguments": "{\\"a\\": 1}"}</tool_call>\n', ("", [ToolCall("add", {"a": 1})])),
    ("hermes", "just text", None),
    ("llama3", '{"name": "add", "parameters": {"a": 1, "b": 2}}', ("", [ToolCall("add", {"a": 1, "b": 2})])),
    ("llama3", '<|python_tag|>{"name": "add", "arguments": {}}', ("", [ToolCall("add", {})])),
    ("llama3", "The answer is 3.", None),
    ("mistral", '[TOOL_CALLS][{"name": "add", "arguments": {"a": 1}}, {"name": "tag", "arguments": {}}]',
     ("", [ToolCall("add", {"a": 1}), ToolCall("tag", {})])),
    ("mistral", "plain", None),
])
def test_call_syntaxes(syntax, text, want):
    assert parse_calls(syntax, text) == want


@pytest.mark.parametrize(("syntax", "text", "why"), [
    ("hermes", '<tool_call>\n{"name": "add", "arguments": {"a": 1}\n', "not closed"),
    ("hermes", '<tool_call>{"name": "add"}</tool_call> and more', "text after a tool call"),
    ("hermes", '<tool_call>{"arguments": {}}</tool_call>', "needs \"name\""),
    ("hermes", '<tool_call>{"name": "add", "arguments": [1]}</tool_call>', "must be a JSON object"),
    ("llama3", '{"name": "add", "parameters": {"a": 1,}', "not valid JSON"),
    ("mistral", "[TOOL_CALLS][]", "non-empty JSON list"),
])
def test_malformed_calls(syntax, text, why):
    with pytest.raises(CallError, match=why):
        parse_calls(syntax, text)


def test_schema_check():
    assert check_call("add", {"a": 1, "b": 2}, TOOLS) is None
    assert "unknown tool 'mul'" in check_call("mul", {}, TOOLS)
    assert "missing the required" in check_call("add", {"a": 1}, TOOLS)
    assert "must be of type integer" in check_call("add", {"a": "1", "b": 2}, TOOLS)
    assert "must be of type integer" in check_call("add", {"a": True, "b": 2}, TOOLS)  # a bool is not an integer
    assert "within" in check_call("add", {"a": 1, "b": -1}, TOOLS)
    assert "unknown argument" in check_call("add", {"a": 1, "b": 2, "c": 3}, TOOLS)
    assert "must be one of" in check_call("tag", {"tags": ["x", "z"]}, TOOLS)
    assert check_call("tag", {}, TOOLS) is None


def test_envelope_round_trip():
    for a in (NativeAction("call", "add", {"a": 1}), NativeAction("message", text="hi"), NativeAction("refused", text="no")):
        assert read_action(a.encode()) == a
    assert read_action("ls -la").kind == "refused" and "native tool action" in read_action("ls -la").text


def _native_episodes(family="chatml-hermes", scripts=None):
    tok = family_tokenizer(family)
    chat = ChatFormat.from_template(tok)
    second = [call("add", a=2, b=4), call("lookup", key="alpha"), call("finish", answer=13)]  # task 4's goal
    eps, envs, stats = run_tool_episodes(tok, chat, scripts or [GOOD_SCRIPT, second])
    return tok, chat, eps, envs


@pytest.mark.parametrize("family", ["chatml-hermes", "llama3.1"])
def test_cope_forecast_targets_are_the_next_native_calls(family):
    tok, chat, eps, _ = _native_episodes(family)
    assert all(e.success for e in eps)
    chunks, _ = build_chunks(eps, chat, K=3)
    assert chunks
    for c in chunks:  # continuation chunks: each action's ids are the transcript's sampled call, stop id included
        for j in sorted({j for j in c.action_index if j >= 0}):
            ids = [t for t, a in zip(c.tokens, c.action_index) if a == j]
            s = eps[c.episode].steps[j]
            assert ids == eps[c.episode].tokens[s.action_start: s.action_end]
            text = tok.decode(ids[:-1], skip_special_tokens=False)
            assert text == chat.tools.call_text(chat.tools.read(text, ToolEnv.TOOLS).call)
    samples, _ = build_prompted(eps, chat, PlanPrompt(tok, "turns"), K=3, gate="all")
    assert samples
    for c in samples:  # the authors' prompted sample: the listed actions are the same calls, in the same format
        for j in sorted({j for j, t in zip(c.action_index, c.target) if j >= 0 and t}):
            ids = [t for t, a in zip(c.tokens, c.action_index) if a == j]
            text = tok.decode(ids[:-1], skip_special_tokens=False)
            s = eps[c.episode].steps[j]
            assert ids[:-1] == eps[c.episode].tokens[s.action_start: s.action_start + s.content_len]
            assert chat.tools.read(text, ToolEnv.TOOLS).call is not None


def test_echo_targets_are_the_tool_results():
    tok, chat, eps, envs = _native_episodes()
    ep = eps[0]
    for s, (obs, _h) in zip(ep.steps, envs[0].turns[1:]):
        span = range(s.obs_start, s.obs_end)
        got = [ep.tokens[k] for k in span if ep.roles[k] == Role.OBSERVATION]
        assert tok.decode(got) == obs  # the tool result, and only it, is the observation


# -- the tool envs in the native format ------------------------------------------------------------------------------
def _tau2(**kw):
    pytest.importorskip("tau2.registry", reason="needs tau2-bench: pip install 'cope-trainer[tau2]'")
    from cope.envs.tau2.env import Tau2Env

    return Tau2Env(action_format="native", **kw)


@pytest.mark.long
def test_tau2_native_replays_gold_calls_to_success():
    env = _tau2()
    tok = family_tokenizer("chatml-hermes")
    chat = ChatFormat.from_template(tok)
    task = next(Task("tau2", "train", i) for i in range(env.num_tasks("train"))
                if env.tau2_task("train", i).evaluation_criteria.actions)
    gold = env.tau2_task(task.split, task.index).evaluation_criteria
    script = [ToolCall(a.name, dict(a.arguments)) for a in gold.actions if a.requestor == "assistant"]
    script += [*(gold.communicate_info or []), ToolCall("done", {})]
    ids = [action_ids(tok, chat, a) for a in script]
    eps, stats = run_episodes([env], [task], [0], Scripted({0: ids}), tok, chat, 8192, 400)
    ep = eps[0]
    assert ep.success and all(s.valid for s in ep.steps) and stats.tool_call_errors == 0, ep.end_reason
    msgs = episode_messages(ep, tok, chat)
    assert {t["function"]["name"] for t in msgs["tools"]} >= {"done", *(c.name for c in script if isinstance(c, ToolCall))}
    tool_turns = [m for m in msgs["messages"] if m["role"] == "tool"]
    assert tool_turns and not any(m["content"].startswith("tool: ") for m in tool_turns)  # the bare results
    assert "<tools>" not in msgs["messages"][0]["content"] and "<policy>" in msgs["messages"][0]["content"]
    assert check_transcript(tok, chat, ep, msgs["messages"], msgs["tools"]) == []


@pytest.mark.long
def test_tau2_native_message_and_refusal():
    env = _tau2(max_errors=5)
    reset = env.reset(Task("tau2", "train", 0))
    assert [t["function"]["name"] for t in reset.info["tools"]][-1] == "done"
    said = env.step(NativeAction("message", text="Which user is this for?").encode())
    assert said.valid and said.observation.startswith("user: ")
    bad = env.step(NativeAction("refused", text="unknown tool 'x'").encode())
    assert not bad.valid and "unknown tool" in bad.harness and bad.info["tool_errors"] == 0


def _terminal():
    from cope.envs.terminal.env import TerminalEnv
    from cope.envs.terminal.sandbox import unavailable_reason

    if unavailable_reason("bwrap"):
        pytest.skip(f"no bubblewrap sandbox: {unavailable_reason('bwrap')}")
    return TerminalEnv(action_format="native", max_steps=12)


@pytest.mark.long
def test_terminal_native_reference_solution():
    env = _terminal()
    tok = family_tokenizer("llama3.1")
    chat = ChatFormat.from_template(tok)
    ref_env = _terminal()
    ref_env.reset(Task("terminal", "train", 0))
    steps = [ToolCall("bash", {"command": c}) for c in ref_env.reference_solution()[:-1]] + [ToolCall("submit", {})]
    ref_env.close()
    eps, stats = run_episodes([env], [Task("terminal", "train", 0)], [0],
                              Scripted({0: [action_ids(tok, chat, a) for a in steps]}), tok, chat, 8192, 400)
    ep = eps[0]
    assert ep.success and stats.tool_call_errors == 0, [s.action_text for s in ep.steps]
    msgs = episode_messages(ep, tok, chat)
    assert all(m["content"].endswith("]") for m in msgs["messages"][3:-1:2])  # "[exit code N]" tool results
    assert check_transcript(tok, chat, ep, msgs["messages"], msgs["tools"]) == []


@pytest.mark.long
def test_terminal_native_refuses_messages_and_bad_calls():
    env = _terminal()
    env.reset(Task("terminal", "train", 0))
    msg = env.step(NativeAction("message", text="ls").encode())
    assert not msg.valid and "call a tool" in msg.harness
    bad = env.step(NativeAction("refused", text="malformed tool call").encode())
    assert not bad.valid and "malformed" in bad.harness
    ok = env.step(NativeAction("call", "bash", {"command": "ls"}).encode())
    assert ok.valid and ok.observation.endswith("[exit code 0]")
    assert env.tools[0]["function"]["name"] == "bash" and "bash tool" in env.instructions


def test_appworld_native_code():
    from cope.envs.appworld import NATIVE_INSTRUCTIONS, NATIVE_TOOLS, AppWorldEnv, native_code

    env = AppWorldEnv(action_format="native")
    assert env.tools == NATIVE_TOOLS and env.instructions == NATIVE_INSTRUCTIONS and "python tool" in env.instructions
    assert native_code(NativeAction("call", "python", {"code": "\nprint(1)\n"}).encode()) == ("print(1)", None)
    assert "call the python tool" in native_code(NativeAction("message", text="hi").encode())[1]
    assert "bad args" in native_code(NativeAction("refused", text="bad args").encode())[1]
    with pytest.raises(ValueError, match="action_format"):
        AppWorldEnv(action_format="json")


def test_env_configs_have_the_switch():
    from omegaconf import OmegaConf

    for name in ("tau2", "terminal", "appworld"):
        assert OmegaConf.load(f"conf/env/{name}.yaml").action_format == "text"


def test_native_reset_text_is_exported_in_openai_format():
    tok, chat, eps, _ = _native_episodes()
    out = episode_messages(eps[0], tok, chat)
    call_msg = out["messages"][2]
    assert call_msg["tool_calls"][0]["function"] == {"name": "add", "arguments": json.dumps({"a": 2, "b": 3})}
    assert out["messages"][3] == {"role": "tool", "tool_call_id": "call_0", "content": "5"}
