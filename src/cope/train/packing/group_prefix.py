"""GRPO groups forwarded with their common prefix once (``data.share_prefix=true``).

The episodes of one GRPO group start with the same tokens: the system prompt, the task, the first observation. A
minibatch normally forwards that prefix once per episode. :func:`pack_groups` (the DataModule's last collate step)
adds the packed rows (``batch["packed"]``, :class:`cope.train.packing.tree_batch.PackedRows`): per group of the minibatch,
one tree holding the prefix once (the trunk) and every episode's remainder as a branch anchored in it
(:func:`cope.train.packing.tree_batch.branch`: ``[prefix[-1]] + episode[P:]`` after ``P - 1`` trunk tokens); such trees and
the rows that share nothing are then placed side by side in fewer rows by the one packer
(:func:`cope.train.packing.tree_batch.pack`). Every other row (an episode alone in its group in this minibatch, an extra
row a transform added) is a unit of its own.

The batch contract does not change: ``input_ids``, ``roles``, ``advantages`` and every other key stay one row per
episode, and the module's forward returns log-probs and entropies in that shape (gathered from the packed rows; a
prefix token's log-prob is gathered by every episode of its group, so its gradient sums over them, as the unshared
batch's does). Only the model sees the packed rows. So every objective, the scoring pass (old and reference
log-probs), EMPG and CoPE's temporal ensemble work unchanged.

A batch whose rows are trees already (CoPE's packed joint rows: ``packed`` is their identity packing) shares no
group: each row's tree is a unit, and the rows are only placed side by side, padding removed.

The prefix ends before the group's first action token (so no policy-gradient target is shared; an observation
there, ECHO's target, is gathered by each episode): it is the longest common prefix of the group's ids and roles,
cut at the first ``ACTION`` of any member. Groups whose prefix is shorter than 2 tokens are not packed.
"""
from __future__ import annotations

import torch

from cope.episode import Episode, Role
from cope.train.packing.prefix_tree import TreeNode
from cope.train.packing.tree_batch import Unit, branch, pack, split_to_fit


def pack_groups(batch: dict, episodes: list[Episode], max_row_tokens: int | None = None) -> dict:
    """``batch`` with ``packed`` set (a new dict; every other key unchanged). See the module docstring.

    ``max_row_tokens`` (the module's micro-batch budget): a group whose tree would be longer is split into consecutive
    subgroups that each fit (each shares the prefix once), and rows are filled up to it, so a micro-batch holds no
    more tokens than without the packing."""
    ids, roles, mask = batch["input_ids"], batch["roles"], batch["attention_mask"]
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
        key = ("group", episodes[e].group) if tree is None and e >= 0 and not aux[r] else ("row", r)
        clusters.setdefault(key, []).append(r)
    units = []
    for rows in (sub for c in clusters.values() for sub in _fit(c, ids, roles, lengths, max_row_tokens)):
        P = _prefix(ids, roles, rows, lengths) if len(rows) > 1 else 0
        if P < 2:  # nothing worth sharing: each row alone (its own tree, if it is one)
            units += [Unit(ids[r, : lengths[r]].tolist(), tree.rows[r] if tree is not None else (TreeNode(0, lengths[r], -1, 0),),
                           ((r, list(range(lengths[r]))),)) for r in rows]
            continue
        trunk = ids[rows[0], :P].tolist()
        seq, nodes, places = list(trunk), [TreeNode(0, P, -1, 0)], []
        for r in rows:
            seen, ids_r = branch(trunk, P, ids[r, P: lengths[r]].tolist())
            start = len(seq)
            seq += ids_r
            nodes.append(TreeNode(start, len(seq), 0, seen))
            places.append((r, [*range(P), *range(start + 1, len(seq))]))  # the prefix in the trunk, the rest in the branch
        units.append(Unit(seq, tuple(nodes), tuple(places)))
    return {**batch, "packed": pack(units, N, T, 0, max_row_tokens, batch["action_mask"])}


def _fit(rows: list[int], ids: torch.Tensor, roles: torch.Tensor, lengths: list[int], cap: int | None) -> list[list[int]]:
    """``rows`` (one group) cut into consecutive subgroups whose shared tree (prefix once, then each member's rest
    and one repeated token) fits ``cap`` tokens (:func:`cope.train.packing.tree_batch.split_to_fit`)."""
    if cap is None or len(rows) < 2:
        return [rows]
    P = _prefix(ids, roles, rows, lengths)
    return split_to_fit(rows, lambda sub: P + sum(lengths[r] - P + 1 for r in sub), cap)


def _prefix(ids: torch.Tensor, roles: torch.Tensor, rows: list[int], lengths: list[int]) -> int:
    """Longest common prefix of ``rows`` (ids and roles), cut before the first action token of any of them."""
    n = min(lengths[r] for r in rows)
    same = (ids[rows, :n] == ids[rows[0], :n]).all(0) & (roles[rows, :n] == roles[rows[0], :n]).all(0)  # (n,)
    act = (roles[rows, :n] == int(Role.ACTION)).any(0)  # (n,)
    stop = ~same | act
    return int(stop.float().argmax()) if bool(stop.any()) else n
