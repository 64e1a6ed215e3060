"""A prefix tree: which tokens of a packed row see which, when a prefix is stored once and its branches continue it.

A packed row holds a tree of contiguous spans ("nodes"). A root node (``parent == -1``) sees only itself,
causally. Any other node continues its parent after the parent's first ``anchor`` tokens: it sees, causally, its
own tokens, plus those ``anchor`` tokens of its parent, plus whatever the parent sees of its own ancestors, up to
the root. So a node's token attends exactly what it would attend in the unshared sequence "visible ancestor
tokens + own tokens" (:meth:`PrefixTree.unshared`), and :meth:`PrefixTree.position_ids` gives it that sequence's
positions, so RoPE is the same too; :meth:`PrefixTree.predecessors` names the token before it in that sequence
(whose output predicts it), so a node can start right after the last ancestor token it sees, with no copy of it.
Examples: an agent transcript (trunk) with forecast samples that continue it from several anchors; a GRPO group's
episodes as the trie of their tokens (a branched group's shared turns at any depth). Tokens in no node are padding:
they attend only themselves.

This is the cascade/shared-prefix idea of Hydragen (Juravsky et al., 2024) and tree attention for speculative
decoding (SpecInfer), used here for training: exact forward and backward, no cache. Where it differs: no
log-sum-exp merge. Each branch's queries run against the gathered keys of its visible ancestors plus its own
keys in one masked call (:meth:`PrefixTree.plan` cuts the work into such calls); see
:mod:`cope.train.packing.tree_attention` for the kernels.

Rules (checked at construction): spans are non-empty, inside the row and disjoint, in any order in memory; a
node's parent is listed before it (a smaller index), which rules out cycles; ``0 <= anchor <= len(parent)``; a
root's anchor is 0. A row may hold several roots (several independent trees, e.g. several GRPO groups).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

#: Queries per tile: nodes that see ancestor tokens are cut into tiles of at most this many queries, so the
#: masked-out upper triangle computed inside a tile's own block stays small (at most TILE**2/2 cells per tile).
#: On a stored maze batch (bench/cope_update_cost.py's, 16 episodes) the cells computed over the cells needed were
#: 1.32 / 1.21 / 1.17 (separate steps) and 1.23 / 1.16 / 1.14 (joint rows) at 128 / 64 / 32 queries; smaller tiles
#: mean more, smaller calls.
TILE = 64
#: Tiles run in batched calls padded to the group's largest tile; a tile joins a group only while the padded
#: cells stay within SLACK times the cells of the tiles themselves.
SLACK = 1.25


@dataclass(frozen=True)
class TreeNode:
    """One span ``[start, end)`` of a packed row; it continues node ``parent`` (-1: a root) after ``anchor`` of
    the parent's tokens."""

    start: int
    end: int
    parent: int
    anchor: int


@dataclass(frozen=True)
class ScoreCells:
    """Query-key score cells: ``tree`` computed by the tree kernels (tile rectangles with their padding; nodes
    that see no ancestor as causal triangles), ``visible`` the unmasked cells of real tokens (the least any exact
    method computes), ``dense`` N*T*T (SDPA with the dense mask)."""

    tree: int
    visible: int
    dense: int


@dataclass(frozen=True)
class Tile:
    """Queries ``[q_start, q_end)`` of row ``row`` and the key ranges they see, in sequence order. The last range
    ends at ``q_end`` (the tile's own causal block), so query i of the tile sees the first ``lk - lq + i + 1`` keys."""

    row: int
    q_start: int
    q_end: int
    keys: tuple[tuple[int, int], ...]

    @property
    def lq(self) -> int:
        return self.q_end - self.q_start

    @property
    def lk(self) -> int:
        return sum(b - a for a, b in self.keys)


@dataclass(frozen=True)
class Plan:
    """How the tree kernels cut one tree into calls (pure Python; tensors are built per device by the kernels).

    ``causal``: ``(start, end) -> rows`` for nodes that see no ancestor token: one causal call on their own slice.
    ``groups``: batches of tiles of nodes that see ancestor tokens, one masked call each.
    ``padding``: ``(row, position)`` of tokens in no node.
    """

    causal: dict[tuple[int, int], tuple[int, ...]]
    groups: tuple[tuple[Tile, ...], ...]
    padding: tuple[tuple[int, int], ...]


