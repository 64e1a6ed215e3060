"""Node-value advantages over branched groups (TreeRL: Hou et al., ACL 2025, arXiv 2506.11902), selected with
``algo.advantage_mode=node_value`` beside ``+collector=branching``.

A branched group (:mod:`cope.train.collect.branching`) is a tree of env steps: a child shares its parent's first
``shared_steps`` steps (the same ids) and owns the rest. Along one leaf's trajectory, the leaves that pass through a
step shrink as the step gets deeper: a *segment* is a maximal run of the trajectory's steps with the same leaves
(TreeRL's node: the text between two forks). Its value V(n) is the mean reward of its valid leaves L(n), TreeRL's
Monte-Carlo estimate from the tree itself; the task, the virtual root above the group's roots, has V(root) = the mean
over every valid leaf of the group. A segment's action tokens get TreeRL's advantage

    A(n) = [(V(n) - V(root)) + (V(n) - V(parent(n)))] / sqrt(|L(n)|)

the global term (how much better than the task's average this node is) plus the local term (how much better than
the node it continues: the previous segment of the trajectory, or the root for a first segment), reweighted by
1/sqrt(|L(n)|) so that a node many leaves share is not trained many times over. Every leaf row containing the node
carries A(n) on its tokens: the per-leaf rows are what is trained (the shared tokens forwarded once with
``data.share_prefix``, their gradient summed over the rows), so a node's total weight is sqrt(|L(n)|) A(n).

With no fork (every episode a root) each episode is one segment with L = {itself}: A = 2 (r - mean), twice Dr.GRPO.

Where this differs from TreeRL: its trees fork inside a generation at high-entropy tokens, these at env-step
boundaries (:mod:`~cope.train.collect.branching.triggers`), so a segment here is whole steps; TreeRL's rewards are 0/1
correctness, here the env's reward, used raw (not std-normalised: advantages are on the reward's scale). Aborted leaves
(an env crash, a replay mismatch) are in no value and get 0; a segment without a valid leaf gets 0.
"""
from __future__ import annotations

import math
from collections.abc import Sequence

from cope.episode import Episode

NODE_VALUE = "node_value"  # the algo.advantage_mode that selects it


def _through(x: int, s: int, children: dict[int, list[int]], shared: list[int]) -> list[int]:
    """The episodes whose trajectories pass through step ``s`` (0-based) of ``x``, where ``s`` is ``x``'s own step or
    one it shares: ``x`` and, recursively, its children forked after step ``s``."""
    out = [x]
    for c in children.get(x, ()):
        if shared[c] > s:
            out += _through(c, s, children, shared)
    return out


def node_value_advantages(episodes: Sequence[Episode], groups: Sequence[int]) -> list[list[float]]:
    """Per episode, the advantage of each of its steps (see the module doc). ``episodes[i].branch_of`` indexes
    ``episodes`` (the collector's list) and must point to an earlier episode of the same group; raises ValueError
    otherwise."""
    n = len(episodes)
    parent = [e.branch_of for e in episodes]
    shared = [e.shared_steps if e.branch_of >= 0 else 0 for e in episodes]
    children: dict[int, list[int]] = {}
    for i, p in enumerate(parent):
        if p < 0:
            continue
        if not 0 <= p < i or groups[p] != groups[i]:
            raise ValueError(f"episode {i}: branch_of={p} is not an earlier episode of its group {groups[i]}")
        if shared[i] > episodes[p].num_steps:
            raise ValueError(f"episode {i} shares {shared[i]} steps of a parent with {episodes[p].num_steps}")
        children.setdefault(p, []).append(i)
    valid = [not e.aborted for e in episodes]
    reward = [float(e.reward) for e in episodes]

    def value(members: list[int]) -> tuple[float, int]:
        got = [reward[m] for m in members if valid[m]]
        return (sum(got) / len(got), len(got)) if got else (0.0, 0)

    root_value = {g: value([i for i in range(n) if groups[i] == g])[0] for g in set(groups)}
    out: list[list[float]] = []
    for i, e in enumerate(episodes):
        steps: list[float] = []
        previous, prev_members = root_value[groups[i]], None
        adv = 0.0
        for s in range(e.num_steps):
            owner = i
            while s < shared[owner]:
                owner = parent[owner]
            members = sorted(_through(owner, s, children, shared))
            if members != prev_members:  # a new segment: the leaves shrank
                if prev_members is not None:
                    previous = value(prev_members)[0]
                v, count = value(members)
                adv = (2.0 * v - root_value[groups[i]] - previous) / math.sqrt(count) if count else 0.0
                prev_members = members
            steps.append(adv)
        out.append(steps)
    return out
