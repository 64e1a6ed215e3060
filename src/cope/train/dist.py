"""Epoch metrics that cover every rank: per-rank tallies summed over ranks, then logged as the global values they are.

Under DDP each rank measures its own share (its episodes, its part of the held-out panel). Whoever logs an epoch
metric adds up what it counts (sums and counts, never means) into a tally, :func:`pool` sums the tallies over ranks
in one float64 all-reduce, and every logged value is a count or a quotient of two pooled sums: a share over all
ranks' rows, not a mean of per-rank shares (which would weigh a rank with one episode like a rank with thirty).

:func:`log_global` then logs those values, equal on every rank, with ``sync_dist=True`` and ``reduce_fx="max"``:
the maximum of equal values is that value, so Lightning's reduction changes nothing, and the metric is declared
as reduced over ranks (Lightning warns about any epoch-level metric logged without ``sync_dist`` in a
distributed run, since it cannot tell a global value from a rank's own). docs/metrics.md lists each family's
reduction.

The module's own epoch metrics (``rollout/*``, ``env/*`` from :attr:`cope.records.EpochRecord.tally`, ``val/*``
from :attr:`cope.records.ValidationRecord.tally`) go through :func:`log_rollout_metrics` and
:func:`log_val_metrics`. In one process the pooled tally is the rank's own, so the values are those of
:func:`cope.rollout.metrics.episode_metrics` bit for bit.

Step metrics (the optimizer steps' rows, the gradient statistics) are a rank's own values, written at once by rank
zero with :func:`log_now`.
"""
from __future__ import annotations

import torch

from cope.rollout.metrics import episode_tally, tally_metrics


def log_now(loggers, metrics: dict, step: int) -> None:
    """``metrics`` as one row at ``step`` in each of ``loggers``, saved at once, as Lightning's logger connector
    saves its own rows. ``CSVLogger.log_metrics`` alone buffers a row until the next save (100 steps later, or
    Lightning's next row): a SIGKILL between an epoch's checkpoint and that epoch's metrics row lost the epoch's
    step rows for good (tests/test_ddp_resume.py)."""
    for logger in loggers:
        logger.log_metrics(metrics, step=step)
        logger.save()


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


def rollout_metrics(tally: dict[str, float]) -> dict[str, float]:
    """The epoch's ``rollout/*`` and ``env/*`` values from a (pooled) :attr:`cope.records.EpochRecord.tally`:
    ``rollout/*`` the ratios of its ``rollout/`` sums (:func:`cope.rollout.metrics.tally_metrics`) and of its
    ``adv/`` group counts (``rollout/zero_signal_groups``), ``env/*`` its event counts as they are."""
    episodes = {k.split("/", 1)[1]: v for k, v in tally.items() if k.startswith("rollout/")}
    out = tally_metrics(episodes, "rollout") if episodes else {}
    if "adv/groups" in tally:
        out["rollout/zero_signal_groups"] = tally["adv/zero_signal_groups"] / max(tally["adv/groups"], 1.0)
    out.update({k: v for k, v in tally.items() if k.startswith("env/")})
    return out


def log_rollout_metrics(pl_module, metrics: dict[str, float], tally: dict[str, float]) -> None:
    """Logs the epoch's ``metrics`` (a record's, this rank's own): the ones ``tally`` covers as global values
    (:func:`rollout_metrics` of the tally pooled over ranks, :func:`log_global`), the others (``perf/*``,
    ``counters/*``, ``rollout/logprob_gap``, ...) with Lightning's mean over ranks as before, a ``*_max`` with the
    maximum over ranks. An empty ``tally`` pools nothing."""
    pooled = rollout_metrics(pool(tally, pl_module.trainer.strategy, pl_module.device)) if tally else {}
    rest = {k: v for k, v in metrics.items() if k not in pooled and not k.endswith("_max")}
    pl_module.log_dict(rest, on_step=False, on_epoch=True, sync_dist=True)
    maxima = {k: v for k, v in metrics.items() if k not in pooled and k.endswith("_max")}  # rollout/logprob_gap_max
    pl_module.log_dict(maxima, on_step=False, on_epoch=True, sync_dist=True, reduce_fx="max")
    log_global(pl_module, pooled)


def log_val_metrics(pl_module, record) -> None:
    """Logs ``val/*`` of the whole held-out panel: the ratios of ``record``'s tally (this rank's
    :class:`cope.records.ValidationRecord`, None: no episodes) pooled over ranks."""
    tally = record.tally if record is not None else episode_tally([])
    log_global(pl_module, tally_metrics(pool(tally, pl_module.trainer.strategy, pl_module.device), "val"))
