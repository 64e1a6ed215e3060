"""Action grammar and prompt text of the tau2-bench adapter (`cope.envs.tau2.env`). Stdlib only.

One action per turn, after :func:`cope.envs.actions.clean_action` (surrounding whitespace, a code
fence, an ``Action:`` label and one layer of quotes are dropped; periods are kept):

* a tool call: one JSON object ``{"name": "<tool>", "arguments": {...}}`` (``arguments`` may be
  left out when empty);
* the end of the conversation: ``{"name": "done", "arguments": {}}`` (tau2's stop signal; the env
  refuses it when only the user may end the conversation);
* a message to the user: plain text, or ``{"respond": "<text>"}``.

Strict otherwise: text that starts with ``{`` must be exactly one such JSON object (a JSON error,
nesting deeper than :data:`MAX_JSON_DEPTH`, extra keys, a non-object ``arguments``, an empty
``respond``, arguments to ``done`` are all malformed); a JSON list (several calls at once) and a Python-style call of a known tool
(``get_users()``) are malformed too. A malformed action never reaches tau2: the step is invalid and
the harness text names the problem.

Native tool calls (``action_format=native``): the tools are OpenAI function schemas (:func:`native_tools`, ``done``
among them), listed by the model's chat template, called in its own syntax; the rollout loop hands the env the call
as one envelope (:mod:`cope.envs.tool_calls`), so there is nothing to parse here. The system prompt
(:func:`build_native_instructions`) says how to act, without a tool list or a JSON format of ours.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from cope.envs.actions import clean_action
from cope.envs.tool_calls import NativeAction, read_action

DONE = "done"
DONE_SCHEMA = {"name": DONE, "description": "End the conversation (call it once the user's request is resolved).",
               "parameters": {"type": "object", "properties": {}}}
_CALL_RE = re.compile(r"^(\w+)\s*\(.*\)$", re.DOTALL)
MAX_JSON_DEPTH = 32  # objects/lists inside one another; tau2's tools take a handful, Python's json recurses

INSTRUCTIONS = """You are a customer service agent. Help the user according to the policy below.
Each turn, answer with exactly one action:
- a tool call, as one JSON object: {"name": "<tool name>", "arguments": {<arguments>}}
- a message to the user, as plain text (or {"respond": "<text>"})
You cannot do both in one turn. Tool results come back as "tool: ...", the user's messages as "user: ...".
"""
AGENT_STOP = 'When the user\'s request is resolved, end the conversation with {"name": "done", "arguments": {}}.'
USER_STOP = "The user ends the conversation when they are done."

SOLO_INSTRUCTIONS = """You are a customer service agent. Solve the ticket in the first message according to the policy below.
You cannot talk to the user: each turn, answer with exactly one tool call, as one JSON object:
{"name": "<tool name>", "arguments": {<arguments>}}
Tool results come back as "tool: ...".
When the ticket is solved, end with {"name": "done", "arguments": {}}."""


NATIVE_INSTRUCTIONS = """You are a customer service agent. Help the user according to the policy below.
Each turn, do exactly one thing: call one of your tools, or write a message to the user as plain text.
The user's messages come back as "user: ..."."""
NATIVE_AGENT_STOP = "When the user's request is resolved, call the tool done."
NATIVE_SOLO = """You are a customer service agent. Solve the ticket in the first message according to the policy below.
You cannot talk to the user: each turn, call exactly one of your tools. When the ticket is solved, call the tool done."""


@dataclass
class Action:
    kind: str  # "tool", "respond" or "done"
    name: str = ""
    arguments: dict[str, Any] = field(default_factory=dict)
    text: str = ""


def parse_action(text: str, tool_names: frozenset[str] | set[str] = frozenset()) -> Action | str:
    """The action named by ``text``, or a string saying why it is malformed (see the module doc)."""
    s = clean_action(text, keep_period=True)
    if not s:
        return "Empty action. Answer with a JSON tool call or a message to the user."
    if s.startswith("["):
        return "One action per turn: send a single JSON object, not a list."
    if s.startswith("{"):
        try:
            obj = json.loads(s)
        except json.JSONDecodeError as e:
            return f"Malformed JSON ({e.msg} at character {e.pos}). Send exactly one JSON object."
        except RecursionError:  # json.loads recurses once per level: a few thousand "[" exhaust the stack
            obj = None
        if obj is None or _too_deep(obj):
            return f"Malformed JSON (nested deeper than {MAX_JSON_DEPTH} levels). Send a flat JSON object."
        if not isinstance(obj, dict):
            return "A JSON action must be an object."
        if "respond" in obj:
            extra = sorted(set(obj) - {"respond"})
            if extra:
                return f"Unexpected keys {extra} next to \"respond\"."
            if not isinstance(obj["respond"], str) or not obj["respond"].strip():
                return "\"respond\" must be a non-empty string."
            return Action("respond", text=obj["respond"].strip())
        if "name" not in obj:
            return "A JSON action needs \"name\" (a tool call) or \"respond\" (a message to the user)."
        extra = sorted(set(obj) - {"name", "arguments"})
        if extra:
            return f"Unexpected keys {extra} in the tool call; use only \"name\" and \"arguments\"."
        name, args = obj["name"], obj.get("arguments", {})
        if not isinstance(name, str) or not name:
            return "\"name\" must be a non-empty string."
        if args is None:
            args = {}
        if not isinstance(args, dict):
            return "\"arguments\" must be a JSON object."
        if name == DONE:
            return "\"done\" takes no arguments." if args else Action("done", name=DONE)
        return Action("tool", name=name, arguments=args)
    match = _CALL_RE.match(s)
    if match and (match.group(1) in tool_names or match.group(1) == DONE):
        return f'Tool calls must be JSON: {{"name": "{match.group(1)}", "arguments": {{...}}}}.'
    return Action("respond", text=s)


