"""Tool turns as token ids, cut from the model's own chat template: the system turn that lists the tools, the call
syntax, and the tool-result turn. The same idea as :class:`cope.chat.ChatFormat`: render the template on sentinel
messages (``apply_chat_template(..., tools=...)``) and cut the text at the sentinels, so every piece is the template's
own text, tokenized once; env text is tokenized on its own and sampled ids are kept verbatim.

A native-tool transcript reads (pieces are PROMPT, the env's texts OBSERVATION/HARNESS, calls ACTION)::

    [head before the rules][rules][head after the rules: tool list, user opener][reset observation][close_turn]
    [sampled call ... turn end][after_call][tool result][harness][result_close][next sampled action] ...

``head`` is rendered per tool list (a task may bring its own tools): the rules and the first user text are cut out
of the template's rendering of ``[system, user]`` with those tools, so wherever the template puts the tool list (the
system turn: Qwen, Mistral; the first user turn: Llama 3.1) it is where the template puts it. ``after_call`` /
``result_close`` / ``result_end`` come from rendering ``[system, user, assistant(call), tool(result)]``. The call
syntax (:mod:`cope.chat.calls`) is the one in which the template's rendering of the probe call reads back.

What is refused (a ValueError at :meth:`ToolTurns.from_template`, the reason kept in ``ChatFormat.tools_note``): a
template that renders no tools, one whose rendering of a tool call is not a prefix-preserving continuation of the
generation prompt, and one whose call markup none of the known syntaxes reads back. Known limit, recorded in
``tools_move``: Mistral-style templates render the tool list before the *last* user message; a conversation with a
user turn after the first (tau2 with a user) therefore cannot be prefix-preserving against such a template, and the
transcript keeps the list where the first user turn saw it (tests/test_tool_calls_conformance.py shows the check
catching it).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from cope.chat.calls import CallError, ToolCall, detect_syntax, parse_calls
from cope.envs.tool_calls import NativeAction, check_call

PROBE = ToolCall("cope_probe_tool", {"cope_arg": "COPEPROBEVALUE"})
PROBE_TOOL = {"type": "function", "function": {
    "name": "cope_probe_tool", "description": "COPEPROBEDESCRIPTION",
    "parameters": {"type": "object", "properties": {"cope_arg": {"type": "string"}}, "required": ["cope_arg"]}}}
_ID = "copecall1"  # nine alphanumerics: what Mistral's templates accept as a call id
_S, _U, _U2, _A, _R = "COPESENTINELSYSTEM", "COPESENTINELUSERONE", "COPESENTINELUSERTWO", "COPESENTINELASSISTANT", "COPESENTINELRESULT"


@dataclass(frozen=True)
class Reading:
    """How the rollout loop reads one sampled turn of a native-tool episode.

    ``kind``: ``call`` (one call, well formed: its feedback is a tool-result turn, even when ``error`` refuses it:
    unknown tool, arguments failing the schema), ``message`` (no call markup: a user turn follows) or ``malformed``
    (broken markup or several calls: a user turn carries the refusal)."""

    kind: str
    call: ToolCall | None = None
    content: str = ""  # the turn's prose outside the call markup
    error: str = ""

    @property
    def tool_turn(self) -> bool:
        return self.kind == "call"

    def action(self, display: str) -> str:
        """The action string for ``Env.step`` (:mod:`cope.envs.tool_calls`); ``display``: the turn's text."""
        if self.kind == "message":
            return NativeAction("message", text=display).encode()
        if self.error:
            return NativeAction("refused", text=self.error).encode()
        return NativeAction("call", self.call.name, self.call.arguments).encode()


