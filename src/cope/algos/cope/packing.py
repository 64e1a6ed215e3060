"""Two equivalent ways to lay CoPE forecast chunks (:class:`~cope.algos.cope.chunks.ForecastChunk`) into a
training batch, and the standalone batch of the separate update (:func:`collate_chunks`, one row per chunk: the
reference of :func:`cope.algos.cope.shared_prefix.collate_shared`, ``data.share_prefix=false``).

Layouts of a rollout minibatch (both return a new batch dict, see :class:`cope.batch.RolloutBatch` for the
keys, and add ``forecast_mask`` (N, T) bool, ``forecast_chunk`` (N, T) long (index into ``chunks``, -1
elsewhere), ``forecast_actions`` (C,) long, ``forecast_weight`` (C,) float, and set ``aux_row`` (N,) bool on rows
that are not transcripts; both ignore chunks whose episode has no row in the batch, so they give the same loss):
    * :func:`pack_forecasts`: segments appended after their episode's row. Each row is then a two-level tree (the
      transcript, each segment a branch anchored in it): the batch carries its packed rows (``packed``, the identity
      packing with the rows' :class:`~cope.train.packing.prefix_tree.PrefixTree`), which the model attends through tree
      attention or the tree's dense mask (:func:`cope.train.packing.tree_batch.attention_kwargs`).
    * :func:`plain_forecasts`: one extra row per chunk, ``tokens[:anchor] + chunk``.
"""
from __future__ import annotations

import torch

from cope.algos.cope.chunks import ForecastChunk
from cope.algos.cope.loss import FORECAST
from cope.episode import Episode, Role
from cope.train.packing.segments import Placed, append_rows, pack_segments, target_mask


def _forecast_keys(out: dict, placed: list[Placed], chunks: list[ForecastChunk]) -> dict:
    """``out`` with the forecast keys written from where the chunks landed."""
    shape = tuple(out["input_ids"].shape)
    fchunk = torch.full(shape, -1, dtype=torch.long)  # (N', T')
    for p in placed:
        fchunk[p.row, p.start:p.end] = p.index
    out["forecast_mask"], out["forecast_chunk"] = target_mask(placed, shape), fchunk
    out["forecast_actions"] = torch.tensor([c.num_actions for c in chunks], dtype=torch.long)  # (C,)
    out["forecast_weight"] = torch.tensor([c.weight for c in chunks], dtype=torch.float32)  # (C,)
    return out


def pack_forecasts(batch: dict, episodes: list[Episode], chunks: list[ForecastChunk], pad_id: int) -> dict:
    """Append each chunk after its episode's transcript in the same row, and set ``packed``: the rows as they are,
    each a tree (its transcript the root, each segment a child that sees the transcript up to the segment's anchor):
    :func:`cope.train.packing.segments.pack_segments`.

    Every forecast token lives in a segment, never at a transcript position: a forecast is a cross-entropy under the
    model's own distribution, while transcript action tokens are scored at the sampling temperature for the policy
    gradient (reusing a_t's transcript positions, as this packing did before 2026-12-02, scored the a_t part of a
    forecast at that temperature: packed and plain differed at T != 1). ``attention_mask`` stays 2D (1 on transcript
    and segment tokens, rows right padded). When no chunk is appended, the batch has no ``packed``.
    """
    out, placed = pack_segments(batch, episodes, chunks, pad_id, "pack_forecasts")
    return _forecast_keys(out, placed, chunks)


def plain_forecasts(batch: dict, episodes: list[Episode], chunks: list[ForecastChunk], pad_id: int) -> dict:
    """Each chunk as its own extra row ``tokens[:anchor] + chunk`` with a 2D mask (the reference
    packing: simple, more compute): :func:`cope.train.packing.segments.append_rows`. Extra rows are all
    ``roles=PAD``, so no other objective sees them."""
    out, placed = append_rows(batch, episodes, chunks, pad_id, "plain_forecasts")
    return _forecast_keys(out, placed, chunks)


PACKINGS = {"packed": pack_forecasts, "plain": plain_forecasts}


def collate_chunks(episodes: list[Episode], chunks: list[ForecastChunk], pad_id: int) -> dict:
    """A batch of kind ``forecast`` (CoPE's separate update): one row per chunk, ``tokens[:anchor] + chunk.tokens``,
    right padded, with the forecast keys (``forecast_chunk`` indexes ``chunks``) and no policy-gradient target
    (``action_mask`` all False: every token is scored under the model's own distribution). An empty ``chunks``
    gives one row of a single pad token and no target (the zero-gradient step an idle DDP rank takes)."""
    seqs = [episodes[c.episode].tokens[: c.anchor] + list(c.tokens) for c in chunks] or [[pad_id]]
    N, T = len(seqs), max(len(s) for s in seqs)
    ids = torch.full((N, T), pad_id, dtype=torch.long)  # (N, T)
    attn = torch.zeros(N, T, dtype=torch.long)  # (N, T)
    fmask = torch.zeros(N, T, dtype=torch.bool)  # (N, T)
    fchunk = torch.full((N, T), -1, dtype=torch.long)  # (N, T)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = torch.tensor(s, dtype=torch.long)
        attn[i, : len(s)] = 1
    for i, c in enumerate(chunks):
        fmask[i, c.anchor : c.anchor + len(c.tokens)] = torch.tensor(c.target, dtype=torch.bool)
        fchunk[i, c.anchor : c.anchor + len(c.tokens)] = i
    episode_index = torch.tensor([c.episode for c in chunks] or [-1], dtype=torch.long)
    return forecast_batch(ids, attn, (attn.cumsum(-1) - 1).clamp(min=0), fmask, fchunk, episode_index, chunks)


def forecast_batch(ids: torch.Tensor, attn: torch.Tensor, pos: torch.Tensor, fmask: torch.Tensor, fchunk: torch.Tensor,
                   episode_index: torch.Tensor, chunks: list[ForecastChunk]) -> dict:
    """The batch dict of kind ``forecast`` around rows already laid out: ``ids``, ``attn``, ``pos``, ``fmask``,
    ``fchunk`` (N, T) and ``episode_index`` (N,); the per-chunk keys from ``chunks`` (what ``fchunk`` indexes)."""
    N, T = ids.shape
    return {
        "kind": FORECAST,
        "input_ids": ids,
        "attention_mask": attn,
        "position_ids": pos,
        "roles": torch.full((N, T), int(Role.PAD), dtype=torch.long),
        "step_ids": torch.full((N, T), -1, dtype=torch.long),
        "action_mask": torch.zeros(N, T, dtype=torch.bool),
        "advantages": torch.zeros(N, T),
        "aborted": torch.zeros(N, dtype=torch.bool),
        "episode_index": episode_index,
        "aux_row": torch.ones(N, dtype=torch.bool),
        "forecast_mask": fmask,
        "forecast_chunk": fchunk,
        "forecast_actions": torch.tensor([c.num_actions for c in chunks], dtype=torch.long),  # (C,)
        "forecast_weight": torch.tensor([c.weight for c in chunks], dtype=torch.float32),  # (C,)
    }
