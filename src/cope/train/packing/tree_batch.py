"""The packed batch: the one form in which a training batch carries shared prefixes, and the one forward over it.

A batch's rows (one per episode, or per forecast sample) are its *logical* rows: every objective reads them. What the
model forwards are :class:`PackedRows`: packed rows holding trees (:class:`~cope.train.packing.prefix_tree.PrefixTree`: a
prefix stored once, branches continuing it), with ``index``, where each logical token sits in the packed rows. A
batch that packs prefixes carries them as ``batch["packed"]`` (:func:`packs_prefixes`, the one predicate). Its three
producers all go through the one packer, :func:`pack` (units placed side by side in as few rows as fit the
micro-batch budget, :func:`fill_rows`):

* GRPO groups (``data.share_prefix``): :func:`cope.train.packing.group_prefix.pack_groups`, each group the trie of its
  rows (every shared token once, a branched group's shared turns too); a side view, the logical rows stay one per
  episode.
* CoPE's joint rows (``cope.packing=packed``): each row a transcript with its forecast segments as branches
  (:func:`cope.algos.cope.packing.pack_forecasts`), rows packed as they are (:meth:`PackedRows.of_rows`), then
  joined into their group's trie by ``pack_groups`` when ``data.share_prefix`` is on.
* CoPE's separate forecast steps: the packed rows are the logical rows (:meth:`PackedRows.as_rows`, identity index).

A batch without ``packed`` is seen as the identity packing of its own rows with no tree (:func:`packed_view`), so
the module runs one code path for every batch (:func:`packed_logprobs`). A tree's token is scored from the output
of its predecessor in the sequence it stands for (:meth:`~cope.train.packing.prefix_tree.PrefixTree.predecessors`),
so a node's first token reads its parent's last visible token: the group trie stores nothing twice. CoPE's packers
still start each branch with the token before its anchor, repeated (:func:`branch`), a non-target whose own
predecessor is then the token before it.

How the model attends a tree is decided in one place, :func:`attention_kwargs`: a model on ``"cope_tree"`` (switched
by :func:`use_tree_attention`, which only the DataModule calls, when ``data.share_prefix`` is on) computes only the
cells a query sees; any other model gets the tree's dense (N, 1, T, T) mask, the exact reference (what
``data.share_prefix=false`` runs for CoPE's packed joint rows).
"""
from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace

import torch

from cope.train.objectives import TokenScores
from cope.train.packing.prefix_tree import PrefixTree, TreeNode
from cope.train.packing.tree_attention import NAME, register

_ROW_KEYS = ("input_ids", "attention_mask", "position_ids", "action_mask")


def branch(tokens: Sequence[int], anchor: int, rest: Sequence[int]) -> tuple[int, list[int]]:
    """``tokens[:anchor] + rest`` as a branch of a trunk holding ``tokens``: (how many trunk tokens it sees, its ids).
    The branch is ``[tokens[anchor - 1]] + rest`` after ``anchor - 1`` trunk tokens (see the module docstring)."""
    if not 1 <= anchor <= len(tokens):
        raise ValueError(f"a branch anchors after 1..{len(tokens)} tokens, got anchor={anchor}")
    return anchor - 1, [tokens[anchor - 1], *rest]


@dataclass(frozen=True)
class Unit:
    """One tree to place in a packed row: its ``ids``, its ``nodes`` (columns from 0) and ``places``: per logical
    row it holds, (row, the unit's column of each of the row's tokens)."""

    ids: list[int]
    nodes: tuple[TreeNode, ...]
    places: tuple[tuple[int, list[int]], ...] = ()