@dataclass(frozen=True, eq=False)
class ToolTurns:
    """The tool pieces of one chat template (build with :meth:`from_template`)."""

    tokenizer: Any = field(repr=False)
    syntax: str  # a key of cope.chat.calls.SYNTAXES
    turn_end: tuple[int, ...]  # the template's turn end (what closes a sampled call)
    after_call: str  # after the call's turn end, up to the result text
    result_close: str  # after the result text, through the next assistant opener
    result_end: str  # after the result text when the episode ends there
    tools_move: bool = False  # the template renders the tool list before the last user message (Mistral)
    _heads: dict = field(default_factory=dict, repr=False)

    @classmethod
    def from_template(cls, tokenizer, chat) -> tuple["ToolTurns | None", str]:
        """``(turns, "")``, or ``(None, why)`` when the template has no (usable) tool support."""
        if not getattr(tokenizer, "chat_template", None):
            return None, "the tokenizer has no chat template"
        try:
            return cls._cut(tokenizer, chat), ""
        except Exception as e:  # noqa: BLE001 - a template that raises on the probe (jinja's raise_exception) has no
            return None, f"{type(e).__name__}: {e}"  # usable tool support; the text format must still load

    @classmethod
    def _cut(cls, tok, chat) -> "ToolTurns":
        def render(msgs, tools, gen):
            return tok.apply_chat_template(msgs, tools=tools, tokenize=False, add_generation_prompt=gen)

        base = [{"role": "system", "content": _S}, {"role": "user", "content": _U}]
        with_tools = render(base, [PROBE_TOOL], True)
        if PROBE.name not in with_tools or render(base, None, True) == with_tools:
            raise ValueError("the chat template renders no tools (apply_chat_template(tools=...) leaves the prompt "
                             "as it is)")
        turn = [*base, {"role": "assistant", "content": "", "tool_calls": [{**PROBE.template(), "id": _ID}]},
                {"role": "tool", "name": PROBE.name, "tool_call_id": _ID, "content": _R}]
        full = render(turn, [PROBE_TOOL], True)
        if not full.startswith(with_tools):
            raise ValueError("the chat template's rendering of a tool call does not continue its generation prompt "
                             "(not prefix-preserving)")
        rest, end = full[len(with_tools):], tok.decode(list(chat.turn_end))
        at = rest.find(end)
        if at < 0 or _R not in rest[at:]:
            raise ValueError(f"the chat template does not end a tool-call turn with {end!r}: {rest!r}")
        syntax = detect_syntax(rest[:at], PROBE)
        if syntax is None:
            raise ValueError(f"no known tool-call syntax reads the template's call back: {rest[:at]!r}")
        after_call, result_close = rest[at + len(end):].split(_R)
        final = render(turn, [PROBE_TOOL], False)
        result_end = final[final.rindex(_R) + len(_R):]
        newline = tok.decode(list(chat.newline))
        if newline and result_end.endswith(newline):
            result_end = result_end[: -len(newline)]
        later = render([*base, {"role": "assistant", "content": _A}, {"role": "user", "content": _U2}], [PROBE_TOOL], True)
        moved = later.find(PROBE.name) > later.find(_A)
        return cls(tok, syntax, tuple(chat.turn_end), after_call, result_close, result_end, moved)

    def head(self, tools: list[dict]) -> tuple[str, str]:
        """The template's text before the rules and between the rules and the first user text, for a system turn
        listing ``tools`` (cached per tool list)."""
        key = json.dumps(tools, sort_keys=True)
        if key not in self._heads:
            base = [{"role": "system", "content": _S}, {"role": "user", "content": _U}]
            text = self.tokenizer.apply_chat_template(base, tools=tools, tokenize=False, add_generation_prompt=False)
            pre, _, rest = text.partition(_S)
            self._heads[key] = (pre, rest.partition(_U)[0])
        return self._heads[key]

    def call_text(self, call: ToolCall, content: str = "") -> str:
        """The template's own text of an assistant turn holding ``call`` (after the opener, before the turn end):
        what a model trained on this template writes, and what scripted actors and tests sample."""
        base = [{"role": "system", "content": _S}, {"role": "user", "content": _U}]
        msg = {"role": "assistant", "content": content, "tool_calls": [call.template()]}
        head = self.tokenizer.apply_chat_template(base, tools=[PROBE_TOOL], tokenize=False, add_generation_prompt=True)
        full = self.tokenizer.apply_chat_template([*base, msg], tools=[PROBE_TOOL], tokenize=False)
        return full[len(head):full.rfind(self.tokenizer.decode(list(self.turn_end)))]

    def read(self, text: str, tools: list[dict]) -> Reading:
        """Read a sampled turn (its text with special tokens kept, without the stop id) against ``tools``."""
        try:
            got = parse_calls(self.syntax, text)
        except CallError as e:
            return Reading("malformed", error=f"malformed tool call: {e}")
        if got is None:
            return Reading("message", content=text)
        prose, calls = got
        if len(calls) != 1:
            return Reading("malformed", content=prose, error=f"one tool call per turn, got {len(calls)}")
        problem = check_call(calls[0].name, calls[0].arguments, tools)
        return Reading("call", calls[0], prose, problem or "")


def tools_problem(tokenizer) -> str | None:
    """None when ``tokenizer``'s chat template takes native tool calls (:meth:`ToolTurns.from_template` cuts it), else
    why not: what a config rule on ``env.action_format=native`` asks before any model is built (a tokenizer loads
    without the weights)."""
    from cope.chat import ChatFormat

    try:
        chat = ChatFormat.from_template(tokenizer)
    except ValueError as e:
        return str(e)
    return None if chat.tools is not None else (chat.tools_note or "the chat template renders no tools")
