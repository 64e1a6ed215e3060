"""Epoch metrics that cover every rank: per-rank tallies summed over ranks, then logged as the global values they are.

Under DDP each rank measures its own share (its episodes, its part of the held-out panel). A callback adds up
what it counts (sums and counts, never means) into a tally, :func:`pool` sums the tallies over ranks in one
float64 all-reduce, and every logged value is a count or a quotient of two pooled sums: a share over all ranks'
rows, not a mean of per-rank shares (which would weigh a rank with one episode like a rank with thirty).

:func:`log_global` then logs those values, equal on every rank, with ``sync_dist=True`` and ``reduce_fx="max"``:
the maximum of equal values is that value, so Lightning's reduction changes nothing, and the metric is declared
as reduced over ranks (Lightning warns about any epoch-level metric logged without ``sync_dist`` in a
distributed run, since it cannot tell a global value from a rank's own). docs/metrics.md lists each family's
reduction.
"""
from __future__ import annotations

import torch


def pool(tally: dict[str, float], strategy, device: torch.device | str = "cpu") -> dict[str, float]:
    """``tally`` summed over the ranks of ``strategy`` (a Lightning strategy; one all-reduce, in float64
    so token counts and NLL sums stay exact). Every rank must call it, with the same keys in the same order
    (a dict built from one key tuple), also with nothing counted."""
    keys = list(tally)
    local = torch.tensor([float(tally[k]) for k in keys], dtype=torch.float64, device=device)  # (len(keys),)
    total = strategy.reduce(local, reduce_op="sum")
    return dict(zip(keys, total.tolist()))


def log_global(pl_module, metrics: dict[str, float]) -> None:
    """Logs epoch ``metrics`` whose values are already global (computed from :func:`pool`-ed tallies, equal on
    every rank). Every rank must call it with the same keys: Lightning's reduction is one collective per key."""
    pl_module.log_dict(metrics, on_step=False, on_epoch=True, sync_dist=True, reduce_fx="max", batch_size=1)
