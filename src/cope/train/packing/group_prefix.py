"""GRPO groups forwarded as prefix trees, every shared token once (``data.share_prefix=true``).

The episodes of one GRPO group start with the same tokens (the system prompt, the task, the first observation), and
a branched group (``+collector=branching``) shares far more: a child episode repeats its parent's turns up to the
fork, actions included. A minibatch normally forwards all of that once per episode. :func:`pack_groups` (the
DataModule's last collate step) adds the packed rows (``batch["packed"]``,
:class:`cope.train.packing.tree_batch.PackedRows`): per group of the minibatch, the trie of its rows
(:class:`cope.train.packing.token_trie.TokenTrie`: tokens where the rows agree on ids, roles and the action mask are
one node, a branch where they part), so every distinct prefix is forwarded once however deep the tree; such trees and
the rows that share nothing are then placed side by side in fewer rows by the one packer
(:func:`cope.train.packing.tree_batch.pack`). A row that belongs to no group (an extra row a transform added) is a
trie of its own.

The batch contract does not change: ``input_ids``, ``roles``, ``advantages`` and every other key stay one row per
episode, and the module's forward returns log-probs and entropies in that shape (gathered from the packed rows). Only
the model sees the packed rows. So every objective, the scoring pass (old and reference log-probs), EMPG and CoPE's
temporal ensemble work unchanged.

Shared targets (the decision). The packing this replaces shared one trunk per group, cut before the group's first
action token "so no policy-gradient target is shared". The loss never needed that cut: each logical row gathers its
tokens' log-probs and entropies from the packed tokens it maps to (``PackedRows.index``), so a token shared by k
leaves is read k times, each time with that leaf's advantage, old log-prob and weight, and its gradient sums the k
per-leaf terms: the unpacked per-leaf loss exactly (policy gradient, KL, ECHO's observations, CoPE's forecast
targets), and the scoring pass, entropies and EMPG read the same per-row values. What a shared token has only once
is the forward's per-token choices: the temperature it is scored at and whether its entropy is computed (both read
the packed ``action_mask``), and the output that predicts it. So the trie keys a token on its action mask as well as
its id and role (an aborted leaf's actions, no targets, are not joined to a live leaf's), and a token is predicted by
its predecessor in the tree (:meth:`cope.train.packing.prefix_tree.PrefixTree.predecessors`), so a node continues all
of its parent (``anchor = len(parent)``) with no copy of the parent's last token. Trees of any depth are then exact;
the tree attention's plan takes any depth (a node's keys are its ancestors' visible ranges).

A batch whose rows are trees already (CoPE's packed joint rows: ``packed`` is their identity packing) is inserted
tree by tree: each transcript joins its group's trie, and each forecast segment continues the trie where its anchor
sits (its first token, a non-target copy of the anchor token, has its own node). A batch packed otherwise is
refused.

The micro-batch budget (``max_row_tokens``): a group whose trie would hold more tokens is cut into subgroups whose
tries fit, consecutive in the order of the rows' tokens (so a leaf stays next to its parent; a row too long alone is
a subgroup of its own), and packed rows are filled up to it, so a micro-batch holds no more tokens than without the
packing.
"""
from __future__ import annotations

from collections.abc import Callable

import torch

from cope.episode import Episode
from cope.train.packing.prefix_tree import TreeNode
from cope.train.packing.token_trie import Key, TokenTrie
from cope.train.packing.tree_batch import pack


def pack_groups(batch: dict, episodes: list[Episode], max_row_tokens: int | None = None) -> dict:
    """``batch`` with ``packed`` set (a new dict; every other key unchanged). See the module docstring.

    ``max_row_tokens`` (the module's micro-batch budget): no trie of several rows holds more tokens (the group is cut
    into subgroups), and packed rows are filled up to it."""
    ids, roles, mask, act = batch["input_ids"], batch["roles"], batch["attention_mask"], batch["action_mask"]
    if mask.dim() != 2:
        raise ValueError(f"pack_groups needs the 2D attention mask of collate, got shape {tuple(mask.shape)}")
    old = batch.get("packed")
    tree = None if old is None else old.tree
    if old is not None and old.members != tuple((r,) for r in range(ids.shape[0])):
        raise ValueError("pack_groups: this batch is packed already (not row by row); apply one packing only")
    N, T = ids.shape
    lengths = mask.ne(0).sum(-1).tolist()
    aux = batch.get("aux_row", torch.zeros(N, dtype=torch.bool)).tolist()
    clusters: dict[object, list[int]] = {}
    for r, e in enumerate(batch["episode_index"].tolist()):
        key = ("group", episodes[e].group) if e >= 0 and not aux[r] else ("row", r)
        clusters.setdefault(key, []).append(r)
    ids_l, roles_l, act_l = ids.tolist(), roles.tolist(), act.tolist()

    def row(r: int) -> tuple[list[Key], tuple[TreeNode, ...]]:  # (keys per column, the row's own tree)
        n = lengths[r]
        nodes = tree.rows[r] if tree is not None else (TreeNode(0, n, -1, 0),)
        return list(zip(ids_l[r][:n], roles_l[r][:n], act_l[r][:n])), nodes

    tries = [t for rows in clusters.values() for t in _tries(rows, row, max_row_tokens)]
    units = [u for t in tries for u in t.units()]
    return {**batch, "packed": pack(units, N, T, 0, max_row_tokens, act)}


def _tries(rows: list[int], row: Callable[[int], tuple[list[Key], tuple[TreeNode, ...]]],
           cap: int | None) -> list[TokenTrie]:
    """``rows`` (one group; ``row(r)``: its keys per column and its own tree) as one trie, or with ``cap`` as tries of
    at most ``cap`` tokens each, filled in the order of the rows' tokens (rows that share the longest prefixes are
    neighbours: a leaf next to its parent); a row that would take a trie past ``cap`` starts the next one (a row
    longer than ``cap`` alone is a trie of its own)."""
    out = [TokenTrie()]
    got = {r: row(r) for r in rows}
    for r in sorted(rows, key=lambda r: got[r][0]) if cap is not None else rows:
        keys, nodes = got[r]
        mark = out[-1].mark()
        out[-1].add(r, keys, nodes)
        if cap is not None and len(out[-1]) > cap and out[-1].rows > 1:
            out[-1].undo(mark)
            out.append(TokenTrie())
            out[-1].add(r, keys, nodes)
    return out