class PrefixTree:
    """For each of N packed rows of length T, its tree of nodes (see the module docstring).

    Immutable, compared by value (``rows``, ``length``, ``recompute``), and deliberately not a dataclass: a tree holds
    no tensors, and the generic walkers that run over a forward's inputs (FSDP2's cast of forward inputs under a
    mixed-precision policy, Lightning's device transfer) rebuild a dataclass field by field. Here they hand back the
    same object, whose kernel tensors (:meth:`cached`) are then built once and reused by every layer.

    Args:
        rows: per row, its nodes; node ``i``'s parent must have an index below ``i``.
        length: T, the packed row length (at least the largest node end).
        recompute: the tiles kernel's tile calls (queries against gathered ancestor keys) are recomputed in backward
            rather than kept: only q, k, v stay alive, not each tile's copy of its ancestors' keys and values (the
            step's activation peak 15-28% lower where tree rows set it, in ``bench/cope_update_cost.py``'s runs, for one more forward
            of those calls). False keeps them. A model that checkpoints its layers (the 7B preset) gets False
            from :func:`cope.train.packing.tree_batch.attention_kwargs`: its layer is recomputed anyway.
    """

    __slots__ = ("rows", "length", "recompute", "_cache")
    rows: tuple[tuple[TreeNode, ...], ...]
    length: int
    recompute: bool

    def __init__(self, rows: tuple[tuple[TreeNode, ...], ...], length: int, recompute: bool = True) -> None:
        if not rows:
            raise ValueError("PrefixTree needs at least one row")
        for r, nodes in enumerate(rows):
            _validate_row(r, nodes, length)
        for name, value in (("rows", rows), ("length", length), ("recompute", recompute)):
            object.__setattr__(self, name, value)
        # The plan and the per-device tensors the kernels build once per tree and reuse in every layer.
        object.__setattr__(self, "_cache", {})

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"PrefixTree is immutable: use replace({name}=...)")

    def _key(self) -> tuple:
        return self.rows, self.length, self.recompute

    def __eq__(self, other: object) -> bool:
        return isinstance(other, PrefixTree) and self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())

    def __repr__(self) -> str:
        return f"PrefixTree(rows={self.rows!r}, length={self.length}, recompute={self.recompute})"

    def replace(self, **changes: Any) -> PrefixTree:
        """A new tree with ``changes`` (``rows``, ``length``, ``recompute``) and its own, empty cache."""
        return PrefixTree(**{"rows": self.rows, "length": self.length, "recompute": self.recompute, **changes})

    @classmethod
    def from_lists(cls, rows: list[list[tuple[int, int, int, int]]], length: int | None = None) -> PrefixTree:
        """From ``[(start, end, parent, anchor), ...]`` per row; ``length`` defaults to the largest node end."""
        nodes = tuple(tuple(TreeNode(*map(int, n)) for n in row) for row in rows)
        if length is None:
            length = max((n.end for row in nodes for n in row), default=0)
        return cls(rows=nodes, length=length)

    def chain(self, row: int, node: int) -> tuple[tuple[int, int], ...]:
        """``(ancestor index, tokens of it that ``node`` sees)`` from the root down to the parent."""
        nodes, out = self.rows[row], []
        child = nodes[node]
        while child.parent >= 0:
            out.append((child.parent, child.anchor))
            # What a child sees of its grandparent is what its parent sees: the parent's own anchor.
            child = nodes[child.parent]
        return tuple(reversed(out))

    def ancestor_keys(self, row: int, node: int) -> tuple[tuple[int, int], ...]:
        """The row ranges ``[a, b)`` of ancestor tokens that ``node`` sees, in sequence order (empty ones left out)."""
        nodes = self.rows[row]
        return tuple((nodes[a].start, nodes[a].start + c) for a, c in self.chain(row, node) if c > 0)

    def position_ids(self, device: torch.device | str | None = None) -> torch.Tensor:
        """(N, T) long: token k of a node gets (ancestor tokens it sees) + k; padding gets 0."""
        pos = torch.zeros(len(self.rows), self.length, dtype=torch.long)
        for r, nodes in enumerate(self.rows):
            for i, n in enumerate(nodes):
                seen = sum(c for _, c in self.chain(r, i))
                pos[r, n.start:n.end] = torch.arange(seen, seen + n.end - n.start)
        return pos.to(device)

    def predecessors(self) -> torch.Tensor:
        """(N, T) long: per token, the flat position ``row * T + column`` of the token before it in the sequence it
        stands for (its left neighbour inside its node; for a node's first token, the last ancestor token it sees),
        whose output predicts it; -1 for a root's first token and padding (built once)."""
        def build() -> torch.Tensor:
            T = self.length
            src = torch.full((len(self.rows), T), -1, dtype=torch.long)
            for r, nodes in enumerate(self.rows):
                for i, n in enumerate(nodes):
                    src[r, n.start + 1:n.end] = torch.arange(n.start, n.end - 1) + r * T
                    keys = self.ancestor_keys(r, i)
                    if keys:
                        src[r, n.start] = r * T + keys[-1][1] - 1
            return src
        return self.cached("predecessors", build)

    def dense_mask(self, device: torch.device | str | None = None) -> torch.Tensor:
        """(N, 1, T, T) bool, True = attend: the reference the kernels must equal. Padding attends only itself."""
        T = self.length
        keep = torch.eye(T, dtype=torch.bool).repeat(len(self.rows), 1, 1)  # (N, T, T): padding sees itself
        causal = torch.ones(T, T, dtype=torch.bool).tril()
        for r, nodes in enumerate(self.rows):
            for i, n in enumerate(nodes):
                for a, b in self.ancestor_keys(r, i):
                    keep[r, n.start:n.end, a:b] = True
                keep[r, n.start:n.end, n.start:n.end] = causal[: n.end - n.start, : n.end - n.start]
        return keep[:, None].to(device)

    def unshared(self) -> list[list[list[int]]]:
        """Per row, per node: the row indices of the sequence the node stands for (its visible ancestor tokens, then
        its own). Running each alone must give, on the node's own tokens, what the packed row gives there."""
        return [
            [[t for a, b in self.ancestor_keys(r, i) for t in range(a, b)] + list(range(n.start, n.end)) for i, n in enumerate(nodes)]
            for r, nodes in enumerate(self.rows)
        ]

    def to(self, device: torch.device | str | None = None, **kwargs) -> PrefixTree:
        """Itself: a tree holds no tensors (kernels build theirs per device); what Lightning calls to move a batch."""
        return self

    def cached(self, key: object, build: Callable[[], Any]) -> Any:
        """``build()`` once per tree and ``key`` (e.g. a kernel's tensors on one device), then reused by every layer."""
        if key not in self._cache:
            self._cache[key] = build()
        return self._cache[key]

    def plan(self) -> Plan:
        """The calls the tile kernel makes (built once): see :class:`Plan`."""
        return self.cached("plan", lambda: _make_plan(self))

    def score_cells(self) -> ScoreCells:
        """Score cells of the tree kernels vs the least exact work vs dense-masked SDPA (see :class:`ScoreCells`)."""
        plan = self.plan()
        tree = sum(len(rows) * (b - a) * (b - a + 1) // 2 for (a, b), rows in plan.causal.items())
        tree += sum(len(g) * max(t.lq for t in g) * max(t.lk for t in g) for g in plan.groups)
        visible = 0
        for r, nodes in enumerate(self.rows):
            for i, n in enumerate(nodes):
                size = n.end - n.start
                visible += size * sum(c for _, c in self.chain(r, i)) + size * (size + 1) // 2
        return ScoreCells(tree=tree, visible=visible, dense=len(self.rows) * self.length**2)


def _validate_row(r: int, nodes: tuple[TreeNode, ...], length: int) -> None:
    """Raise ValueError, naming the node and the fix, if row ``r`` breaks a rule of the module docstring."""
    if not nodes:
        raise ValueError(f"PrefixTree row {r} has no node: give every row at least a root (start, end, -1, 0)")
    for i, n in enumerate(nodes):
        where = f"PrefixTree row {r} node {i} {tuple(vars(n).values())}"
        if not 0 <= n.start < n.end <= length:
            raise ValueError(f"{where}: need 0 <= start < end <= length={length} (nodes are non-empty spans of the row)")
        if n.parent == -1:
            if n.anchor != 0:
                raise ValueError(f"{where}: a root (parent -1) sees no parent tokens; set its anchor to 0")
            continue
        if not 0 <= n.parent < i:
            raise ValueError(f"{where}: parent must be -1 (a root) or the index of an earlier node; list parents before children")
        size = nodes[n.parent].end - nodes[n.parent].start
        if not 0 <= n.anchor <= size:
            raise ValueError(f"{where}: anchor must be in [0, {size}], the parent's length (how many parent tokens it sees)")
    spans = sorted((n.start, n.end, i) for i, n in enumerate(nodes))
    for (_, e0, i0), (s1, _, i1) in zip(spans, spans[1:]):
        if s1 < e0:
            raise ValueError(f"PrefixTree row {r}: nodes {i0} and {i1} overlap; spans must be disjoint (store each token once)")


def _make_plan(tree: PrefixTree) -> Plan:
    """Nodes that see no ancestor token -> causal calls; the others -> tiles of <= TILE queries, grouped greedily
    (largest keys first) while the group's padded cells stay within SLACK times its tiles' own cells."""
    causal: dict[tuple[int, int], list[int]] = {}
    tiles: list[Tile] = []
    covered = [[False] * tree.length for _ in tree.rows]
    for r, nodes in enumerate(tree.rows):
        for i, n in enumerate(nodes):
            covered[r][n.start:n.end] = [True] * (n.end - n.start)
            prefix = tree.ancestor_keys(r, i)
            if not prefix:
                causal.setdefault((n.start, n.end), []).append(r)
                continue
            for q0 in range(n.start, n.end, TILE):
                q1 = min(q0 + TILE, n.end)
                tiles.append(Tile(row=r, q_start=q0, q_end=q1, keys=(*prefix, (n.start, q1))))
    tiles.sort(key=lambda t: (-t.lk, -t.lq, t.row, t.q_start))
    groups: list[list[Tile]] = []
    for t in tiles:
        g = groups[-1] if groups else None
        if g is not None:
            own = sum(x.lq * x.lk for x in g) + t.lq * t.lk
            padded = (len(g) + 1) * max(t.lq, *(x.lq for x in g)) * g[0].lk  # g[0] has the most keys (sorted)
            if padded <= SLACK * own:
                g.append(t)
                continue
        groups.append([t])
    padding = tuple((r, p) for r, row in enumerate(covered) for p, c in enumerate(row) if not c)
    return Plan(causal={k: tuple(v) for k, v in causal.items()}, groups=tuple(tuple(g) for g in groups), padding=padding)
