"""An episode as chat messages, and the check that its transcript is what the chat template renders for them.

:func:`episode_messages` reads an episode back into OpenAI chat messages (system, user, assistant turns with
``tool_calls``, ``tool`` results), with the tool list of its system turn: the export behind
``trajectories_messages.jsonl`` (:mod:`cope.callbacks.trajectory_table`) and the reference the check renders.
:func:`check_transcript` renders messages with the tokenizer's own template (``apply_chat_template(..., tools=...)``)
and compares the tokenized text with the transcript before every sampled action and for the whole episode, naming
the first differing token: a dropped separator, a call re-serialized or re-tokenized, a tool result tokenized apart
from the separator after it all show here. The messages should come from outside the transcript (what the env said,
what the actor sampled) for the check to mean something; :func:`episode_messages` is the self-check.

How the messages are read (decoding is for export only; training uses the ids): the system text and the tool list
are cut out of the system turn's text with the template's own head (:meth:`cope.chat.tools.ToolTurns.head` for two
probe tool lists gives the text around the list), the tool list parsed back from the JSON the template rendered.
An action of a native-tool episode is a call where it reads as exactly one call in the template's syntax (as the
rollout loop read it); each feedback turn is the text between the template's own turn pieces.
"""
from __future__ import annotations

import json
import os

from cope.chat import ChatFormat
from cope.chat.calls import CallError, parse_calls
from cope.chat.segments import decode
from cope.chat.tools import PROBE_TOOL
from cope.episode import Episode, Role

_FEEDBACK = (int(Role.OBSERVATION), int(Role.HARNESS))
# a second probe whose JSON differs from the first at its first key and name: the text the two share around the
# list is the template's own
_OTHER_TOOL = {"function": {"name": "zz_other_probe", "description": "COPEOTHER",
                            "parameters": {"type": "object", "properties": {}}}, "type": "function"}


def _json_values(text: str) -> list:
    """Every JSON object or list in ``text``, left to right (the tool list as the template printed it)."""
    out, pos, dec = [], 0, json.JSONDecoder()
    while pos < len(text):
        if text[pos] in "{[":
            try:
                value, end = dec.raw_decode(text, pos)
                out.append(value)
                pos = end
                continue
            except json.JSONDecodeError:
                pass
        pos += 1
    return out


def _split_head(head: str, chat: ChatFormat) -> tuple[str, list[dict] | None]:
    """``(system text, tools)`` of a native-tool episode's head text, or ``(head, None)`` when it is not one."""
    turns = chat.tools
    if turns is None:
        return head, None
    (pre, mid1), (_, mid2) = turns.head([PROBE_TOOL]), turns.head([_OTHER_TOOL])
    lead = os.path.commonprefix([mid1, mid2])
    lead = lead[: lead.rfind("{")] if "{" in lead else lead  # the probes' JSON starts alike: back to its first brace
    tail = os.path.commonprefix([mid1[::-1], mid2[::-1]])[::-1].lstrip("}] \n")
    at = head.find(lead, len(pre)) if head.startswith(pre) else -1
    if at < 0 or not head.endswith(tail):
        return head, None
    found = [v for x in _json_values(head[at + len(lead): len(head) - len(tail)]) for v in (x if isinstance(x, list) else [x])]
    return head[len(pre):at], [t for t in found if isinstance(t, dict) and ("function" in t or "name" in t)]


def _strip(text: str, heads: list[str], tails: list[str]) -> str:
    head = next((h for h in heads if text.startswith(h)), "")
    text = text[len(head):]
    tail = next((t for t in tails if t and text.endswith(t)), "")
    return text[: len(text) - len(tail)]


