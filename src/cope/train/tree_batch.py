"""Shared-prefix rows in a training batch: a trunk stored once and the branches that continue it, in one row.

The generic side of tree attention in training (:mod:`cope.train.tree_layout` says who attends whom,
:mod:`cope.train.tree_attention` computes it): :func:`pack_branches` lays rows of "trunk + branches anchored in
it" into padded tensors and their :class:`~cope.train.tree_layout.TreeLayout`; a batch carries that layout as
``batch["tree_layout"]`` (see :class:`cope.train.batch.RolloutBatch`); :func:`batch_tree_layout` gives the forward
the layout of a micro-batch's rows and columns, and refuses a model whose attention would ignore it;
:func:`use_tree_attention` switches a model to ``"cope_tree"`` (which is SDPA whenever no layout is passed, so
rollouts and scoring are unchanged). Who packs what is the caller's business (CoPE's separate forecast update:
:mod:`cope.algos.cope.shared_prefix`).
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import torch

from cope.train.tree_attention import NAME, register
from cope.train.tree_layout import TreeLayout, TreeNode

#: One packed row: the trunk's ids, then each branch as (anchor, ids): the branch continues ``trunk[:anchor]``.
Row = tuple[Sequence[int], Sequence[tuple[int, Sequence[int]]]]


@dataclass(frozen=True)
class PackedRows:
    """Rows of trunk + branches, right padded. Input row ``i`` (a tree) sits in packed row ``row_of[i]`` from column
    ``offset[i]``; ``starts[i][b]``: the column of its branch ``b``.

    ``attention_mask`` is 1 on every trunk and branch token (each packed row is contiguous from column 0) and 0 on
    padding; ``position_ids`` are the layout's: a branch token sits where it would in ``trunk[:anchor] + branch``."""

    input_ids: torch.Tensor  # (N, T) long
    attention_mask: torch.Tensor  # (N, T) long
    position_ids: torch.Tensor  # (N, T) long
    layout: TreeLayout
    starts: tuple[tuple[int, ...], ...]
    row_of: tuple[int, ...]
    offset: tuple[int, ...]


def pack_branches(rows: Sequence[Row], pad_id: int, fill: bool = False, max_row_tokens: int | None = None) -> PackedRows:
    """Lay each input row out as ``[trunk][branch 0][branch 1]...``: the trunk a root node, each branch a child of it
    anchored at its ``anchor`` (``0 <= anchor <= len(trunk)``). An empty trunk is left out and its branches become
    roots (they must then be anchored at 0). ``fill``: the trees go side by side into as few packed rows as
    :func:`fill_rows` finds (rows up to ``max_row_tokens`` or the longest tree; padding drops; nothing attends across
    trees); else one packed row per input row."""
    if not rows:
        raise ValueError("pack_branches needs at least one row")
    nodes, starts, seqs = [], [], []
    for r, (trunk, branches) in enumerate(rows):
        row_nodes, row_starts, seq = [], [], list(trunk)
        if trunk:
            row_nodes.append(TreeNode(0, len(trunk), -1, 0))
        for b, (anchor, ids) in enumerate(branches):
            if not ids or not 0 <= anchor <= len(trunk):
                raise ValueError(f"pack_branches row {r} branch {b}: needs ids and 0 <= anchor={anchor} <= len(trunk)={len(trunk)}")
            row_starts.append(len(seq))
            row_nodes.append(TreeNode(len(seq), len(seq) + len(ids), 0 if trunk else -1, anchor))
            seq.extend(ids)
        if not seq:
            raise ValueError(f"pack_branches row {r} is empty: give it a trunk or a branch")
        nodes.append(tuple(row_nodes))
        starts.append(tuple(row_starts))
        seqs.append(seq)
    bins = fill_rows([len(s) for s in seqs], max_row_tokens) if fill else [[i] for i in range(len(seqs))]
    row_of, offset = [0] * len(seqs), [0] * len(seqs)
    packed_nodes, packed_seqs = [], []
    for p, units in enumerate(bins):
        seq, row_nodes = [], []
        for u in units:
            row_of[u], offset[u] = p, len(seq)
            row_nodes += shifted(nodes[u], len(seq), len(row_nodes))
            seq += seqs[u]
        packed_nodes.append(tuple(row_nodes))
        packed_seqs.append(seq)
    starts = [tuple(c + offset[i] for c in row) for i, row in enumerate(starts)]
    nodes, seqs = packed_nodes, packed_seqs
    N, T = len(seqs), max(len(s) for s in seqs)
    ids = torch.full((N, T), pad_id, dtype=torch.long)  # (N, T)
    attn = torch.zeros(N, T, dtype=torch.long)  # (N, T)
    for r, s in enumerate(seqs):
        ids[r, : len(s)] = torch.tensor(s, dtype=torch.long)
        attn[r, : len(s)] = 1
    layout = TreeLayout(rows=tuple(nodes), length=T)
    return PackedRows(ids, attn, layout.position_ids(), layout, tuple(starts), tuple(row_of), tuple(offset))


