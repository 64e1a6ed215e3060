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
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

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
        turn, is a ValueError (the transcript could not match it)."""
        if not getattr(tokenizer, "chat_template", None):
            fmt = cls.chatml(tokenizer)
        else:
            fmt = cls._pieces(tokenizer)
        extra = [eos_ids] if isinstance(eos_ids, int) else list(eos_ids or [])
        stops = tuple(dict.fromkeys([fmt.stop_id, *(int(i) for i in extra)]))
        return cls(fmt.system_open, fmt.user_open, fmt.assistant_open, fmt.turn_end, fmt.newline, stops)

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
        if p_user != p_after_asst or not p_asst.startswith(joiner) or p_gen != p_asst or not user_open:
            raise ValueError(
                "the chat template's turns are not joined the same way after every message (system, user and "
                f"assistant turns), which the token-level scaffold needs; rendered: {text!r}"
            )
        return cls(system_open=enc(p_sys), user_open=enc(user_open), assistant_open=enc(p_asst[len(joiner):]),
                   turn_end=first, newline=enc(newline))

    @property
    def stop_id(self) -> int:
        """The primary stop id: the template's turn end (what the engine appends when an action hits the cap)."""
        return self.turn_end[0]

    def close_turn(self) -> list[int]:
        """After a user/system message: end it and open the assistant turn."""
        return [*self.turn_end, *self.newline, *self.assistant_open]

    def after_action(self, closed: bool) -> list[int]:
        """After a sampled action: add the end-of-turn id if the policy did not sample a stop id, then
        the newline and the opening of the next user turn."""
        return [*(() if closed else self.turn_end), *self.newline, *self.user_open]

    def assistant_joiner(self, closed: bool) -> list[int]:
        """How two consecutive assistant turns are joined when the user turn between them is
        removed (CoPE's action chunks): end-of-turn (if not sampled), newline, assistant open."""
        return [*(() if closed else self.turn_end), *self.newline, *self.assistant_open]
