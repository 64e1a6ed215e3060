"""A trie over the tokens of several logical rows: each distinct prefix stored once, as packing units.

Two tokens of two rows are one trie token when the rows agree on everything before them and on the token itself:
its id, its role and whether it is a policy-gradient target (``action_mask``; so one packed token never stands for
a target of one row and a non-target of another, which the forward would temper differently). A row that is a
tree already (CoPE's packed joint rows: a transcript and forecast segments anchored in it) is inserted node by
node, each node continuing the trie where the last ancestor token it sees sits, so its segments are shared too when
they repeat another row's tokens. Compressed (chains of single children are one node), the trie is a
:class:`~cope.train.packing.prefix_tree.PrefixTree`: a node continues its parent after all of the parent's tokens
(``anchor = len(parent)``), and its first token is predicted by the parent's last one
(:meth:`~cope.train.packing.prefix_tree.PrefixTree.predecessors`), so no token is stored twice.

This is the radix tree of the rows, the layout RadixAttention (SGLang, Zheng et al., 2024) keeps for its KV cache,
built here for one training forward with its backward: exact, nothing cached across steps.
"""
from __future__ import annotations

from collections.abc import Sequence

from cope.train.packing.prefix_tree import TreeNode
from cope.train.packing.tree_batch import Unit

#: A token's identity in the trie: (id, role, policy-gradient target).
Key = tuple[int, int, bool]


class TokenTrie:
    """Rows inserted one by one (:meth:`add`), measured (``len``: the distinct tokens), an insertion undone
    (:meth:`undo`), and the result laid out as packing units (:meth:`units`)."""

    def __init__(self) -> None:
        self._keys: list[Key] = []  # per trie token
        self._parent: list[int] = []  # per trie token; -1: a root token
        self._kids: list[list[int]] = []  # per trie token, its children in insertion order
        self._roots: list[int] = []
        self._edge: dict[tuple[int, Key], int] = {}  # (parent, key) -> child
        self._rows: list[tuple[int, list[int]]] = []  # (logical row, the trie token of each of its columns)

    def __len__(self) -> int:
        return len(self._keys)

    @property
    def rows(self) -> int:
        """Logical rows inserted."""
        return len(self._rows)

    def add(self, row: int, keys: Sequence[Key], nodes: Sequence[TreeNode]) -> None:
        """Insert logical row ``row``: ``keys`` per column, ``nodes`` the row's own tree in its columns (a plain
        row: one root over all of them). Every column must lie in a node; parents come before children."""
        at = [-1] * len(keys)  # trie token of each column
        for n in nodes:
            cur = _last_seen(nodes, n)
            cur = -1 if cur < 0 else at[cur]
            for c in range(n.start, n.end):
                cur = self._step(cur, keys[c])
                at[c] = cur
        if any(t < 0 for t in at):
            raise ValueError(f"TokenTrie.add: row {row} has columns in no node of its tree")
        self._rows.append((row, at))

    def mark(self) -> tuple[int, int]:
        """The state to return to with :meth:`undo`."""
        return len(self._keys), len(self._rows)

    def undo(self, mark: tuple[int, int]) -> None:
        """Forget every token and row added since ``mark`` (tokens are numbered in creation order)."""
        tokens, rows = mark
        for t in range(len(self._keys) - 1, tokens - 1, -1):
            p = self._parent[t]
            del self._edge[(p, self._keys[t])]
            (self._roots if p < 0 else self._kids[p]).pop()
        del self._keys[tokens:], self._parent[tokens:], self._kids[tokens:], self._rows[rows:]

    def units(self) -> list[Unit]:
        """The trie as :class:`~cope.train.packing.tree_batch.Unit` s: one per set of roots that no row spans
        across (subtrees that share nothing are placed apart; a row whose tree holds a node that sees nothing of
        its ancestors spans two roots). Nodes in depth-first order, each a maximal chain of single children."""
        root = list(range(len(self._keys)))  # per trie token, its root (parents are made before children)
        for t, p in enumerate(self._parent):
            if p >= 0:
                root[t] = root[p]
        comp = {r: r for r in self._roots}  # union-find over roots: a row's roots go together

        def find(r: int) -> int:
            while comp[r] != r:
                comp[r] = comp[comp[r]]
                r = comp[r]
            return r

        for _, at in self._rows:
            for t in at:
                a, b = find(root[at[0]]), find(root[t])
                if a != b:
                    comp[max(a, b)] = min(a, b)
        col = [-1] * len(self._keys)  # trie token -> column in its unit
        laid: dict[int, tuple[list[int], list[TreeNode]]] = {}
        for r in self._roots:
            seq, nodes = laid.setdefault(find(r), ([], []))
            stack = [(r, -1)]  # (first token of a node, its parent node)
            while stack:
                t, parent = stack.pop()
                start = len(seq)
                while True:
                    col[t] = len(seq)
                    seq.append(self._keys[t][0])
                    if len(self._kids[t]) != 1:
                        break
                    t = self._kids[t][0]
                anchor = 0 if parent < 0 else nodes[parent].end - nodes[parent].start  # all of the parent
                nodes.append(TreeNode(start, len(seq), parent, anchor))
                stack += [(k, len(nodes) - 1) for k in reversed(self._kids[t])]
        places: dict[int, list[tuple[int, list[int]]]] = {c: [] for c in laid}
        for row, at in self._rows:
            places[find(root[at[0]])].append((row, [col[t] for t in at]))
        return [Unit(seq, tuple(nodes), tuple(places[c])) for c, (seq, nodes) in laid.items()]

    def _step(self, parent: int, key: Key) -> int:
        """The child of ``parent`` (-1: the roots) with ``key``, made if new."""
        t = self._edge.get((parent, key))
        if t is None:
            t = len(self._keys)
            self._keys.append(key)
            self._parent.append(parent)
            self._kids.append([])
            self._edge[(parent, key)] = t
            (self._roots if parent < 0 else self._kids[parent]).append(t)
        return t


def _last_seen(nodes: Sequence[TreeNode], node: TreeNode) -> int:
    """The column of the last ancestor token ``node`` sees (-1: none, it starts a sequence): the ``anchor``-th
    token of the nearest ancestor it sees any of (:meth:`~cope.train.packing.prefix_tree.PrefixTree.predecessors`)."""
    while node.parent >= 0:
        parent = nodes[node.parent]
        if node.anchor > 0:
            return parent.start + node.anchor - 1
        node = parent  # sees none of the parent: what it sees of the grandparent is what the parent sees
    return -1


def trie_tokens(keys: Sequence[Sequence[Key]]) -> int:
    """Distinct tokens of plain rows with these per-column ``keys`` (what their trie stores)."""
    trie = TokenTrie()
    for r, k in enumerate(keys):
        trie.add(r, k, (TreeNode(0, len(k), -1, 0),))
    return len(trie)
