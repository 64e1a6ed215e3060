"""CoPE action-forecast targets, and two equivalent ways to lay them out in a batch.

Follows CoPE (Co-Evolving Acting and Forecasting for Language Agents, arXiv 2610.20597): on
successful on-policy episodes only, from the history h_t (the transcript up to where the policy
wrote a_t) the same policy predicts the action chunk a_t, ..., a_{t+K-1} with the observations
between the actions removed. Chunks are cut at the episode end, so an action a_j is supervised by
up to K histories (the temporal ensemble). Invalid actions give no forecast gradient.

Where we are specific (the paper's full text was not available to us):
    * Actions inside a chunk are joined the way two consecutive assistant turns are joined
      (:meth:`ChatFormat.assistant_joiner`); joiner tokens are inputs, never targets.
    * A chunk with no supervised action (all of its actions invalid and masked) is dropped.
    * The a_t part of the chunk from h_t is the transcript's own a_t (same prefix, same ids): the
      packed layout reuses those transcript positions and only appends the rest of the chunk.

Layouts (both return a new batch dict, see ``cope.train.batch`` for the keys, and add ``forecast_mask``
(N, T) bool, ``forecast_chunk`` (N, T) long (index into ``chunks``, -1 elsewhere),
``forecast_actions`` (C,) long, and set ``aux_row`` (N,) bool on rows that are not transcripts; both ignore chunks whose episode
has no row in the batch, so they give the same loss):
    * :func:`pack_forecasts`: segments appended after their episode's row, segment attention (O(N T)
      in the batch; the (T, T) mask exists only per forward, as bool for SDPA).
    * :func:`plain_forecasts`: one extra row per chunk, ``tokens[:anchor] + chunk``.
"""
from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass

import torch

from cope.chat import ChatFormat
from cope.episode import Episode, Role

ANCHORS = ("all", "sample")
# Fill values of the known per-token keys on positions a layout adds (other (N, T) keys get 0).
_TOKEN_FILL = {"attention_mask": 0, "position_ids": 0, "roles": int(Role.PAD), "step_ids": -1, "action_mask": False, "advantages": 0.0}
# Fill values of the known per-row keys on the plain layout's extra rows (other (N, ...) keys get 0).
_ROW_FILL = {"aborted": False, "episode_index": -1}


@dataclass
class ForecastChunk:
    """One forecast target: from ``tokens[:anchor]`` of episode ``episode``, predict ``tokens``."""

    episode: int  # index into the epoch's episode list
    step: int  # anchor step t
    anchor: int  # steps[t].action_start: the chunk's input prefix is Episode.tokens[:anchor]
    tokens: list[int]  # a_t, joiner, a_{t+1}, ... (observations removed)
    target: list[bool]  # per token: a supervised action token
    action_index: list[int]  # per token: the step j it belongs to, -1 for joiner tokens
    num_actions: int  # supervised actions in the chunk (>= 1)


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


def qualifies(ep: Episode, success_only: bool = True, min_score: float | None = None) -> bool:
    """Whether an episode gives forecast targets: not aborted, and successful (or score >= min_score)."""
    if ep.aborted:
        return False
    if min_score is not None:
        return ep.score >= min_score
    return ep.success or not success_only


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
    success_only: bool = True,
    min_score: float | None = None,
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
        success_only: only successful episodes qualify (ignored when ``min_score`` is given).
        min_score: episodes with ``score >= min_score`` qualify instead.
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
    rng = rng if rng is not None else random.Random(0)
    idx = list(indices) if indices is not None else list(range(len(episodes)))
    if len(idx) != len(episodes):
        raise ValueError(f"build_chunks: {len(idx)} indices for {len(episodes)} episodes")
    chunks: list[ForecastChunk] = []
    supervised: Counter[tuple[int, int]] = Counter()
    n_eps = action_tokens = masked_tokens = 0
    for ei, ep in zip(idx, episodes):
        if not qualifies(ep, success_only, min_score):
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


def _rows_of(batch: dict) -> dict[int, int]:
    return {int(e): r for r, e in enumerate(batch["episode_index"].tolist()) if e >= 0}


