"""Samples that continue a transcript prefix, laid into a rollout minibatch: the two layouts CoPE's forecasts
(:mod:`cope.algos.cope.packing`) and WM-SFT's world-model samples (:mod:`cope.algos.rwml.wm_sft`) share.

A sample (:class:`Continuation`) is the sequence ``episodes[episode].tokens[:anchor] + tokens``, with ``target``
marking its supervised tokens. Both layouts ignore a sample whose episode has no row in the batch, and both return
where each sample's tokens landed (:class:`Placed`), from which the caller writes its own target keys:

* :func:`append_rows` (plain): one extra row per sample, ``tokens[:anchor] + tokens``, 2D mask, every per-token key
  filled as no target (``roles`` PAD, no action), ``aux_row`` True on the new rows: the reference layout, which
  forwards the prefix once per sample.
* :func:`pack_segments` (packed): each sample a segment after its episode's transcript in the same row, the row a
  two-level tree (the transcript the root, each segment a branch, :func:`cope.train.packing.tree_batch.branch`, that
  sees the transcript up to its anchor), set as the batch's ``packed`` (the identity packing with the rows'
  :class:`~cope.train.packing.prefix_tree.PrefixTree`). A segment is ``[tokens[anchor - 1]] + sample.tokens``: the
  repeated token, a non-target, supplies the logits that predict the sample's first token, and its position ids
  continue from ``anchor - 1``, so every token is scored exactly as in the plain row. The prefix is forwarded once
  for all of an episode's samples: per sample only its own tokens and one more. Segment positions are ``roles`` PAD,
  so they are scored untempered (the model's own distribution) and no transcript-level objective reads them. With
  ``data.share_prefix`` the rows then join their group's trie (:func:`cope.train.packing.group_prefix.pack_groups`).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from cope.episode import Episode, Role
from cope.train.packing.prefix_tree import PrefixTree, TreeNode
from cope.train.packing.tree_batch import PackedRows, branch

# Fill values of the known per-token keys on positions a layout adds (other (N, T) keys get 0).
TOKEN_FILL = {"attention_mask": 0, "position_ids": 0, "roles": int(Role.PAD), "step_ids": -1, "action_mask": False,
              "advantages": 0.0}
# Fill values of the known per-row keys on plain rows (other (N, ...) keys get 0).
ROW_FILL = {"aborted": False, "episode_index": -1}


class Continuation(Protocol):
    """What a layout reads of a sample (a :class:`~cope.algos.cope.chunks.ForecastChunk`, a
    :class:`~cope.algos.rwml.prompt.WorldModelSample`)."""

    episode: int
    anchor: int
    tokens: list[int]
    target: list[bool]


@dataclass(frozen=True)
class Placed:
    """Where sample ``index`` landed: row ``row``, columns ``start:end``; ``target`` the targets of those columns."""

    index: int
    row: int
    start: int
    end: int
    target: list[bool]


def rows_of(batch: dict) -> dict[int, int]:
    """Episode index -> its row in ``batch`` (rows of no episode left out)."""
    return {int(e): r for r, e in enumerate(batch["episode_index"].tolist()) if e >= 0}


def check_2d(batch: dict, who: str) -> tuple[int, int]:
    """(N, T) of a batch with collate's 2D attention mask and no packing yet; ValueError naming ``who`` otherwise."""
    am = batch["attention_mask"]
    if am.dim() != 2 or "packed" in batch:
        raise ValueError(f"{who} needs the 2D attention mask of collate, got shape {tuple(am.shape)} "
                         f"(apply one sample layout only)")
    return am.shape[0], am.shape[1]


def widen(batch: dict, N: int, T: int, T_new: int, pad_id: int) -> dict:
    """Copy of ``batch`` with every (N, T, ...) key right padded to ``T_new`` columns (``input_ids`` with
    ``pad_id``, the others with :data:`TOKEN_FILL`)."""
    out = dict(batch)
    if T_new == T:
        return out
    for k, v in batch.items():
        if not torch.is_tensor(v) or v.dim() < 2 or tuple(v.shape[:2]) != (N, T):
            continue
        fill = pad_id if k == "input_ids" else TOKEN_FILL.get(k, 0)
        out[k] = torch.cat([v, torch.full((N, T_new - T, *v.shape[2:]), fill, dtype=v.dtype)], dim=1)  # (N, T_new, ...)
    return out


