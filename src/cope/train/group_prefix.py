"""GRPO groups forwarded with their common prefix once (``data.share_prefix=true``).

The episodes of one GRPO group start with the same tokens: the system prompt, the task, the first observation. A
minibatch normally forwards that prefix once per episode. :func:`pack_groups` (the DataModule's last collate step)
adds a packed view, :class:`RowPack`: per group of the minibatch, one row holding the prefix once (the trunk) and
every episode's remainder as a branch anchored in it (:mod:`cope.train.tree_layout`); such trees and the rows that
share nothing are then placed side by side in fewer rows (position ids restart with each, so padding drops). A branch is
``[prefix[-1]] + episode[P:]`` anchored after ``P - 1`` trunk tokens: its repeated first token sees what the trunk's
last token sees, at the same position, so it predicts the episode's token P inside the branch (the convention of
:mod:`cope.algos.cope.shared_prefix`). Every other row (an episode alone in its group in this minibatch, an extra
row a transform added) is a row of its own.

The batch contract does not change: ``input_ids``, ``roles``, ``advantages`` and every other key stay one row per
episode, and the module's forward returns log-probs and entropies in that shape (:func:`to_rows` gathers them from
the packed rows; a prefix token's log-prob is gathered by every episode of its group, so its gradient sums over
them, as the unshared batch's does). Only the model sees the packed rows. So every objective, the scoring pass
(old and reference log-probs), EMPG and CoPE's temporal ensemble work unchanged.

The same view without any sharing (``share=False``) only places rows side by side, padding removed: CoPE's packed
joint rows, trees already, use it (:func:`cope.algos.cope.layouts.pack_forecast_trees`).

The prefix ends before the group's first action token (so no policy-gradient target is shared; an observation
there, ECHO's target, is gathered by each episode): it is the longest common prefix of the group's ids and roles,
cut at the first ``ACTION`` of any member. Groups whose prefix is shorter than 2 tokens are not packed.
Refused: group sharing of a batch that is already a tree (CoPE's packed joint rows), and any packing of the dense
segment mask's rows.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from cope.episode import Episode, Role
from cope.train.tree_batch import fill_rows, shifted, split_to_fit
from cope.train.tree_layout import TreeLayout, TreeNode

#: Batch keys of layouts that already share within a row (the packed joint CoPE rows): not packable again.
TREE_KEYS = ("tree_layout", "attn_context_end", "attn_segment_start")


@dataclass(frozen=True)
class RowPack:
    """A minibatch's packed view: R packed rows of length L for its N rows of length T.

    Attributes:
        input_ids, attention_mask, position_ids, action_mask: (R, L) the packed rows (the layout's positions;
            ``action_mask`` scattered from the batch's, for the temperature and the entropy).
        layout: the rows' :class:`TreeLayout`.
        index: (N, T) long, ``r * L + c``: where each real token of batch row n sits in the packed rows; -1 on padding.
        members: per packed row, the batch rows it holds (a contiguous slice of packed rows holds the union).
        lengths: per packed row, its real length.
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    position_ids: torch.Tensor
    action_mask: torch.Tensor
    layout: TreeLayout
    index: torch.Tensor
    members: tuple[tuple[int, ...], ...]
    lengths: tuple[int, ...]

    def to(self, device=None, **kwargs) -> RowPack:
        """The same view with its tensors on ``device`` (Lightning moves a batch with ``.to``)."""
        moved = {k: getattr(self, k).to(device, **kwargs) for k in ("input_ids", "attention_mask", "position_ids", "action_mask", "index")}
        return replace(self, **moved)

    @property
    def tokens(self) -> int:
        """Tokens the packed rows forward."""
        return sum(self.lengths)


def pack_groups(batch: dict, episodes: list[Episode], share: bool = True, max_row_tokens: int | None = None) -> dict:
    """``batch`` with ``row_pack`` added (a new dict; every other key unchanged). See the module docstring.

    ``share=False``: no group shares anything; the rows are only placed side by side (padding removed). A batch whose
    rows are trees already (``tree_layout``: CoPE's packed joint rows) can only be packed that way: each row's tree is
    a unit. ``max_row_tokens`` (the module's micro-batch budget): a group whose tree would be longer is split into
    consecutive subgroups that each fit (each shares the prefix once), and rows are filled up to it, so a micro-batch
    holds no more tokens than without the packing."""
    tree = batch.get("tree_layout")
    if (share and tree is not None) or any(k in batch for k in TREE_KEYS[1:]):
        raise ValueError("data.share_prefix packs rollout rows into trees, but this batch is one already (CoPE's packed "
                         "joint rows): use cope.update=separate or cope.packing=plain, or data.share_prefix=false")
    ids, roles, mask = batch["input_ids"], batch["roles"], batch["attention_mask"]
    if mask.dim() != 2:
        raise ValueError(f"pack_groups needs the 2D attention mask of collate, got shape {tuple(mask.shape)}")
    N, T = ids.shape
    lengths = mask.ne(0).sum(-1).tolist()
    aux = batch.get("aux_row", torch.zeros(N, dtype=torch.bool)).tolist()
    clusters: dict[object, list[int]] = {}
    for r, e in enumerate(batch["episode_index"].tolist()):
        key = ("group", episodes[e].group) if share and e >= 0 and not aux[r] else ("row", r)
        clusters.setdefault(key, []).append(r)
    seqs, nodes, members, index = [], [], [], torch.full((N, T), -1, dtype=torch.long)
    places: list[list[tuple[int, int, int]]] = []  # per unit: (batch row, branch start, prefix) to fill index
    for rows in (sub for c in clusters.values() for sub in _fit(c, ids, roles, lengths, max_row_tokens)):
        P = _prefix(ids, roles, rows, lengths) if len(rows) > 1 else 0
        if P < 2:  # nothing worth sharing: each row alone (its own tree, if it is one)
            for r in rows:
                seqs.append(ids[r, : lengths[r]].tolist())
                nodes.append(tree.rows[r] if tree is not None else (TreeNode(0, lengths[r], -1, 0),))
                members.append((r,))
                places.append([(r, 0, 0)])
            continue
        seq, row_nodes, place = ids[rows[0], :P].tolist(), [TreeNode(0, P, -1, 0)], []
        for r in rows:
            start = len(seq)
            seq += ids[r, P - 1: lengths[r]].tolist()  # the prefix's last token, then the episode's own tokens
            row_nodes.append(TreeNode(start, len(seq), 0, P - 1))
            place.append((r, start, P))
        seqs.append(seq)
        nodes.append(tuple(row_nodes))
        members.append(tuple(rows))
        places.append(place)
    seqs, nodes, members, places = _fill_rows(seqs, nodes, members, places, max_row_tokens)
    R, L = len(seqs), max(len(s) for s in seqs)
    packed = torch.zeros(R, L, dtype=torch.long)  # padding: any id (it attends only itself; its outputs are dropped)
    attn = torch.zeros(R, L, dtype=torch.long)
    for p, s in enumerate(seqs):
        packed[p, : len(s)] = torch.tensor(s, dtype=torch.long)
        attn[p, : len(s)] = 1
        for r, start, P, unit in places[p]:
            t = torch.arange(lengths[r])
            col = unit + t if P == 0 else torch.where(t < P, unit + t, start + 1 + t - P)  # prefix in the trunk, the rest in the branch
            index[r, : lengths[r]] = p * L + col
    act = torch.zeros(R * L, dtype=torch.bool)
    real = index >= 0
    act[index[real]] = batch["action_mask"][real]  # a prefix token has several writers, all False (no action in it)
    layout = TreeLayout(rows=tuple(nodes), length=L)
    pack = RowPack(input_ids=packed, attention_mask=attn, position_ids=layout.position_ids(), action_mask=act.view(R, L),
                     layout=layout, index=index, members=tuple(members), lengths=tuple(len(s) for s in seqs))
    return {**batch, "row_pack": pack}


def _fit(rows: list[int], ids: torch.Tensor, roles: torch.Tensor, lengths: list[int], cap: int | None) -> list[list[int]]:
    """``rows`` (one group) cut into consecutive subgroups whose shared tree (prefix once, then each member's rest
    and one repeated token) fits ``cap`` tokens (:func:`cope.train.tree_batch.split_to_fit`)."""
    if cap is None or len(rows) < 2:
        return [rows]
    P = _prefix(ids, roles, rows, lengths)
    return split_to_fit(rows, lambda sub: P + sum(lengths[r] - P + 1 for r in sub), cap)


def _fill_rows(seqs: list, nodes: list, members: list, places: list, cap: int | None) -> tuple[list, list, list, list]:
    """Fewer, fuller rows (:func:`cope.train.tree_batch.fill_rows`): the units (a group's tree, a row alone) side by
    side; a unit after another keeps its own positions and sees nothing of it. Padding per real token drops."""
    out: tuple[list, list, list, list] = ([], [], [], [])
    for units in fill_rows([len(q) for q in seqs], cap):
        seq, row_nodes, row_members, row_places = [], [], [], []
        for u in units:
            row_places += [(r, start + len(seq), P, len(seq)) for r, start, P in places[u]]
            row_nodes += shifted(nodes[u], len(seq), len(row_nodes))
            row_members += members[u]
            seq += seqs[u]
        for lst, item in zip(out, (seq, tuple(row_nodes), tuple(row_members), row_places)):
            lst.append(item)
    return out


def _prefix(ids: torch.Tensor, roles: torch.Tensor, rows: list[int], lengths: list[int]) -> int:
    """Longest common prefix of ``rows`` (ids and roles), cut before the first action token of any of them."""
    n = min(lengths[r] for r in rows)
    same = (ids[rows, :n] == ids[rows[0], :n]).all(0) & (roles[rows, :n] == roles[rows[0], :n]).all(0)  # (n,)
    act = (roles[rows, :n] == int(Role.ACTION)).any(0)  # (n,)
    stop = ~same | act
    return int(stop.float().argmax()) if bool(stop.any()) else n


def packed_plan(pack: RowPack, budget: int | None) -> list[tuple[int, int]]:
    """Packed rows ``[a, b)`` of each micro-batch: consecutive packed rows whose count times their longest length fits
    ``budget`` tokens (one row at least); [(0, R)] without a budget."""
    from cope.train.batch import microbatch_plan

    if budget is None:
        return [(0, len(pack.lengths))]
    return [(a, b) for a, b, _ in microbatch_plan(list(pack.lengths), budget)]


def rows_of(pack: RowPack, a: int, b: int) -> list[int]:
    """The batch rows packed rows ``[a, b)`` hold."""
    return [r for m in pack.members[a:b] for r in m]


def packed_part(pack: RowPack, a: int, b: int) -> tuple[dict, TreeLayout]:
    """Packed rows ``[a, b)`` cut to their longest length: ``input_ids``, ``attention_mask``, ``position_ids``,
    ``action_mask`` (each (b - a, L')) and their layout."""
    n = max(pack.lengths[a:b])
    part = {k: getattr(pack, k)[a:b, :n] for k in ("input_ids", "attention_mask", "position_ids", "action_mask")}
    return part, replace(pack.layout, rows=pack.layout.rows[a:b], length=n)  # kernel, recompute kept


def local_index(pack: RowPack, a: int, width: int, rows: torch.Tensor | None, length: int | None) -> torch.Tensor:
    """(rows, columns) of ``index`` re-expressed as flat positions in a part of packed rows starting at ``a`` cut to
    ``width`` columns (-1 stays -1)."""
    idx = pack.index if rows is None else pack.index[rows]
    if length is not None:
        idx = idx[:, :length]
    L = pack.input_ids.shape[1]
    local = (idx // L - a) * width + idx % L
    return torch.where(idx >= 0, local, -1)


def to_rows(values: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """Gather (P, L', ...) packed values into the batch rows' (n, T', ...) shape; padding gets 0."""
    flat = values.flatten(0, 1)
    out = flat[local.clamp(min=0)]
    pad = local < 0
    return out.masked_fill(pad.view(*pad.shape, *([1] * (out.dim() - pad.dim()))), 0)


def span_of(pack: RowPack, rows: torch.Tensor) -> tuple[int, int]:
    """The packed rows ``[a, b)`` that hold exactly the batch rows ``rows`` (a micro-batch of :func:`packed_plan`)."""
    want = sorted(rows.tolist())
    where = {r: p for p, m in enumerate(pack.members) for r in m}
    a, b = where[want[0]], max(where[r] for r in want) + 1
    if sorted(rows_of(pack, a, b)) != want:
        raise ValueError(f"batch rows {want} are not whole packed rows {a}..{b - 1} of data.share_prefix: cut micro-batches "
                         "with packed_plan")
    return a, b


def packed_logprobs(model, pack: RowPack, rows: torch.Tensor | None, length: int | None, at: torch.Tensor | None,
                    temperature: float, entropy: bool) -> tuple[torch.Tensor, ...]:
    """:func:`cope.train.logprobs.causal_lm_logprobs` of batch rows ``rows`` (all: None), first ``length`` columns,
    computed on their packed rows and gathered back to the rows' shape: (log-probs, entropy[, TE rows]). ``at``:
    (P, 2) [batch row, column] of the TE positions (None: none)."""
    from cope.train.logprobs import causal_lm_logprobs
    from cope.train.tree_batch import batch_tree_layout

    a, b = (0, len(pack.lengths)) if rows is None else span_of(pack, rows)
    part, layout = packed_part(pack, a, b)
    layout = batch_tree_layout(model, {"tree_layout": layout})  # refuses a model whose attention would ignore it
    width = part["input_ids"].shape[1]
    local = local_index(pack, a, width, rows, length)
    at_packed = None
    if at is not None:
        flat = local_index(pack, a, width, None, None)[at[:, 0], at[:, 1]]  # (P,)
        at_packed = torch.stack([flat // width, flat % width], 1)
    act = part["action_mask"]
    lp, ent, *te = causal_lm_logprobs(model, part["input_ids"], part["attention_mask"], part["position_ids"], tempered=act,
                                      temperature=temperature, entropy_mask=act if entropy else None, rows_at=at_packed,
                                      tree_layout=layout)
    # column 0 holds 0 (the log-prob convention): in the packed rows a tree placed after another would read it off
    # that tree's last token
    first = torch.zeros_like(local, dtype=torch.bool)
    first[:, 0] = True
    return (to_rows(lp, local).masked_fill(first, 0.0), to_rows(ent, local).masked_fill(first, 0.0), *te)


def packed_logits(model, pack: RowPack) -> torch.Tensor:
    """Full (N, T, V) logits of the batch rows from their packed rows (probes and tests)."""
    from cope.train.tree_batch import batch_tree_layout

    part, layout = packed_part(pack, 0, len(pack.lengths))
    layout = batch_tree_layout(model, {"tree_layout": layout})
    logits = model(input_ids=part["input_ids"], attention_mask=part["attention_mask"], position_ids=part["position_ids"],
                   use_cache=False, tree_layout=layout).logits  # (R, L, V)
    return to_rows(logits, local_index(pack, 0, logits.shape[1], None, None))