def _check_2d(batch: dict, fn: str) -> tuple[int, int]:
    am = batch["attention_mask"]
    if am.dim() != 2:
        raise ValueError(f"{fn} needs the 2D attention mask of collate, got shape {tuple(am.shape)} (apply one forecast layout only)")
    return am.shape[0], am.shape[1]


def _widen(batch: dict, N: int, T: int, T_new: int, pad_id: int) -> dict:
    """Copy of ``batch`` with every (N, T, ...) key padded to T_new columns."""
    out = dict(batch)
    for k, v in batch.items():
        if not torch.is_tensor(v) or v.dim() < 2 or tuple(v.shape[:2]) != (N, T) or k in _ROW_FILL or T_new == T:
            continue
        fill = pad_id if k == "input_ids" else _TOKEN_FILL.get(k, 0)
        ext = torch.full((N, T_new - T, *v.shape[2:]), fill, dtype=v.dtype)
        out[k] = torch.cat([v, ext], dim=1)  # (N, T_new, ...)
    return out


def pack_forecasts(batch: dict, episodes: list[Episode], chunks: list[ForecastChunk], pad_id: int) -> dict:
    """Append each chunk after its episode's transcript in the same row, with segment attention
    (``attn_context_end``, ``attn_segment_start``: see :func:`cope.train.batch.segment_attention`).

    The chunk's a_t is scored at its transcript positions; the appended segment (joiner, a_{t+1},
    ...) anchors at ``steps[t].action_end``: it attends to transcript positions < action_end and
    causally to itself, and its position ids continue from there. When a segment would open with a
    target token (an empty joiner), the token before it is repeated first as a non-target, because
    the first column of a segment is scored from the previous column's logits, which belong to
    something else. ``attention_mask`` stays 2D (1 on transcript and segment tokens, rows right padded).
    When no segment is appended, the batch has no segment keys.
    """
    N, T = _check_2d(batch, "pack_forecasts")
    lengths = batch["attention_mask"].sum(-1).tolist()
    rows = _rows_of(batch)
    ends = list(lengths)  # next free column per row
    segs = []  # (row, first column, context length, position of first token, ids, targets, chunk id)
    marks = []  # (row, column, target, chunk id) for a_t at its transcript positions
    for cid, ch in enumerate(chunks):
        r = rows.get(ch.episode)
        if r is None:
            continue
        ep = episodes[ch.episode]
        s = ep.steps[ch.step]
        if lengths[r] != len(ep.tokens) or ch.anchor != s.action_start:
            raise ValueError(f"pack_forecasts: chunk {cid} does not match the row of episode {ch.episode}")
        n0 = s.action_end - s.action_start
        if ch.tokens[:n0] != ep.tokens[s.action_start : s.action_end]:
            raise ValueError(f"pack_forecasts: chunk {cid} does not start with its anchor action")
        marks += [(r, s.action_start + i, ch.target[i], cid) for i in range(n0)]
        ids, tgt, ctx = list(ch.tokens[n0:]), list(ch.target[n0:]), s.action_end
        if not ids:
            continue
        if tgt[0]:
            ids, tgt, ctx = [ep.tokens[ctx - 1], *ids], [False, *tgt], ctx - 1
        segs.append((r, ends[r], ctx, ids, tgt, cid))
        ends[r] += len(ids)
    T_new = max([T, *ends])
    out = _widen(batch, N, T, T_new, pad_id)
    fmask = torch.zeros(N, T_new, dtype=torch.bool)  # (N, T_new)
    fchunk = torch.full((N, T_new), -1, dtype=torch.long)  # (N, T_new)
    for r, col, tg, cid in marks:
        fmask[r, col], fchunk[r, col] = tg, cid
    if segs:
        # segment attention, O(N * T) (cope.train.batch.segment_attention builds the (T, T) mask per forward):
        # query i sees keys j < context_end[i] and segment_start[i] <= j <= i. Transcript: (0, 0), causal;
        # padding: (0, i), itself only; a segment: (anchor context, its first column).
        col = torch.arange(T_new)
        ctx_end = torch.zeros(N, T_new, dtype=torch.long)  # (N, T_new)
        seg_start = torch.where(col[None] < torch.tensor(lengths)[:, None], 0, col[None]).clone()  # (N, T_new)
        ids_t, pos_t, real = out["input_ids"].clone(), out["position_ids"].clone(), out["attention_mask"].clone()
        for r, c0, ctx, ids, tgt, cid in segs:
            c1 = c0 + len(ids)
            ids_t[r, c0:c1] = torch.tensor(ids, dtype=torch.long)
            pos_t[r, c0:c1] = torch.arange(ctx, ctx + len(ids))
            fmask[r, c0:c1] = torch.tensor(tgt, dtype=torch.bool)
            fchunk[r, c0:c1] = cid
            ctx_end[r, c0:c1] = ctx  # the history h_t (up to the anchor)
            seg_start[r, c0:c1] = c0  # causal inside the segment
            real[r, c0:c1] = 1
        out["attn_context_end"], out["attn_segment_start"] = ctx_end, seg_start
        out["input_ids"], out["position_ids"], out["attention_mask"] = ids_t, pos_t, real
    out["forecast_mask"], out["forecast_chunk"] = fmask, fchunk
    out["forecast_actions"] = torch.tensor([c.num_actions for c in chunks], dtype=torch.long)  # (C,)
    out["aux_row"] = batch.get("aux_row", torch.zeros(N, dtype=torch.bool))  # (N,): no rows added
    return out