def pack_segments(batch: dict, episodes: list[Episode], samples: Sequence[Continuation], pad_id: int,
                  who: str) -> tuple[dict, list[Placed]]:
    """The packed layout (module docstring): a new batch whose rows carry their samples as segments, with ``packed``
    set when any was placed, and where each sample landed (its targets after the repeated anchor token, a non-target).
    ValueError naming ``who`` when a sample does not fit its episode's row."""
    N, T = check_2d(batch, who)
    lengths = batch["attention_mask"].sum(-1).tolist()
    rows = rows_of(batch)
    ends = list(lengths)  # next free column per row
    segs = []  # (placed, context length, ids)
    for i, s in enumerate(samples):
        r = rows.get(s.episode)
        if r is None:
            continue
        ep = episodes[s.episode]
        if lengths[r] != len(ep.tokens) or not 1 <= s.anchor <= len(ep.tokens):
            raise ValueError(f"{who}: sample {i} does not match the row of episode {s.episode}")
        ctx, ids = branch(ep.tokens, s.anchor, s.tokens)
        segs.append((Placed(i, r, ends[r], ends[r] + len(ids), [False, *s.target]), ctx, ids))
        ends[r] += len(ids)
    out = widen(batch, N, T, max([T, *ends]), pad_id)
    out.setdefault("aux_row", torch.zeros(N, dtype=torch.bool))  # (N,): no rows added
    if segs:
        ids_t, real = out["input_ids"].clone(), out["attention_mask"].clone()
        trees: list[list[TreeNode]] = [[TreeNode(0, n, -1, 0)] for n in lengths]
        for p, ctx, ids in segs:
            ids_t[p.row, p.start:p.end] = torch.tensor(ids, dtype=torch.long)
            real[p.row, p.start:p.end] = 1
            trees[p.row].append(TreeNode(p.start, p.end, 0, ctx))
        tree = PrefixTree(rows=tuple(tuple(nodes) for nodes in trees), length=ids_t.shape[1])
        out["input_ids"], out["position_ids"], out["attention_mask"] = ids_t, tree.position_ids(), real
        out["packed"] = PackedRows.of_rows(out, tree)
    return out, [p for p, _, _ in segs]


def append_rows(batch: dict, episodes: list[Episode], samples: Sequence[Continuation], pad_id: int,
                who: str) -> tuple[dict, list[Placed]]:
    """The plain layout (module docstring): a new batch with one extra row per placed sample (after the N rows, in
    sample order; ``aux_row`` True on them, the batch's own kept), and where each sample landed."""
    N, T = check_2d(batch, who)
    rows = rows_of(batch)
    keep = [(i, s) for i, s in enumerate(samples) if s.episode in rows]
    seqs = [episodes[s.episode].tokens[: s.anchor] + list(s.tokens) for _, s in keep]
    M, T_new = len(keep), max([T, *(len(q) for q in seqs)])
    out = widen(batch, N, T, T_new, pad_id)
    ids = torch.full((M, T_new), pad_id, dtype=torch.long)  # (M, T_new)
    attn = torch.zeros(M, T_new, dtype=out["attention_mask"].dtype)  # (M, T_new)
    for m, q in enumerate(seqs):
        ids[m, : len(q)] = torch.tensor(q, dtype=torch.long)
        attn[m, : len(q)] = 1
    new = {"input_ids": ids, "attention_mask": attn, "position_ids": (attn.long().cumsum(-1) - 1).clamp(min=0)}
    for k, v in list(out.items()):
        if not torch.is_tensor(v) or v.dim() < 1 or v.shape[0] != N:
            continue
        extra = new.get(k)
        if extra is None:
            extra = torch.full((M, *v.shape[1:]), ROW_FILL.get(k, TOKEN_FILL.get(k, 0)), dtype=v.dtype)
        out[k] = torch.cat([v, extra.to(v.dtype)], dim=0)  # (N + M, ...)
    out["aux_row"] = torch.cat([batch.get("aux_row", torch.zeros(N, dtype=torch.bool)), torch.ones(M, dtype=torch.bool)])
    placed = [Placed(i, N + m, s.anchor, len(q), list(s.target)) for m, ((i, s), q) in enumerate(zip(keep, seqs))]
    return out, placed


def target_mask(placed: Sequence[Placed], shape: tuple[int, int]) -> torch.Tensor:
    """(N, T) bool: the targets of the placed samples."""
    mask = torch.zeros(shape, dtype=torch.bool)
    for p in placed:
        mask[p.row, p.start:p.end] = torch.tensor(p.target, dtype=torch.bool)
    return mask