def split_to_fit(items: Sequence[int], cost: Callable[[list[int]], int], cap: int | None) -> list[list[int]]:
    """``items`` cut into consecutive groups, each as long as ``cost(group)`` (the tokens of the tree the group would
    make) stays within ``cap``; an item too long alone is a group of its own. None: one group."""
    if cap is None:
        return [list(items)]
    out: list[list[int]] = [[]]
    for i in items:
        if out[-1] and cost(out[-1] + [i]) > cap:
            out.append([])
        out[-1].append(i)
    return out


def fill_rows(lengths: Sequence[int], cap: int | None = None) -> list[list[int]]:
    """Units (trees) of these lengths placed first-fit, longest first, into rows no longer than ``cap`` (a micro-batch's
    token budget: a row is never cut) or the longest unit, whichever is larger: per row, its units' indices in
    placement order. Position ids restart with each unit (each tree's root is a root), so a row of several units
    computes what they compute alone; only padding is saved."""
    cap = max(max(lengths), cap or 0)
    bins: list[list[int]] = []
    room: list[int] = []
    for u in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        k = next((b for b, free in enumerate(room) if free >= lengths[u]), None)
        if k is None:
            bins.append([])
            room.append(cap)
            k = len(bins) - 1
        bins[k].append(u)
        room[k] -= lengths[u]
    return bins


def shifted(nodes: Sequence[TreeNode], shift: int, first: int) -> list[TreeNode]:
    """``nodes`` of one tree moved ``shift`` columns right, placed after ``first`` nodes of the row (parents renumbered)."""
    return [TreeNode(n.start + shift, n.end + shift, n.parent + first if n.parent >= 0 else -1, n.anchor) for n in nodes]


def batch_tree_layout(model, batch: dict, rows: torch.Tensor | None = None, length: int | None = None) -> TreeLayout | None:
    """The tree layout of ``batch`` rows ``rows`` (all: None), first ``length`` columns (all: None), for a forward of
    ``model``; None when the batch has none. A model whose attention is not ``"cope_tree"`` would ignore the layout
    (every branch would attend the rows' other branches): that is refused. A model that checkpoints its layers
    recomputes them in backward anyway, so its layout's ``recompute`` is turned off (one forward of the tile calls
    less per step, and no memory lost: the layer's activations live only during its own backward)."""
    layout = batch.get("tree_layout")
    if layout is None:
        return None
    impl = getattr(model.config, "_attn_implementation", None)
    if impl != NAME:
        raise ValueError(f"this batch packs shared prefixes (tree_layout) but the model's attention is {impl!r}, which would "
                         f"ignore the layout: switch it with cope.train.tree_batch.use_tree_attention(model) ('{NAME}')")
    recompute = layout.recompute and not getattr(model, "is_activation_checkpointing", False)
    if rows is None and length in (None, layout.length) and recompute == layout.recompute:
        return layout
    picked = layout.rows if rows is None else tuple(layout.rows[i] for i in rows.tolist())
    return replace(layout, rows=picked, length=layout.length if length is None else int(length), recompute=recompute)


def use_tree_attention(model) -> None:
    """Register ``"cope_tree"`` and switch ``model`` (a transformers causal LM, peft-wrapped or not) to it. Without a
    layout it computes exactly what ``"sdpa"`` does, so only a model on ``"sdpa"`` is switched (idempotent); any
    other implementation is refused, naming the fix."""
    register()
    impl = getattr(model.config, "_attn_implementation", None)
    if impl == NAME:
        return
    if impl != "sdpa":
        raise ValueError(f"shared-prefix rows need tree attention ('{NAME}'), which is 'sdpa' without a layout; this model "
                         f"runs {impl!r}: load it with model.attn_implementation=sdpa, or turn the sharing off "
                         "(cope.share_prefix=false)")
    model.set_attn_implementation(NAME)
