"""World-model triplets cut from an epoch's own episodes: (history up to a_t, a_t, the observation s_{t+1}).

Follows RWML (arXiv 2602.05842, self-supervised world-model RL): every transition the policy produced in its own
rollouts is a question "what does the environment answer to this action?", with the env's real answer as the key.
Token-in/token-out: the history is ``Episode.tokens[:steps[t].action_end]`` (the system prompt, every earlier turn and
a_t exactly as sampled), and the next observation is the OBSERVATION-role ids of step t's feedback span, as the
transcript holds them (tokenized once, never re-encoded). The chat scaffold around them and HARNESS text (the adapter's
warnings, "Invalid action...") are never part of the target: they are not the environment's dynamics.

Which steps give a triplet (deliberate choices; the paper does not spell them out):
    * aborted episodes give none (their last transition may be an env crash, not an answer);
    * a step whose feedback turn was dropped (the episode ran out of context) or whose feedback holds no
      OBSERVATION token (the maze answers a malformed action with harness text only) gives none: there is nothing
      to predict;
    * invalid steps are kept by default (``skip_invalid=False``): what the environment answers to an action it
      refuses ("Nothing happens.", "Wall. ...") is part of its dynamics, and a world model that knows which
      actions fail is what a planner needs. RWML's too-easy filter (:mod:`cope.algos.rwml.easy_filter`) already
      thins out the answers that are trivially predictable. ``skip_invalid=True`` drops them;
    * the last step of a finished episode is kept (its feedback, "You reached the goal.", is an observation);
    * native tool calls (``env.action_format=native``): the answer to a call sits in the template's tool-result turn
      (Llama 3.1's ``ipython``, Mistral's ``[TOOL_RESULTS]``); the world-model question still follows a_t as a user
      turn (``Triplet.opening``, the scaffold the transcript holds after a text action), and the target is the tool
      result's OBSERVATION ids.
"""
from __future__ import annotations

from dataclasses import dataclass

from cope.chat import ChatFormat
from cope.episode import Episode, Role


@dataclass(frozen=True)
class Triplet:
    """One transition of an episode as a world-model question.

    Attributes:
        episode: index of the episode in the list it was cut from (or the caller's ``indices``).
        step: t, the action's step.
        history_end: ``steps[t].action_end``: history and a_t are ``Episode.tokens[:history_end]``.
        anchor: where the world-model prompt leaves the transcript: ``history_end`` plus the scaffold that follows
            an action (``ChatFormat.after_action``: the turn end the engine added when the action hit its cap, the
            newline, the user turn's opening), which the transcript holds there too; ``history_end`` itself after a
            native tool call, whose answer came in the template's tool-result turn instead (``opening``).
        observation: s_{t+1}: the OBSERVATION-role ids of step t's feedback span.
        valid: whether the env accepted a_t.
        opening: the scaffold the world-model prompt adds after ``Episode.tokens[:anchor]`` before its user text: empty
            where the transcript holds it; ``ChatFormat.after_action`` after a native tool call (the world-model
            question is a user turn, not the tool's).
    """

    episode: int
    step: int
    history_end: int
    anchor: int
    observation: tuple[int, ...]
    valid: bool
    opening: tuple[int, ...] = ()


def extract_triplets(episodes: list[Episode], chat: ChatFormat, skip_invalid: bool = False,
                     indices: list[int] | None = None) -> list[Triplet]:
    """The triplets of ``episodes`` in episode order, then step order (see the module doc for which steps give one).

    Args:
        episodes: the epoch's episodes.
        chat: the chat scaffold the transcripts were built with.
        skip_invalid: drop the steps the env refused (``Step.valid`` False).
        indices: the episode index stored in each triplet (default: position in ``episodes``).

    Raises:
        ValueError: a feedback span that does not open with the scaffold the rollout loop writes after an action.
    """
    idx = list(indices) if indices is not None else list(range(len(episodes)))
    if len(idx) != len(episodes):
        raise ValueError(f"extract_triplets: {len(idx)} indices for {len(episodes)} episodes")
    out = []
    for ei, ep in zip(idx, episodes):
        if ep.aborted:
            continue
        for t, s in enumerate(ep.steps):
            if s.obs_start < 0 or (skip_invalid and not s.valid):
                continue
            obs = tuple(tok for tok, role in zip(ep.tokens[s.obs_start: s.obs_end], ep.roles[s.obs_start: s.obs_end])
                        if role == Role.OBSERVATION)
            if not obs:
                continue
            opening = chat.after_action(s.closed)
            anchor = s.action_end + len(opening)
            if s.obs_start == s.action_end and ep.tokens[s.action_end: anchor] == opening:
                out.append(Triplet(ei, t, s.action_end, anchor, obs, bool(s.valid)))
            elif s.obs_start == s.action_end and chat.tools is not None:  # a native call, answered in a tool-result turn
                out.append(Triplet(ei, t, s.action_end, s.action_end, obs, bool(s.valid), tuple(opening)))
            else:
                raise ValueError(f"step {t} of episode {ei}: its feedback turn does not open with the scaffold after an "
                                 f"action ({opening}), got {ep.tokens[s.action_end: anchor]}")
    return out


def previous_observation(ep: Episode, step: int) -> tuple[int, ...]:
    """The observation the agent saw right before a_t: the OBSERVATION-role ids between the previous action's end
    (the transcript's start for t = 0: the task's first observation) and a_t's start. What a "world model" that
    repeats the last observation answers (RWML's copy diagnostic, ``rwml/copy_reward``)."""
    start = ep.steps[step - 1].action_end if step else 0
    end = ep.steps[step].action_start
    return tuple(t for t, r in zip(ep.tokens[start:end], ep.roles[start:end]) if r == Role.OBSERVATION)