def read_native(action: str) -> Action | str:
    """The action of a native-format step (the rollout loop's envelope), or a string saying why it is refused."""
    a: NativeAction = read_action(action)
    if a.kind == "refused":
        return a.text
    if a.kind == "message":
        text = a.text.strip()
        return Action("respond", text=text) if text else "Empty message. Call a tool or write to the user."
    if a.name == DONE:
        return "\"done\" takes no arguments." if a.arguments else Action("done", name=DONE)
    return Action("tool", name=a.name, arguments=a.arguments)


def _too_deep(obj: Any) -> bool:
    """Whether a parsed JSON value nests more than ``MAX_JSON_DEPTH`` containers (iteratively: no recursion)."""
    stack = [(obj, 1)]
    while stack:
        x, depth = stack.pop()
        if isinstance(x, (dict, list)):
            if depth > MAX_JSON_DEPTH:
                return True
            stack.extend((v, depth + 1) for v in (x.values() if isinstance(x, dict) else x))
    return False


def _strip_titles(x: Any) -> Any:
    """A JSON schema without pydantic's ``title`` noise."""
    if isinstance(x, dict):
        return {k: _strip_titles(v) for k, v in x.items() if k != "title" or not isinstance(v, str)}
    if isinstance(x, list):
        return [_strip_titles(v) for v in x]
    return x


def tool_schema_lines(schemas: list[dict], with_done: bool = True) -> str:
    """One compact JSON line per tool: ``{"name", "description", "parameters"}`` (OpenAI function
    schemas, pydantic titles removed), the ``done`` pseudo-tool last (``with_done``)."""
    lines = []
    for s in [*schemas, *([DONE_SCHEMA] if with_done else [])]:
        f = s.get("function", s)
        entry = {"name": f["name"], "description": f.get("description", ""),
                 "parameters": _strip_titles(f.get("parameters", {}))}
        lines.append(json.dumps(entry, separators=(",", ":"), ensure_ascii=False))
    return "\n".join(lines)


def native_tools(schemas: list[dict], with_done: bool = True) -> list[dict]:
    """The tools as OpenAI function schemas (pydantic titles removed), ``done`` last (``with_done``)."""
    out = []
    for s in [*schemas, *([DONE_SCHEMA] if with_done else [])]:
        f = s.get("function", s)
        out.append({"type": "function", "function": {"name": f["name"], "description": f.get("description", ""),
                                                     "parameters": _strip_titles(f.get("parameters", {}))}})
    return out


def build_native_instructions(policy: str | None, solo: bool, agent_stop: bool = True) -> str:
    """The system prompt of the native format: how to act, then the ``<policy>`` block (the tools are the template's)."""
    parts = [NATIVE_SOLO if solo else NATIVE_INSTRUCTIONS + ("\n" + NATIVE_AGENT_STOP if agent_stop else "")]
    if policy is not None:
        parts.append(f"<policy>\n{policy.strip()}\n</policy>")
    return "\n\n".join(parts)


def build_instructions(policy: str | None, schemas: list[dict] | None, solo: bool, agent_stop: bool = True) -> str:
    """The system prompt: action format, then ``<policy>`` and ``<tools>`` blocks when given.
    ``agent_stop=False`` (only the user ends the conversation) leaves ``done`` out."""
    parts = [SOLO_INSTRUCTIONS if solo else INSTRUCTIONS + (AGENT_STOP if agent_stop else USER_STOP)]
    if policy is not None:
        parts.append(f"<policy>\n{policy.strip()}\n</policy>")
    if schemas is not None:
        parts.append(f"<tools>\n{tool_schema_lines(schemas, with_done=agent_stop or solo)}\n</tools>")
    return "\n\n".join(parts)


def example_call(schema: dict) -> str:
    """A well-formed call of ``schema``'s tool with placeholder values for its required arguments
    (format only: the values are not meant to be right)."""
    f = schema.get("function", schema)
    params = f.get("parameters", {})
    props = params.get("properties", {})
    placeholder = {"string": "example", "integer": 1, "number": 1.0, "boolean": True, "array": [], "object": {}}
    args = {}
    for key in params.get("required", []):
        spec = props.get(key, {})
        args[key] = spec["enum"][0] if spec.get("enum") else placeholder.get(spec.get("type", "string"), "example")
    return json.dumps({"name": f["name"], "arguments": args})


def render_messages(messages: list, with_assistant: bool, tool_prefix: bool = True) -> str:
    """The agent-visible tau2 messages, one per line: ``user: <text>`` (not the user's own tool
    calls), ``tool: <result>`` (answers to the agent's calls; the bare result without ``tool_prefix``, the native
    format's tool-result turn) and, with ``with_assistant`` (the reset observation), ``assistant: <text or JSON call>``."""
    lines = []
    for m in messages:
        calls = getattr(m, "tool_calls", None) or []
        if m.role == "user" and not calls:
            lines.append(f"user: {m.content}")
        elif m.role == "tool" and m.requestor == "assistant":
            lines.append(f"tool: {m.content}" if tool_prefix else str(m.content))
        elif m.role == "assistant" and with_assistant:
            shown = [json.dumps({"name": c.name, "arguments": c.arguments}) for c in calls] or [m.content]
            lines.extend(f"assistant: {x}" for x in shown)
    return "\n".join(lines)
