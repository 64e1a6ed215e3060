"""RWML's "too easy" filter: triplets that are always predicted right are mostly dropped.

Follows RWML (arXiv 2602.05842): a triplet that a weaker model always predicts correctly teaches little (its GRPO group
has zero advantage anyway) and crowds out the hard ones, so it is kept only with probability 0.1. Where we differ:
there is no second, weaker model here; the current policy's own G predictions stand in for it, so "always correct"
is "all G predictions of this epoch scored 1". The draw comes from the caller's random stream (the collector's, derived
from the run seed, the rank and the epoch): the same triplets are kept after a resume.
"""
from __future__ import annotations

import random


def all_correct(rewards: list[float]) -> bool:
    """Every prediction of the triplet scored 1 (an empty group is not)."""
    return bool(rewards) and all(r == 1.0 for r in rewards)


def keep_triplets(rewards: list[list[float]], easy_keep: float, rng: random.Random) -> list[bool]:
    """Which triplets stay: every one that is not all-correct, and each all-correct one with probability
    ``easy_keep`` (one draw from ``rng`` per all-correct triplet, in order).

    Args:
        rewards: per triplet, the rewards of its G predictions.
        easy_keep: the keep probability of an all-correct triplet, in [0, 1] (RWML: 0.1).
        rng: the draws' stream.
    """
    if not 0.0 <= easy_keep <= 1.0:
        raise ValueError(f"rwml.easy_keep must be in [0, 1], got {easy_keep}")
    return [not all_correct(g) or rng.random() < easy_keep for g in rewards]
