"""Branched rollouts: each task's GRPO group sampled as a tree whose children fork from a parent's state,
so the turns they share are generated and env-stepped once.

:mod:`~cope.train.collect.branching.forks` (an env's fork: a copy, or a checked replay),
:mod:`~cope.train.collect.branching.triggers` (where to fork), :mod:`~cope.train.collect.branching.tree` (the waves
on the ordinary rollout loop), :mod:`~cope.train.collect.branching.stops` (children stopped early),
:mod:`~cope.train.collect.branching.leaves` (which leaves are trained: dedup, J_max) and
:mod:`~cope.train.collect.branching.collector` (the collector of ``data.collector``, ``+collector=branching``).
"""
