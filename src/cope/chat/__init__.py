"""Chat scaffold as token ids, taken from the model's own chat template.

The rollout engine never renders a whole conversation through a chat template and re-tokenizes
it: each scaffold piece is tokenized once here, env text is tokenized on its own, and sampled
action ids are appended verbatim. The transcript is therefore prefix-preserving by construction.

The pieces (system/user/assistant openers, the turn end, the newline after it) come from rendering
the tokenizer's chat template (``apply_chat_template``) on sentinel messages and cutting the text at
the sentinels (:meth:`ChatFormat.from_template`), so the same code serves SmolLM2, Qwen2.5 and the
tiny model (all ChatML, ``<|im_start|>role\\n ... <|im_end|>\\n``) and any template of that shape
(Llama 3: ``<|start_header_id|>role<|end_header_id|>\\n\\n ... <|eot_id|>``). The turn end is one
special token (the primary stop id); every eos id of the model's generation config also ends a turn
(``stop_ids``: Qwen2.5 lists ``<|im_end|>`` and ``<|endoftext|>``). tests/test_chat_template.py checks
that a transcript's ids equal the tokenized template rendering of the same messages.

Templates whose turns are closed by role-specific markers rather than one turn end (Mistral:
``[SYSTEM_PROMPT]S[/SYSTEM_PROMPT][INST]U[/INST]A</s>``) are cut too: the text after the system message
and after a user message up to the next opener is kept as ``system_close`` / ``user_close`` (None for
ChatML-shaped templates, where both are the turn end and the newline). Tool calls in the template's own
format, and the tool-result turns, are :class:`cope.chat.tools.ToolTurns` (``ChatFormat.tools``; None when
the template renders no tools).
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from typing import Any

CHATML_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# Message contents the template is rendered with; no whitespace (templates may trim) and no markup.
_SENTINELS = ("COPESENTINELSYSTEM", "COPESENTINELUSERONE", "COPESENTINELASSISTANT", "COPESENTINELUSERTWO")


@dataclass(frozen=True)
class ChatFormat:
    system_open: tuple[int, ...]  # "<|im_start|>system\n"
    user_open: tuple[int, ...]  # "<|im_start|>user\n"
    assistant_open: tuple[int, ...]  # "<|im_start|>assistant\n"
    turn_end: tuple[int, ...]  # "<|im_end|>": the policy's primary stop token
    newline: tuple[int, ...]  # "\n" after a turn end
    stop_ids: tuple[int, ...] = ()  # every id that ends an action (turn end first); () means turn_end
    system_close: tuple[int, ...] | None = None  # after the system text, before user_open (None: turn_end + newline)
    user_close: tuple[int, ...] | None = None  # after a user text, before assistant_open (None: turn_end + newline)
    # tool calls and tool-result turns in the template's own format (cope.chat.tools.ToolTurns); None: no tool support
    tools: Any = field(default=None, compare=False, repr=False)
    tools_note: str = field(default="", compare=False, repr=False)  # why ``tools`` is None (for error messages)

    def __post_init__(self):
        if not self.stop_ids:
            object.__setattr__(self, "stop_ids", tuple(self.turn_end[:1]))
        elif self.turn_end and self.stop_ids[0] != self.turn_end[0]:
            raise ValueError(f"ChatFormat.stop_ids must start with the turn end id {self.turn_end[0]}, got {self.stop_ids}")

    @classmethod
    def chatml(cls, tokenizer) -> "ChatFormat":
        """The ChatML pieces as fixed strings (tokenizers without a chat template; tests)."""
        def enc(s: str) -> tuple[int, ...]:
            return tuple(tokenizer.encode(s, add_special_tokens=False))

        fmt = cls(
            system_open=enc("<|im_start|>system\n"),
            user_open=enc("<|im_start|>user\n"),
            assistant_open=enc("<|im_start|>assistant\n"),
            turn_end=enc("<|im_end|>"),
            newline=enc("\n"),
        )
        if len(fmt.turn_end) != 1:
            raise ValueError(
                "tokenizer does not encode '<|im_end|>' as one special token; the ChatML scaffold needs it "
                f"(got ids {fmt.turn_end})"
            )
        return fmt

    @classmethod
    def from_template(cls, tokenizer, eos_ids: int | Iterable[int] | None = None) -> "ChatFormat":
        """The pieces of ``tokenizer.chat_template``, and the stop ids: the template's turn end, then
        ``eos_ids`` (the model's ``generation_config.eos_token_id``: an int, a list or None).

        A tokenizer without a chat template gets :meth:`chatml`. A template that is not of the shape
        ``[system_open] S [end nl user_open] U [end nl assistant_open] A [end nl user_open] U
        [end nl assistant_open]``, with ``end`` one special token and the same joiners after every
        turn, is a ValueError (the transcript could not match it); the joiners after the system and the user
        text may differ from the one after an assistant turn (``system_close``, ``user_close``: Mistral).
        ``tools``: the tool turns where the template renders tools (:meth:`cope.chat.tools.ToolTurns.from_template`),
        else None with the reason in ``tools_note``."""
        if not getattr(tokenizer, "chat_template", None):
            fmt = cls.chatml(tokenizer)
        else:
            fmt = cls._pieces(tokenizer)
        extra = [eos_ids] if isinstance(eos_ids, int) else list(eos_ids or [])
        stops = tuple(dict.fromkeys([fmt.stop_id, *(int(i) for i in extra)]))
        fmt = replace(fmt, stop_ids=stops)
        from cope.chat.tools import ToolTurns

        turns, note = ToolTurns.from_template(tokenizer, fmt)
        return replace(fmt, tools=turns, tools_note=note)

    @classmethod
    def _pieces(cls, tokenizer) -> "ChatFormat":
        s, u1, a1, u2 = _SENTINELS
        msgs = [{"role": "system", "content": s}, {"role": "user", "content": u1},
                {"role": "assistant", "content": a1}, {"role": "user", "content": u2}]
        text = tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
        parts, rest = [], text
        for sentinel in _SENTINELS:
            head, sep, rest = rest.partition(sentinel)
            if not sep:
                raise ValueError(f"the chat template dropped or reordered a message; rendered: {text!r}")
            parts.append(head)
        p_sys, p_user, p_asst, p_after_asst, p_gen = *parts, rest

        def enc(x: str) -> tuple[int, ...]:
            return tuple(tokenizer.encode(x, add_special_tokens=False))

        first = enc(p_after_asst)[:1]
        end = tokenizer.decode(list(first)) if first else ""
        special = set(getattr(tokenizer, "all_special_ids", [])) | set(getattr(tokenizer, "added_tokens_decoder", {}) or {})
        if not first or first[0] not in special or not p_after_asst.startswith(end) or enc(end) != first:
            raise ValueError(f"the chat template does not end an assistant turn with one special token: {p_after_asst!r}")
        tail = p_after_asst[len(end):]
        newline = tail[: len(tail) - len(tail.lstrip())]
        user_open = tail[len(newline):]
        joiner = end + newline
        if p_gen != p_asst or not user_open or not p_user.endswith(user_open):
            raise ValueError(
                "the chat template's turns are not joined the same way after every message (system, user and "
                f"assistant turns), which the token-level scaffold needs; rendered: {text!r}"
            )
        # ChatML/Llama: every turn closes with end + newline. Mistral: the system and user turns close with markers
        # of their own ([/SYSTEM_PROMPT], [/INST]) and the assistant turn has no opener.
        system_close = None if p_user == p_after_asst else enc(p_user[: len(p_user) - len(user_open)])
        if p_asst.startswith(joiner):
            user_close, assistant_open = None, p_asst[len(joiner):]
        else:
            user_close, assistant_open = enc(p_asst), ""
        return cls(system_open=enc(p_sys), user_open=enc(user_open), assistant_open=enc(assistant_open),
                   turn_end=first, newline=enc(newline), system_close=system_close, user_close=user_close)

    @property
    def stop_id(self) -> int:
        """The primary stop id: the template's turn end (what the engine appends when an action hits the cap)."""
        return self.turn_end[0]

    def system_turn(self, rules: list[int]) -> list[int]:
        """The system turn around the ids of ``rules``, through the opening of the first user turn."""
        close = self.system_close if self.system_close is not None else (*self.turn_end, *self.newline)
        return [*self.system_open, *rules, *close, *self.user_open]

    def close_turn(self) -> list[int]:
        """After a user/system message: end it and open the assistant turn."""
        close = self.user_close if self.user_close is not None else (*self.turn_end, *self.newline)
        return [*close, *self.assistant_open]

    def user_end(self) -> list[int]:
        """What ends the transcript after a last user turn (the episode is over): the turn end (``user_close`` when the
        template closes user turns with a marker of its own)."""
        return list(self.user_close) if self.user_close is not None else list(self.turn_end)

    def after_action(self, closed: bool) -> list[int]:
        """After a sampled action: add the end-of-turn id if the policy did not sample a stop id, then
        the newline and the opening of the next user turn."""
        return [*(() if closed else self.turn_end), *self.newline, *self.user_open]

    def assistant_joiner(self, closed: bool) -> list[int]:
        """How two consecutive assistant turns are joined when the user turn between them is
        removed (CoPE's action chunks): end-of-turn (if not sampled), newline, assistant open."""
        return [*(() if closed else self.turn_end), *self.newline, *self.assistant_open]
