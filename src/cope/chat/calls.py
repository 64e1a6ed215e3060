"""Tool calls as the model writes them: the native call syntaxes of the chat-template families, parsed out of an
assistant turn's text. Pure text, no tokenizer.

Three syntaxes cover the published formats (which one a template uses is found by rendering a probe call with the
template itself, :meth:`cope.chat.tools.ToolTurns.from_template`, never by the model's name):

* ``hermes`` (Qwen2.5, Hermes, SmolLM3 and other ChatML templates): each call is a ``<tool_call>`` block holding one
  JSON object ``{"name": ..., "arguments": {...}}``; text before the first block is the turn's prose.
* ``llama3`` (Llama 3.1 / 3.2 / 3.3 JSON tool calling): the whole turn is one JSON object ``{"name": ...,
  "parameters": {...}}`` (``arguments`` accepted too), optionally after ``<|python_tag|>``.
* ``mistral`` (``[TOOL_CALLS]`` control token): ``[TOOL_CALLS]`` followed by a JSON list of ``{"name": ...,
  "arguments": {...}}`` objects; text before it is the turn's prose.

Where we differ from the servers' parsers (vLLM's ``hermes``, ``llama3_json``, ``mistral``): we are strict. A turn
that opens the markup and does not close it, holds JSON that does not parse, or puts anything but whitespace after the
last call is *malformed* (:class:`CallError`, an invalid step), never silently read as prose: a model in training must
see its broken call refused, or it learns that half a call is a message. ``arguments`` given as a JSON string (an
OpenAI habit) are decoded.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

_HERMES_OPEN, _HERMES_CLOSE = "<tool_call>", "</tool_call>"
_PYTHON_TAG = "<|python_tag|>"
_MISTRAL = "[TOOL_CALLS]"


class CallError(ValueError):
    """The turn holds call markup that is malformed (the message says what, for the harness text)."""


@dataclass(frozen=True)
class ToolCall:
    """One call: the tool's name and its arguments (a JSON object)."""

    name: str
    arguments: dict[str, Any] = field(default_factory=dict)

    def openai(self, call_id: str) -> dict:
        """The call as an OpenAI chat message's ``tool_calls`` entry (``arguments`` as a JSON string)."""
        return {"id": call_id, "type": "function",
                "function": {"name": self.name, "arguments": json.dumps(self.arguments, ensure_ascii=False)}}

    def template(self) -> dict:
        """The call as chat templates take it (``arguments`` as an object, as ``tojson`` renders it)."""
        return {"type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def _call(obj: Any, keys: tuple[str, ...]) -> ToolCall:
    if not isinstance(obj, dict):
        raise CallError("a tool call must be a JSON object with \"name\" and \"arguments\"")
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        raise CallError("a tool call needs \"name\", a non-empty string")
    args_key = next((k for k in keys if k in obj), None)
    extra = sorted(set(obj) - {"name", *keys})
    if extra:
        raise CallError(f"unexpected keys {extra} in the tool call; use \"name\" and \"{keys[0]}\"")
    args = obj.get(args_key, {}) if args_key else {}
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except json.JSONDecodeError as e:
            raise CallError(f"the arguments of {name!r} are a string that is not JSON ({e.msg})") from e
    if args is None:
        args = {}
    if not isinstance(args, dict):
        raise CallError(f"the arguments of {name!r} must be a JSON object")
    return ToolCall(name, args)


def _json(text: str, what: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise CallError(f"{what} is not valid JSON ({e.msg} at character {e.pos})") from e
    except RecursionError as e:
        raise CallError(f"{what} nests too deeply") from e


def parse_hermes(text: str) -> tuple[str, list[ToolCall]] | None:
    """``(prose, calls)`` of a turn in the ``hermes`` syntax, None when it has no ``<tool_call>``."""
    start = text.find(_HERMES_OPEN)
    if start < 0:
        if _HERMES_CLOSE in text:
            raise CallError(f"{_HERMES_CLOSE} without {_HERMES_OPEN}")
        return None
    prose, rest, calls = text[:start].strip(), text[start:], []
    while rest.strip():
        rest = rest.lstrip()
        if not rest.startswith(_HERMES_OPEN):
            raise CallError(f"text after a tool call: {rest[:40]!r}; end the turn after the last {_HERMES_CLOSE}")
        body, sep, rest = rest[len(_HERMES_OPEN):].partition(_HERMES_CLOSE)
        if not sep:
            raise CallError(f"{_HERMES_OPEN} is not closed by {_HERMES_CLOSE}")
        calls.append(_call(_json(body.strip(), "the tool call"), ("arguments", "parameters")))
    return prose, calls


def parse_llama3(text: str) -> tuple[str, list[ToolCall]] | None:
    """``(prose, calls)`` of a turn in the ``llama3`` syntax: a turn that is a JSON object (after an optional
    ``<|python_tag|>``) is a call; None for any other turn."""
    s = text.strip()
    tagged = s.startswith(_PYTHON_TAG)
    s = s[len(_PYTHON_TAG):].strip() if tagged else s
    if not (tagged or s.startswith("{")):
        return None
    obj = _json(s, "the tool call")
    return "", [_call(obj, ("parameters", "arguments"))]


def parse_mistral(text: str) -> tuple[str, list[ToolCall]] | None:
    """``(prose, calls)`` of a turn in the ``mistral`` syntax, None when it has no ``[TOOL_CALLS]``."""
    start = text.find(_MISTRAL)
    if start < 0:
        return None
    prose, body = text[:start].strip(), text[start + len(_MISTRAL):].strip()
    obj = _json(body, "the [TOOL_CALLS] list")
    if isinstance(obj, dict):
        obj = [obj]
    if not isinstance(obj, list) or not obj:
        raise CallError("[TOOL_CALLS] must be followed by a non-empty JSON list of calls")
    return prose, [_call(c, ("arguments", "parameters")) for c in obj]


SYNTAXES = {"hermes": parse_hermes, "llama3": parse_llama3, "mistral": parse_mistral}


def parse_calls(syntax: str, text: str) -> tuple[str, list[ToolCall]] | None:
    """``(prose, calls)`` of an assistant turn's text in ``syntax`` (a key of :data:`SYNTAXES`); None when the turn
    holds no call markup (a plain message); :class:`CallError` when the markup is malformed."""
    if syntax not in SYNTAXES:
        raise ValueError(f"unknown tool-call syntax {syntax!r}; known: {sorted(SYNTAXES)}")
    return SYNTAXES[syntax](text)


def detect_syntax(text: str, expected: ToolCall) -> str | None:
    """The syntax in which ``text`` (a template's rendering of an assistant turn holding ``expected``) reads back as
    exactly that call, or None."""
    for name, parse in SYNTAXES.items():
        try:
            got = parse(text)
        except CallError:
            continue
        if got is not None and got[1] == [expected]:
            return name
    return None