@dataclass(frozen=True)
class PackedRows:
    """R packed rows of length L standing for N logical rows of length T.

    Attributes:
        input_ids, attention_mask, position_ids, action_mask: (R, L) the packed rows (``attention_mask`` 1 on real
            tokens, or a transform's own 4D mask on an identity packing; ``position_ids`` the tree's).
        tree: the rows' :class:`PrefixTree` (None: plain causal rows).
        index: (N, T) long, ``r * L + c``: where each real token of logical row n sits; -1 on padding.
        members: per packed row, the logical rows it holds.
        lengths: per packed row, its real length.
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    position_ids: torch.Tensor
    action_mask: torch.Tensor
    tree: PrefixTree | None
    index: torch.Tensor
    members: tuple[tuple[int, ...], ...]
    lengths: tuple[int, ...]

    @classmethod
    def of_rows(cls, batch: dict, tree: PrefixTree | None = None) -> PackedRows:
        """The identity packing: the packed rows are ``batch``'s rows (with ``tree``, or plain)."""
        from cope.batch import row_lengths

        ids, mask = batch["input_ids"], batch["attention_mask"]
        N, T = ids.shape
        real = mask.ne(0) if mask.dim() == 2 else torch.ones(N, T, dtype=torch.bool, device=ids.device)
        flat = torch.arange(N * T, device=ids.device).view(N, T)
        return cls(input_ids=ids, attention_mask=mask, position_ids=batch["position_ids"], action_mask=batch["action_mask"],
                   tree=tree, index=torch.where(real, flat, -1), members=tuple((r,) for r in range(N)),
                   lengths=tuple(row_lengths(batch).tolist()))

    def as_rows(self) -> PackedRows:
        """The same packed rows as their own logical rows (identity index): a batch whose rows are already packed."""
        return PackedRows.of_rows({k: getattr(self, k) for k in _ROW_KEYS}, self.tree)

    def to(self, device=None, **kwargs) -> PackedRows:
        """The same rows with their tensors on ``device`` (Lightning moves a batch with ``.to``)."""
        return replace(self, **{k: getattr(self, k).to(device, **kwargs) for k in (*_ROW_KEYS, "index")})

    @property
    def tokens(self) -> int:
        """Tokens the packed rows forward."""
        return sum(self.lengths)

    def micro_batches(self, budget: int | None) -> list[tuple[torch.Tensor | None, int | None]]:
        """(logical rows, their longest length) per micro-batch: whole consecutive packed rows whose count times their
        longest length fits ``budget`` tokens (one row at least); [(None, None)]: all at once."""
        from cope.batch import microbatch_plan

        if budget is None:
            return [(None, None)]
        lengths = self.index.ge(0).sum(-1).tolist()  # logical rows' real lengths
        out = []
        for a, b, _ in microbatch_plan(list(self.lengths), budget):
            rows = sorted(r for m in self.members[a:b] for r in m)
            out.append((torch.tensor(rows, device=self.index.device), max(lengths[r] for r in rows)))
        return out

    def span(self, rows: torch.Tensor | None) -> tuple[int, int]:
        """The packed rows ``[a, b)`` holding exactly the logical ``rows`` (all: None)."""
        if rows is None:
            return 0, len(self.lengths)
        want = sorted(rows.tolist())
        where = {r: p for p, m in enumerate(self.members) for r in m}
        a, b = where[want[0]], max(where[r] for r in want) + 1
        if sorted(r for m in self.members[a:b] for r in m) != want:
            raise ValueError(f"rows {want} are not whole packed rows {a}..{b - 1}: cut micro-batches with PackedRows.micro_batches")
        return a, b

    def part(self, a: int, b: int) -> tuple[dict, PrefixTree | None]:
        """Packed rows ``[a, b)`` cut to their longest length: the row tensors and their tree."""
        n = max(self.lengths[a:b])
        part = {k: getattr(self, k)[a:b, :n] for k in _ROW_KEYS if k != "attention_mask"}
        mask = self.attention_mask[a:b]
        part["attention_mask"] = mask[:, :n] if mask.dim() == 2 else mask[..., :n, :n]
        tree = None if self.tree is None else self.tree.replace(rows=self.tree.rows[a:b], length=n)  # recompute kept
        return part, tree

    def local_index(self, a: int, width: int, rows: torch.Tensor | None = None, length: int | None = None) -> torch.Tensor:
        """``index`` of logical ``rows`` (all: None), first ``length`` columns, as flat positions in the part of packed
        rows starting at ``a`` cut to ``width`` columns (-1 stays -1)."""
        idx = self.index if rows is None else self.index[rows]
        if length is not None:
            idx = idx[:, :length]
        L = self.input_ids.shape[1]
        return torch.where(idx >= 0, (idx // L - a) * width + idx % L, -1)


def packs_prefixes(batch: dict) -> bool:
    """Whether ``batch`` carries packed rows (``batch["packed"]``): the one predicate."""
    return batch.get("packed") is not None


def packed_view(batch: dict) -> PackedRows:
    """``batch["packed"]``, or the identity packing of the batch's own rows."""
    return batch["packed"] if packs_prefixes(batch) else PackedRows.of_rows(batch)


def pack(units: Sequence[Unit], n_rows: int, width: int, pad_id: int, cap: int | None = None,
         action_mask: torch.Tensor | None = None) -> PackedRows:
    """The one packer: ``units`` placed side by side in as few packed rows as :func:`fill_rows` finds (rows up to
    ``cap``, the micro-batch budget, or the longest unit; a unit after another keeps its own positions and sees
    nothing of it). ``n_rows`` x ``width``: the logical rows the units' ``places`` refer to (0: none, see
    :meth:`PackedRows.as_rows`); ``action_mask`` (n_rows, width): theirs, scattered into the packed rows."""
    if not units:
        raise ValueError("pack needs at least one unit")
    seqs, nodes, members, places = [], [], [], []
    for bin_ in fill_rows([len(u.ids) for u in units], cap):
        seq, row_nodes, row_members, row_places = [], [], [], []
        for u in (units[i] for i in bin_):
            row_nodes += shifted(u.nodes, len(seq), len(row_nodes))
            row_members += [r for r, _ in u.places]
            row_places += [(r, [c + len(seq) for c in cols]) for r, cols in u.places]
            seq += u.ids
        seqs.append(seq)
        nodes.append(tuple(row_nodes))
        members.append(tuple(row_members))
        places.append(row_places)
    R, L = len(seqs), max(len(s) for s in seqs)
    ids = torch.full((R, L), pad_id, dtype=torch.long)  # (R, L); padding attends only itself, its outputs are dropped
    attn = torch.zeros(R, L, dtype=torch.long)  # (R, L)
    index = torch.full((n_rows, width), -1, dtype=torch.long)  # (N, T)
    for p, s in enumerate(seqs):
        ids[p, : len(s)] = torch.tensor(s, dtype=torch.long)
        attn[p, : len(s)] = 1
        for r, cols in places[p]:
            index[r, : len(cols)] = p * L + torch.tensor(cols, dtype=torch.long)
    act = torch.zeros(R * L, dtype=torch.bool)
    if action_mask is not None:
        real = index >= 0
        act[index[real]] = action_mask[real]  # a shared token's writers agree (the group trie keys on the action mask)
    tree = PrefixTree(rows=tuple(nodes), length=L)
    return PackedRows(input_ids=ids, attention_mask=attn, position_ids=tree.position_ids(), action_mask=act.view(R, L),
                      tree=tree, index=index, members=tuple(members), lengths=tuple(len(s) for s in seqs))


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


def attention_kwargs(model, attention_mask: torch.Tensor, tree: PrefixTree | None) -> dict:
    """How ``model`` attends rows with ``tree`` (the one place that decides): on ``"cope_tree"``, the tree goes with
    the forward (a model that checkpoints its layers recomputes them anyway, so the tile calls are not recomputed
    twice); on any other attention, the tree's dense mask, the reference (bool for SDPA, additive otherwise).
    Without a tree: the 2D padding mask, or a transform's 4D additive mask in the model's compute dtype."""
    dtype = next(p for p in model.parameters() if p.is_floating_point()).dtype
    dtype = dtype if dtype in (torch.float16, torch.bfloat16, torch.float32) else torch.float32
    impl = getattr(model.config, "_attn_implementation", "sdpa")
    if tree is not None and impl == NAME:
        recompute = tree.recompute and not getattr(model, "is_activation_checkpointing", False)
        return {"attention_mask": attention_mask, "prefix_tree": tree if recompute else tree.replace(recompute=False)}
    if tree is not None:
        keep = tree.dense_mask(attention_mask.device)  # (N, 1, T, T) bool
        if impl == "sdpa":
            return {"attention_mask": keep}
        return {"attention_mask": torch.zeros(keep.shape, dtype=dtype, device=keep.device).masked_fill_(~keep, torch.finfo(dtype).min)}
    if attention_mask.dim() == 4:  # additive float mask from a collate transform
        return {"attention_mask": torch.zeros(attention_mask.shape, dtype=dtype, device=attention_mask.device)
                .masked_fill(attention_mask < 0, torch.finfo(dtype).min)}
    return {"attention_mask": attention_mask}


def packed_logprobs(model, pack: PackedRows, rows: torch.Tensor | None, length: int | None, at: Mapping[str, torch.Tensor],
                    temperature: float, entropy: bool) -> TokenScores:
    """:func:`cope.train.logprobs.causal_lm_logprobs` of logical rows ``rows`` (all: None), first ``length`` columns,
    computed on their packed rows and gathered back to the logical rows' shape. ``at``: per key, (P, 2) [logical row,
    column] positions whose full predictive rows are wanted; those inside the rows and columns scored come back under
    the key, with their indices into ``at[key]``. Padding scores 0."""
    from cope.train.logprobs import causal_lm_logprobs

    a, b = pack.span(rows)
    part, tree = pack.part(a, b)
    width = part["input_ids"].shape[1]
    local = pack.local_index(a, width, rows, length)  # (n, T')
    index = {k: _inside(pos, rows, length) for k, pos in at.items()}  # key -> (P_k,) positions in this part
    at_packed = None
    if at:
        live = torch.cat([at[k][i] for k, i in index.items()])  # (P', 2) [logical row, column]
        flat = pack.local_index(a, width)[live[:, 0], live[:, 1]]  # (P',)
        at_packed = torch.stack([flat // width, flat % width], 1)
    act = part["action_mask"]
    kw = attention_kwargs(model, part["attention_mask"], tree)
    source = None if tree is None else tree.predecessors().to(act.device)  # (R', L'): a tree's token after its ancestor's
    lp, ent, *found = causal_lm_logprobs(model, part["input_ids"], kw["attention_mask"], part["position_ids"], tempered=act,
                                         temperature=temperature, entropy_mask=act if entropy else None,
                                         rows_at=at_packed, prefix_tree=kw.get("prefix_tree"), source=source)
    # column 0 holds 0 (the log-prob convention): in a packed row a tree placed after another would read it off that
    # tree's last token
    drop = local < 0
    drop[:, 0] = True
    split = found[0].split([len(i) for i in index.values()]) if at else ()  # key by key, (P_k, V)
    return TokenScores(_gather(lp, local).masked_fill(drop, 0.0), _gather(ent, local).masked_fill(drop, 0.0),
                       dict(zip(index, split)), index)


def _inside(pos: torch.Tensor, rows: torch.Tensor | None, length: int | None) -> torch.Tensor:
    """Indices of the (P, 2) [row, column] positions ``pos`` in logical ``rows`` (all: None), first ``length`` columns."""
    inside = torch.ones_like(pos[:, 0], dtype=torch.bool) if rows is None else torch.isin(pos[:, 0], rows)
    return (inside & (pos[:, 1] < length) if length is not None else inside).nonzero().squeeze(-1)  # (P_live,)


def _gather(values: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """(P, L') packed values at the logical rows' flat positions ``local`` (n, T')."""
    return values.flatten()[local.clamp(min=0)]


def use_tree_attention(model) -> None:
    """Register ``"cope_tree"`` and switch ``model`` (a transformers causal LM, peft-wrapped or not) to it. Without a
    tree it computes exactly what ``"sdpa"`` does, so only a model on ``"sdpa"`` is switched (idempotent); any other
    implementation is refused, naming the fix."""
    register()
    impl = getattr(model.config, "_attn_implementation", None)
    if impl == NAME:
        return
    if impl != "sdpa":
        raise ValueError(f"shared-prefix rows need tree attention ('{NAME}'), which is 'sdpa' without a tree; this model "
                         f"runs {impl!r}: load it with model.attn_implementation=sdpa, or turn the sharing off "
                         "(data.share_prefix=false)")
    model.set_attn_implementation(NAME)
