"""CoPE forecast chunks of the continuation kind (``cope.sample=continuation``), and the chunk record every kind shares.

Follows CoPE (Co-Evolving Acting and Forecasting for Language Agents, arXiv 2610.20597): on
successful on-policy episodes only, from the history h_t (the transcript up to where the policy
wrote a_t) the same policy predicts the action chunk a_t, ..., a_{t+K-1} with the observations
between the actions removed. Chunks are cut at the episode end, so an action a_j is supervised by
up to K histories (the temporal ensemble). Invalid actions give no forecast gradient.

Where we are specific (the paper's full text was not available to us):
    * Actions inside a chunk are joined the way two consecutive assistant turns are joined
      (:meth:`ChatFormat.assistant_joiner`); joiner tokens are inputs, never targets.
    * A chunk with no supervised action (all of its actions invalid and masked) is dropped.
    * The a_t part of the chunk from h_t is the transcript's own a_t (same prefix, same ids, copied into
      the chunk: it is scored untempered, in the chunk, not at its transcript position).

How chunks are laid out in a batch: :mod:`cope.algos.cope.packing`. The authors' prompted sample (the
default since 2026-12-02): :mod:`cope.algos.cope.prompted`.
"""
from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass

from cope.algos.cope.gate import check_gate, kept_episodes
from cope.chat import ChatFormat
from cope.episode import Episode

ANCHORS = ("all", "sample")


@dataclass
class ForecastChunk:
    """One forecast target: from ``Episode.tokens[:anchor]`` of episode ``episode``, continued by ``tokens``.

    The full sequence is ``episode.tokens[:anchor] + tokens``; the loss is on the tokens whose ``target`` is set.
    Continuation chunks anchor at ``steps[t].action_start`` and hold a_t, joiner, a_{t+1}, ...; prompted chunks
    anchor at the end of obs_t's turn and hold the plan-ahead user turn and the assistant's list of actions."""

    episode: int  # index into the epoch's episode list
    step: int  # anchor step t
    anchor: int  # the chunk's input prefix is Episode.tokens[:anchor]
    tokens: list[int]  # what follows the prefix
    target: list[bool]  # per token: a supervised token (the loss mask)
    action_index: list[int]  # per token: the step j whose action it holds, -1 for scaffold tokens
    num_actions: int  # supervised actions in the chunk (>= 1)
    weight: float = 1.0  # the chunk's loss weight (CoPE's group weight, 1/m_g renormalized to mean 1)


def check_chunk_args(K: int, anchors: str, max_anchors_per_episode: int | None) -> None:
    """Cross-field rules of :func:`build_chunks`, also used by the callback at construction."""
    if K < 1:
        raise ValueError(f"forecast K must be >= 1, got {K}")
    if anchors not in ANCHORS:
        raise ValueError(f"forecast anchors must be one of {ANCHORS}, got {anchors!r}")
    if anchors == "sample" and (max_anchors_per_episode is None or max_anchors_per_episode < 1):
        raise ValueError("forecast anchors='sample' needs max_anchors_per_episode >= 1")
    if anchors == "all" and max_anchors_per_episode is not None:
        raise ValueError("forecast max_anchors_per_episode only applies to anchors='sample'")


def _chunk(ep: Episode, ei: int, t: int, chat: ChatFormat, K: int, mask_invalid: bool, cut_at_invalid: bool,
           mask_projected: bool = True) -> ForecastChunk | None:
    toks: list[int] = []
    target: list[bool] = []
    act: list[int] = []
    num = 0
    for j in range(t, min(t + K, len(ep.steps))):
        s = ep.steps[j]
        ok = s.strict if mask_projected else s.valid  # a projected action's tokens are prose, not the format
        if cut_at_invalid and not ok:
            break
        if j > t:
            joiner = chat.assistant_joiner(ep.steps[j - 1].closed)
            toks += joiner
            target += [False] * len(joiner)
            act += [-1] * len(joiner)
        ids = ep.tokens[s.action_start : s.action_end]
        sup = ok or not mask_invalid
        toks += ids
        target += [sup] * len(ids)
        act += [j] * len(ids)
        num += int(sup and len(ids) > 0)
    if num == 0:
        return None
    return ForecastChunk(ei, t, ep.steps[t].action_start, toks, target, act, num)


