"""Which leaves of a branched group are trained: duplicates collapsed (``branch.dedup``), at most J_max per task
(``branch.j_max``).

Follows QwenGyre (arXiv 2609.33848): a task's leaves are sampled for training without duplication, at most ``J_max``
of them per execution (J_max=5 matched the uncapped run at 74.8% of its forward-backward time). Here:

* dedup: leaves of one task with the same token ids over the whole episode (the same sampled actions, the same
  observations) are one trained leaf, the first in the tree's creation order (a parent before its children); the
  others are counted in ``rollout/branch_duplicate_leaves``;
* J_max: of a task's distinct leaves (every leaf with ``dedup`` off) at most ``j_max`` are trained, drawn uniformly
  without replacement from the epoch's seeded stream (the same draw after a resume); the others are counted in
  ``rollout/branch_capped_leaves``.

An aborted leaf (an env crash, a replay mismatch) is neither: it trains nothing (no action is a target), so it stays
in the epoch as any aborted episode does (``env/aborted_episodes``), outside the dedup and the J_max draw.

Every leaf still counts where the group is judged: its advantage is computed over all the group's leaves before any is
dropped (:class:`~cope.train.collect.epoch_builder.EpochBuilder`; ``Collected.trained``), so a trained leaf's
advantage does not depend on which others were drawn (a uniform draw of leaves with fixed advantages is an unbiased,
scaled estimate of the whole group's gradient) and node values (:mod:`~cope.train.collect.branching.node_values`) read
the whole tree. Where it differs from QwenGyre, which scores the sampled subset: duplicates count in the baseline as
the samples of the policy they are, so a trajectory sampled ``m`` times is trained once, with its one advantage.
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field

from cope.episode import Episode


@dataclass(frozen=True)
class Chosen:
    """The trained leaves of an epoch: their indices (ascending) and what was dropped."""

    trained: list[int]
    duplicates: int = 0
    capped: int = 0
    twins: dict[int, int] = field(default_factory=dict)  # a duplicate's index -> its first occurrence's


def choose_leaves(episodes: list[Episode], *, dedup: bool, j_max: int | None, rng: random.Random) -> Chosen:
    """The leaves of ``episodes`` (the epoch's, each task's tree together, in creation order) to train (see the module
    doc); ``rng`` draws the J_max subsets, task by task in order of first appearance."""
    if j_max is not None and j_max < 1:
        raise ValueError(f"branch.j_max must be null (no cap) or >= 1, got {j_max}")
    groups: dict[int, list[int]] = {}
    for i, e in enumerate(episodes):
        groups.setdefault(e.group, []).append(i)
    trained: list[int] = []
    twins: dict[int, int] = {}
    duplicates = capped = 0
    for members in groups.values():
        live = [i for i in members if not episodes[i].aborted]
        distinct = live
        if dedup:
            seen: dict[tuple[int, ...], int] = {}
            twins.update((i, seen.setdefault(tuple(episodes[i].tokens), i)) for i in live)
            distinct = [i for i in live if twins[i] == i]
            duplicates += len(live) - len(distinct)
        if j_max is not None and len(distinct) > j_max:
            capped += len(distinct) - j_max
            distinct = rng.sample(distinct, j_max)
        trained += distinct + [i for i in members if episodes[i].aborted]
    return Chosen(sorted(trained), duplicates, capped, {i: t for i, t in twins.items() if i != t})


def fork_from_twins(episodes: list[Episode], chosen: Chosen) -> None:
    """Re-links each child of a duplicate leaf to that leaf's twin (the same ids, so the same ``shared_steps``):
    identical trajectories are one path of the tree, and the child keeps a parent when the duplicate is dropped."""
    for e in episodes:
        e.branch_of = chosen.twins.get(e.branch_of, e.branch_of)
