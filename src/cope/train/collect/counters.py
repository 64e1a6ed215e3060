"""The run's cumulative experience counters: episodes, env steps, generated and trained tokens, over all ranks.

Every epoch adds what each rank collected and trained, summed over the ranks (one all-reduce in the main thread, so
every rank holds the same totals), and the totals are never reset: they survive a resume in the DataModule's
checkpoint state (``counters``) and are what sample-efficiency curves are plotted against (``counters/*``,
:mod:`cope.callbacks.sample_efficiency`). The counters read like the plain dict they are saved as.
"""
from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any, Callable

import torch

COUNTERS = ("episodes", "env_steps", "generated_tokens", "train_tokens")
Reduce = Callable[..., list[float]]  # reduce(values, op="sum" | "max") over the ranks, as reduce_over_ranks


def reduce_over_ranks(trainer: Any, values: list[float], op: str = "sum") -> list[float]:
    """``values`` reduced over the DDP ranks of ``trainer`` (``sum`` or ``max``, in float64: token counts stay exact);
    as they are in one process or without a trainer. A collective: every rank calls it, in the main thread."""
    if trainer is None or trainer.world_size == 1:
        return values
    t = torch.tensor(values, dtype=torch.float64, device=trainer.strategy.root_device)  # (len(values),)
    return trainer.strategy.reduce(t, reduce_op=op).tolist()


class RunCounters(Mapping[str, int]):
    """The totals of :data:`COUNTERS` so far, the same on every rank (a read-only mapping: ``dict(counters)``)."""

    def __init__(self) -> None:
        self._totals = dict.fromkeys(COUNTERS, 0)

    def __getitem__(self, key: str) -> int:
        return self._totals[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._totals)

    def __len__(self) -> int:
        return len(self._totals)

    def add(self, reduce: Reduce, *, episodes: int, env_steps: int, generated_tokens: int, train_tokens: int) -> None:
        """Adds one epoch's counts of this rank, summed over the ranks with ``reduce`` (a collective)."""
        inc = reduce([episodes, env_steps, generated_tokens, train_tokens])
        for k, v in zip(COUNTERS, inc):
            self._totals[k] += int(v)

    def metrics(self) -> dict[str, float]:
        """The totals as ``counters/<name>`` metrics."""
        return {f"counters/{k}": float(v) for k, v in self._totals.items()}

    def state_dict(self) -> dict[str, int]:
        return dict(self._totals)

    def load_state_dict(self, state: Mapping[str, int]) -> None:
        self._totals.update(state)