def episode_messages(episode: Episode, tokenizer, chat: ChatFormat) -> dict:
    """``{"messages": [...], "tools": [...]}`` of ``episode`` in the OpenAI chat format (``tools`` only for a
    native-tool episode). Assistant calls carry ids ``call_<step>`` and the results ``tool_call_id``."""
    t, text = episode.tokens, (lambda ids: decode(tokenizer, ids))
    end = episode.prompt_len or (episode.steps[0].action_start if episode.steps else len(t))
    first = next((k for k, r in enumerate(episode.roles[:end]) if r in _FEEDBACK), None)
    close = text(chat.close_turn())
    head_end = first if first is not None else end - len(chat.close_turn())
    system, tools = _split_head(text(t[:head_end]), chat)
    if tools is None:  # the plain system turn: open, rules, close, user open
        opening = text(chat.system_turn([]))
        cut = len(text(chat.system_open))
        system = system[cut: len(system) - (len(opening) - cut)] if system.startswith(text(chat.system_open)) else system
    messages = [{"role": "system", "content": system},
                {"role": "user", "content": _strip(text(t[head_end:end]), [], [close])}]
    for k, s in enumerate(episode.steps):
        raw = text(t[s.action_start: s.action_start + s.content_len])
        call = None
        if tools is not None:
            try:
                got = parse_calls(chat.tools.syntax, raw)
            except CallError:
                got = None
            if got is not None and len(got[1]) == 1:
                call = got
        if call is None:
            messages.append({"role": "assistant", "content": raw})
        else:
            messages.append({"role": "assistant", "content": call[0] or None, "tool_calls": [call[1][0].openai(f"call_{k}")]})
        if s.obs_start < 0:
            continue
        body = text(t[s.obs_start: s.obs_end])
        end_id = "" if s.closed else text(chat.turn_end)
        if call is not None:
            turns = chat.tools
            content = _strip(body, [end_id + turns.after_call], [turns.result_close, turns.result_end])
            messages.append({"role": "tool", "tool_call_id": f"call_{k}", "content": content})
        else:
            content = _strip(body, [text(chat.after_action(s.closed))], [close, text(chat.user_end())])
            messages.append({"role": "user", "content": content})
    return {"messages": messages, **({"tools": tools} if tools is not None else {})}


def template_messages(messages: list[dict]) -> list[dict]:
    """OpenAI messages as chat templates take them (call arguments as objects, no null content)."""
    out = []
    for m in messages:
        m = dict(m)
        if m.get("tool_calls"):
            m["tool_calls"] = [{"id": c.get("id"), "type": "function", "function": {
                "name": c["function"]["name"], "arguments": json.loads(c["function"]["arguments"])}} for c in m["tool_calls"]]
        if m.get("content") is None:
            m["content"] = ""
        out.append(m)
    return out


def template_ids(tokenizer, messages: list[dict], tools: list[dict] | None, generation_prompt: bool) -> list[int]:
    """The ids of the template's rendering of ``messages`` (OpenAI format), tokenized as one text."""
    text = tokenizer.apply_chat_template(template_messages(messages), tools=tools or None, tokenize=False,
                                         add_generation_prompt=generation_prompt)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def _difference(tokenizer, want: list[int], got: list[int], where: str) -> str:
    k = next((i for i, (a, b) in enumerate(zip(want, got)) if a != b), min(len(want), len(got)))
    return (f"{where}: first difference at token {k}: template {tokenizer.convert_ids_to_tokens(want[k:k + 4])} "
            f"vs transcript {tokenizer.convert_ids_to_tokens(got[k:k + 4])} (after {decode(tokenizer, got[max(0, k - 12):k])!r}; "
            f"lengths {len(want)} vs {len(got)})")


def check_transcript(tokenizer, chat: ChatFormat, episode: Episode, messages: list[dict],
                     tools: list[dict] | None = None) -> list[str]:
    """The differences between ``episode``'s transcript and the template's rendering of ``messages`` (OpenAI format,
    one assistant message per step): before every action (with the generation prompt) and for the whole episode
    (the template may close the last turn with a newline the transcript leaves out). Empty: token-exact."""
    problems = []
    assistant = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    if len(assistant) != episode.num_steps:
        return [f"{len(assistant)} assistant messages for {episode.num_steps} steps"]
    for k, (i, s) in enumerate(zip(assistant, episode.steps)):
        want, got = template_ids(tokenizer, messages[:i], tools, True), episode.tokens[: s.action_start]
        if want != got:
            problems.append(_difference(tokenizer, want, got, f"before action {k}"))
    want = template_ids(tokenizer, messages, tools, False)
    if want not in (episode.tokens, episode.tokens + list(chat.newline)):
        problems.append(_difference(tokenizer, want, episode.tokens, "whole episode"))
    return problems
