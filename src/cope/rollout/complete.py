"""Where the first complete action ends inside a sampled action: the format probe of the rollout records.

A policy that answers ``westwest`` (or ``go north and then east``) wrote a complete action and then did not
stop. :func:`complete_prefix_len` finds, at sampling time, the shortest prefix of the sampled ids whose
decoded text is one of the turn's admissible actions (stripped, case-folded); the rollout loop keeps it in
:attr:`cope.episode.Step.complete_len`. Downstream it gives ``*/multi_action`` (a complete action followed by
more sampled text, :func:`cope.rollout.metrics.episode_metrics`) and the position at which the policy should
have emitted its end-of-turn id (the stop-token probability of :class:`cope.callbacks.stop_token.StopTokenStats`).

Only envs that report admissible actions have it (the maze lists its open moves, so a move into a wall has
no complete prefix there: a parsable but inadmissible answer is not counted).
"""
from __future__ import annotations

from collections.abc import Sequence


def _norm(text: str) -> str:
    return text.strip().casefold()


def complete_prefix_len(tokenizer, ids: Sequence[int], admissible: Sequence[str] | None, text: str | None = None) -> int | None:
    """The smallest ``k >= 1`` such that ``decode(ids[:k])`` is an admissible action (None: no such prefix, or
    no admissible list). ``ids`` are the action's content ids (without the end-of-turn id), ``text`` their decoded
    text when the caller has it. No decode when no admissible action starts it; one per prefix otherwise (actions
    are short)."""
    if not admissible or not ids:
        return None
    targets = {_norm(a) for a in admissible if _norm(a)}
    full = _norm(text if text is not None else tokenizer.decode(list(ids), skip_special_tokens=True))
    if not any(full.startswith(t) for t in targets):
        return None
    for k in range(1, len(ids) + 1):
        if _norm(tokenizer.decode(list(ids[:k]), skip_special_tokens=True)) in targets:
            return k
    return None