def plain_forecasts(batch: dict, episodes: list[Episode], chunks: list[ForecastChunk], pad_id: int) -> dict:
    """Each chunk as its own extra row ``tokens[:anchor] + chunk`` with a 2D mask (the reference
    layout: simple, more compute). Extra rows are all ``roles=PAD``, so no other objective sees them."""
    N, T = _check_2d(batch, "plain_forecasts")
    rows = _rows_of(batch)
    keep = [(cid, ch) for cid, ch in enumerate(chunks) if ch.episode in rows]
    seqs = [episodes[ch.episode].tokens[: ch.anchor] + list(ch.tokens) for _, ch in keep]
    M = len(keep)
    T_new = max([T, *(len(s) for s in seqs)])
    out = _widen(batch, N, T, T_new, pad_id)
    fmask = torch.zeros(N + M, T_new, dtype=torch.bool)  # (N + M, T_new)
    fchunk = torch.full((N + M, T_new), -1, dtype=torch.long)  # (N + M, T_new)
    ids = torch.full((M, T_new), pad_id, dtype=torch.long)  # (M, T_new)
    attn = torch.zeros(M, T_new, dtype=out["attention_mask"].dtype)  # (M, T_new)
    for m, ((cid, ch), seq) in enumerate(zip(keep, seqs)):
        ids[m, : len(seq)] = torch.tensor(seq, dtype=torch.long)
        attn[m, : len(seq)] = 1
        fmask[N + m, ch.anchor : len(seq)] = torch.tensor(ch.target, dtype=torch.bool)
        fchunk[N + m, ch.anchor : len(seq)] = cid
    pos = (attn.cumsum(-1) - 1).clamp(min=0)  # (M, T_new), as collate does
    for k, v in list(out.items()):
        if not torch.is_tensor(v) or v.dim() < 1 or v.shape[0] != N:
            continue
        if k == "input_ids":
            extra = ids
        elif k == "attention_mask":
            extra = attn
        elif k == "position_ids":
            extra = pos
        else:
            fill = _ROW_FILL.get(k, _TOKEN_FILL.get(k, 0))
            extra = torch.full((M, *v.shape[1:]), fill, dtype=v.dtype)
        out[k] = torch.cat([v, extra], dim=0)  # (N + M, ...)
    out["forecast_mask"], out["forecast_chunk"] = fmask, fchunk
    out["forecast_actions"] = torch.tensor([c.num_actions for c in chunks], dtype=torch.long)  # (C,)
    out["aux_row"] = torch.cat([torch.zeros(N, dtype=torch.bool), torch.ones(M, dtype=torch.bool)])  # (N + M,): forecasts
    return out


LAYOUTS = {"packed": pack_forecasts, "plain": plain_forecasts}
