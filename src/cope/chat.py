"""Chat scaffold as token ids (ChatML, as Qwen2.5 uses it).

The rollout engine never renders a whole conversation through a chat template and re-tokenizes
it: each scaffold piece is tokenized once here, env text is tokenized on its own, and sampled
action ids are appended verbatim. The transcript is therefore prefix-preserving by construction.
"""
from __future__ import annotations

from dataclasses import dataclass

CHATML_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@dataclass(frozen=True)
class ChatFormat:
    system_open: tuple[int, ...]  # "<|im_start|>system\n"
    user_open: tuple[int, ...]  # "<|im_start|>user\n"
    assistant_open: tuple[int, ...]  # "<|im_start|>assistant\n"
    turn_end: tuple[int, ...]  # "<|im_end|>": the policy's stop token
    newline: tuple[int, ...]  # "\n" after a turn end

    @classmethod
    def chatml(cls, tokenizer) -> "ChatFormat":
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

    @property
    def stop_id(self) -> int:
        return self.turn_end[0]

    def close_turn(self) -> list[int]:
        """After a user/system message: end it and open the assistant turn."""
        return [*self.turn_end, *self.newline, *self.assistant_open]

    def after_action(self, closed: bool) -> list[int]:
        """After a sampled action: add the end-of-turn id if the policy did not sample it, then
        the newline and the opening of the next user turn."""
        return [*(() if closed else self.turn_end), *self.newline, *self.user_open]

    def assistant_joiner(self, closed: bool) -> list[int]:
        """How two consecutive assistant turns are joined when the user turn between them is
        removed (CoPE's action chunks): end-of-turn (if not sampled), newline, assistant open."""
        return [*(() if closed else self.turn_end), *self.newline, *self.assistant_open]