def build_chunks(
    episodes: list[Episode],
    chat: ChatFormat,
    K: int = 3,
    mask_invalid: bool = True,
    cut_at_invalid: bool = False,
    anchors: str = "all",
    max_anchors_per_episode: int | None = None,
    gate: str = "wins",
    success_threshold: float | None = None,
    rng: random.Random | None = None,
    indices: list[int] | None = None,
    mask_projected: bool = True,
) -> tuple[list[ForecastChunk], dict[str, float]]:
    """Forecast chunks of the qualifying episodes.

    Args:
        episodes: the episodes to build from.
        chat: the chat scaffold (for the joiner between actions).
        K: chunk length in actions (a_t .. a_{t+K-1}, cut at the episode end).
        mask_invalid: invalid actions stay in the chunk as inputs but are not targets.
        cut_at_invalid: stop a chunk before its first invalid action (no chunk anchors at one).
        anchors: ``all`` steps, or ``sample`` up to ``max_anchors_per_episode`` per episode.
        max_anchors_per_episode: the sample size for ``anchors='sample'``.
        gate: which episodes give targets: ``wins``, ``all`` or ``mixed`` (:mod:`cope.algos.cope.gate`, the same rule
            as the authors' samples).
        success_threshold: a win's reward exceeds it (None: the env's success flag).
        rng: for anchor sampling (default ``random.Random(0)``).
        indices: the episode index stored in each chunk (default: position in ``episodes``).
        mask_projected: actions the env read out of free text (``Step.projected``) count as invalid
            here (masked / cut like them): the forecast learns the strict action format only.

    Returns:
        (chunks, metrics): ``forecast/targets`` (chunks), ``forecast/episodes`` (qualifying),
        ``forecast/ensemble_size`` (mean number of chunks supervising an action, over actions
        supervised at least once), ``forecast/masked_frac`` (share of chunk action tokens masked
        as invalid), and the raw counts behind them (``forecast/supervised_actions``,
        ``forecast/supervisions``, ``forecast/action_tokens``, ``forecast/masked_tokens``).
    """
    check_chunk_args(K, anchors, max_anchors_per_episode)
    check_gate(gate)
    rng = rng if rng is not None else random.Random(0)
    idx = list(indices) if indices is not None else list(range(len(episodes)))
    if len(idx) != len(episodes):
        raise ValueError(f"build_chunks: {len(idx)} indices for {len(episodes)} episodes")
    chunks: list[ForecastChunk] = []
    supervised: Counter[tuple[int, int]] = Counter()
    n_eps = action_tokens = masked_tokens = 0
    keep, _ = kept_episodes(episodes, gate, success_threshold)
    for ei, ep, give in zip(idx, episodes, keep):
        if not give:
            continue
        n_eps += 1
        cands = [c for t in range(ep.num_steps)
                 if (c := _chunk(ep, ei, t, chat, K, mask_invalid, cut_at_invalid, mask_projected))]
        if anchors == "sample" and len(cands) > max_anchors_per_episode:
            keep = sorted(rng.sample(range(len(cands)), max_anchors_per_episode))
            cands = [cands[i] for i in keep]
        for c in cands:
            chunks.append(c)
            supervised.update({(ei, j) for j, tg in zip(c.action_index, c.target) if tg})
            action_tokens += sum(1 for j in c.action_index if j >= 0)
            masked_tokens += sum(1 for j, tg in zip(c.action_index, c.target) if j >= 0 and not tg)
    sup_total = sum(supervised.values())
    metrics = {
        "forecast/targets": float(len(chunks)),
        "forecast/episodes": float(n_eps),
        "forecast/ensemble_size": sup_total / len(supervised) if supervised else 0.0,
        "forecast/masked_frac": masked_tokens / action_tokens if action_tokens else 0.0,
        "forecast/supervised_actions": float(len(supervised)),
        "forecast/supervisions": float(sup_total),
        "forecast/action_tokens": float(action_tokens),
        "forecast/masked_tokens": float(masked_tokens),
    }
    return chunks, metrics


