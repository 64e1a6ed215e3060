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
from cope.train.packing.prefix_tree import PrefixTree, TreeNode
from cope.train.packing.tree_batch import PackedRows, branch

# Fill values of the known per-token keys on positions a packing adds (other (N, T) keys get 0).
_TOKEN_FILL = {"attention_mask": 0, "position_ids": 0, "roles": int(Role.PAD), "step_ids": -1, "action_mask": False, "advantages": 0.0}
# Fill values of the known per-row keys on plain packing's extra rows (other (N, ...) keys get 0).
_ROW_FILL = {"aborted": False, "episode_index": -1}


def _rows_of(batch: dict) -> dict[int, int]:
    return {int(e): r for r, e in enumerate(batch["episode_index"].tolist()) if e >= 0}


def _check_2d(batch: dict, fn: str) -> tuple[int, int]:
    am = batch["attention_mask"]
    if am.dim() != 2:
        raise ValueError(f"{fn} needs the 2D attention mask of collate, got shape {tuple(am.shape)} (apply one forecast packing only)")
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
    """Append each chunk after its episode's transcript in the same row, and set ``packed``: the rows as they are,
    each a tree (its transcript the root, each segment a child that sees the transcript up to the segment's anchor).

    A segment is a branch (:func:`cope.train.packing.tree_batch.branch`), ``[tokens[anchor - 1]] + chunk.tokens``: it sees
    transcript positions < anchor - 1 and causally itself, and its position ids continue from anchor - 1, so it is
    scored exactly as the sequence ``tokens[:anchor] + chunk.tokens`` (the repeated token, a non-target, supplies the
    logits that predict the chunk's first token). Every forecast token lives in a segment, never at a transcript
    position: a forecast is a cross-entropy under the model's own distribution, while transcript action tokens are
    scored at the sampling temperature for the policy gradient (reusing a_t's transcript positions, as this packing
    did before 2026-12-02, scored the a_t part of a forecast at that temperature: packed and plain differed at
    T != 1). ``attention_mask`` stays 2D (1 on transcript and segment tokens, rows right padded). When no chunk is
    appended, the batch has no ``packed``.
    """
    N, T = _check_2d(batch, "pack_forecasts")
    lengths = batch["attention_mask"].sum(-1).tolist()
    rows = _rows_of(batch)
    ends = list(lengths)  # next free column per row
    segs = []  # (row, first column, context length, ids, targets, chunk id)
    for cid, ch in enumerate(chunks):
        r = rows.get(ch.episode)
        if r is None:
            continue
        ep = episodes[ch.episode]
        if lengths[r] != len(ep.tokens) or not 1 <= ch.anchor <= len(ep.tokens):
            raise ValueError(f"pack_forecasts: chunk {cid} does not match the row of episode {ch.episode}")
        ctx, ids = branch(ep.tokens, ch.anchor, ch.tokens)
        segs.append((r, ends[r], ctx, ids, [False, *ch.target], cid))
        ends[r] += len(ids)
    T_new = max([T, *ends])
    out = _widen(batch, N, T, T_new, pad_id)
    fmask = torch.zeros(N, T_new, dtype=torch.bool)  # (N, T_new)
    fchunk = torch.full((N, T_new), -1, dtype=torch.long)  # (N, T_new)
    if segs:
        ids_t, real = out["input_ids"].clone(), out["attention_mask"].clone()
        for r, c0, _, ids, tgt, cid in segs:
            c1 = c0 + len(ids)
            ids_t[r, c0:c1] = torch.tensor(ids, dtype=torch.long)
            fmask[r, c0:c1] = torch.tensor(tgt, dtype=torch.bool)
            fchunk[r, c0:c1] = cid
            real[r, c0:c1] = 1
        tree = _segment_tree(lengths, segs, T_new)
        out["input_ids"], out["position_ids"], out["attention_mask"] = ids_t, tree.position_ids(), real
        out["packed"] = PackedRows.of_rows(out, tree)
    out["forecast_mask"], out["forecast_chunk"] = fmask, fchunk
    out["forecast_actions"] = torch.tensor([c.num_actions for c in chunks], dtype=torch.long)  # (C,)
    out["forecast_weight"] = torch.tensor([c.weight for c in chunks], dtype=torch.float32)  # (C,)
    out["aux_row"] = batch.get("aux_row", torch.zeros(N, dtype=torch.bool))  # (N,): no rows added
    return out


def _segment_tree(lengths: list[int], segs: list[tuple], length: int) -> PrefixTree:
    """The packed rows as trees: per row, its transcript ``[0, lengths[r])`` (the root) and each segment
    ``(row, first column, context, ids, ...)`` a child that sees the transcript's first ``context`` tokens."""
    rows: list[list[TreeNode]] = [[TreeNode(0, n, -1, 0)] for n in lengths]
    for r, c0, ctx, ids, *_ in segs:
        rows[r].append(TreeNode(c0, c0 + len(ids), 0, ctx))
    return PrefixTree(rows=tuple(tuple(nodes) for nodes in rows), length=length)


def plain_forecasts(batch: dict, episodes: list[Episode], chunks: list[ForecastChunk], pad_id: int) -> dict:
    """Each chunk as its own extra row ``tokens[:anchor] + chunk`` with a 2D mask (the reference
    packing: simple, more compute). Extra rows are all ``roles=PAD``, so no other objective sees them."""
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
    out["forecast_weight"] = torch.tensor([c.weight for c in chunks], dtype=torch.float32)  # (C,)
    out["aux_row"] = torch.cat([torch.zeros(N, dtype=torch.bool), torch.ones(M, dtype=torch.bool)])  # (N + M,): forecasts
    return out


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
