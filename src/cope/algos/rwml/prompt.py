"""The world-model prompt, token-exact, shared by RWML (the policy samples s_{t+1}) and WM-SFT (it is taught s_{t+1}).

After the transcript up to and including a_t, one extra **user** turn asks the policy to act as the environment, and
the assistant turn that follows is the prediction:

    Episode.tokens[:anchor]                      history h_t, a_t, then the scaffold after an action (ends user_open)
    [Triplet.opening]                            after a native tool call only: that scaffold, which the transcript
                                                 does not hold there (its tool-result turn follows a_t)
    [world-model instruction ids]                the user text, tokenized once (as CoPE's PlanPrompt)
    [turn_end newline assistant_open]            ChatFormat.close_turn(): the model's own assistant header
    target                                       WM-SFT: s_{t+1}'s observation ids + the turn end;
                                                 RWML: the policy's sampled prediction

The shape follows the world-model SFT sample of CoPE's authors' code (ulab-uiuc/CoPE,
``src/verl/agent_trainer/ppo/world_model_loss.py``: the conversation up to the action, a user turn with a
world-model prompt, the observation as the assistant's answer) and is what RWML's policy answers.

Where we deliberately differ from that code:
    * Token-in/token-out: they re-render the conversation through the chat template and re-tokenize it; here the
      prefix is the transcript's own ids and every scaffold piece is :class:`~cope.chat.ChatFormat`'s, so the
      sample decodes to what their rendering gives but conditions on exactly the ids the policy saw;
    * the target is the observation alone: harness text the adapter wrote into the same turn is not the
      environment's (their message content would include it);
    * the loss ends at the turn end (their mask also covers the newline the template renders after it);
    * too long: the sample is dropped and counted, not cut from the left (a left cut changes the history it
      conditions on, and our samples continue the transcript at its own positions);
    * the instruction text is ours.
"""
from __future__ import annotations

from dataclasses import dataclass

from cope.algos.rwml.triplets import Triplet
from cope.chat import ChatFormat
from cope.episode import Episode

DEFAULT_INSTRUCTION = ("Now act as the environment instead of the agent. Given the conversation so far and the agent's "
                       "last action, write the observation the environment returns next, exactly as it would appear, "
                       "and nothing else.")


class WorldModelPrompt:
    """The world-model instruction as ids, tokenized once.

    Args:
        tokenizer: anything with ``encode(text, add_special_tokens=False)``.
        text: the user turn's text (default: :data:`DEFAULT_INSTRUCTION`).
    """

    def __init__(self, tokenizer, text: str | None = None):
        self.text = DEFAULT_INSTRUCTION if text is None else text
        if not self.text.strip():
            raise ValueError("the world-model prompt (rwml.prompt / wm_sft.prompt) is empty")
        self.ids: list[int] = list(tokenizer.encode(self.text, add_special_tokens=False))


@dataclass
class WorldModelSample:
    """One world-model sample: ``Episode.tokens[:anchor]`` of episode ``episode`` continued by ``tokens``.

    The whole sequence is ``tokens[:anchor] + tokens``; ``target`` marks the supervised tokens (WM-SFT: the
    observation and its turn end; an RWML prompt has none)."""

    episode: int
    step: int
    anchor: int
    tokens: list[int]
    target: list[bool]

    def __len__(self) -> int:
        return self.anchor + len(self.tokens)


def prompt_ids(episode: Episode, triplet: Triplet, chat: ChatFormat, prompt: WorldModelPrompt) -> list[int]:
    """The world-model prompt of ``triplet``: its transcript prefix, the instruction and the assistant header (what
    RWML's policy continues with its prediction)."""
    return [*episode.tokens[: triplet.anchor], *triplet.opening, *prompt.ids, *chat.close_turn()]


def target_ids(triplet: Triplet, chat: ChatFormat) -> list[int]:
    """WM-SFT's target: s_{t+1}'s observation ids, then the turn end (the assistant turn is closed, as an action is)."""
    return [*triplet.observation, *chat.turn_end]


def sft_sample(triplet: Triplet, chat: ChatFormat, prompt: WorldModelPrompt) -> WorldModelSample:
    """The WM-SFT sample of ``triplet``: the opening (after a native call), instruction and header (no loss), then the
    target (loss)."""
    head = [*triplet.opening, *prompt.ids, *chat.close_turn()]
    tgt = target_ids(triplet, chat)
    return WorldModelSample(triplet.episode, triplet.step, triplet.anchor, head + tgt,
                            [False] * len(head) + [True] * len(tgt))
