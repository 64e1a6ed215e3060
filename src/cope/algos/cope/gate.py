"""CoPE's success gate: which of an epoch's episodes give forecast targets, one rule for both variants.

The authors' samples (:mod:`cope.algos.cope.prompted`, ``algo=cope``) and the continuation targets
(:mod:`cope.algos.cope.chunks`, ``algo=cope_continuation``) read the same two keys: ``cope.gate`` and
``cope.success_threshold``. A *win* is a non-aborted episode whose reward exceeds the threshold (``reward > t``, the
authors' rule, their code's 0.5), or, with no threshold (null), one the env flags as a success (``Episode.success``:
for envs whose reward does not say it). The gates:

* ``wins``: the wins;
* ``all``: every non-aborted episode;
* ``mixed``: the wins of groups that also lost (a group where every episode won teaches nothing new; the authors'
  third gate). Aborted episodes never give targets and, as in GRPO's statistics, do not count in their group.
"""
from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from cope.episode import Episode

GATES = ("wins", "all", "mixed")


def check_gate(gate: str, key: str = "cope.gate") -> None:
    """``gate`` is one of :data:`GATES` (ValueError naming ``key``)."""
    if gate not in GATES:
        raise ValueError(f"{key} must be one of {GATES}, got {gate!r}")


def is_win(ep: Episode, success_threshold: float | None) -> bool:
    """A non-aborted episode with ``reward > success_threshold`` (None: the env's success flag)."""
    if ep.aborted:
        return False
    return ep.success if success_threshold is None else ep.reward > success_threshold


def kept_episodes(episodes: Sequence[Episode], gate: str, success_threshold: float | None) -> tuple[list[bool], int]:
    """Which episodes give targets under ``gate``, and the number of all-win groups ``mixed`` skipped."""
    win = [is_win(ep, success_threshold) for ep in episodes]
    if gate == "wins":
        return win, 0
    if gate == "all":
        return [not ep.aborted for ep in episodes], 0
    wins: Counter[int] = Counter()
    size: Counter[int] = Counter()
    for ep, w in zip(episodes, win):
        if not ep.aborted:
            size[ep.group] += 1
            wins[ep.group] += w
    mixed = {g for g in size if 0 < wins[g] < size[g]}
    return [w and ep.group in mixed for ep, w in zip(episodes, win)], sum(wins[g] == size[g] for g in size)
