"""What RWML asks of the run around it: whether the engine can complete token contexts, and sums over the ranks.

:func:`engine_completes` reads the engine's ``completes`` capability (``engine.complete``, the optional method of
:class:`cope.rollout.engine.RolloutEngine`) through :func:`cope.capabilities.can`.

:func:`reduce_over_world` is a collective of the collector: every rank calls it in the main thread, at the same
point of its epoch (the DataModule's own reductions work the same way). Without an initialized process group, or in
one process, the values come back as they are.
"""
from __future__ import annotations

from typing import Any

import torch

from cope.capabilities import can


def engine_completes(engine: Any) -> bool:
    """Whether ``engine`` (an object or a class) declares ``completes``: samples plain continuations of token
    contexts (``complete``)."""
    return can(engine, "completes")


def reduce_over_world(values: list[float], op: str, world: int) -> list[float]:
    """``values`` reduced over the ranks (``sum``, ``min`` or ``max``, in float64) when ``world`` > 1 and a process
    group is up; as they are otherwise."""
    if op not in ("sum", "min", "max"):
        raise ValueError(f"reduce_over_world: op must be sum, min or max, got {op!r}")
    import torch.distributed as dist

    if world <= 1 or not dist.is_available() or not dist.is_initialized():
        return [float(v) for v in values]
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    t = torch.tensor([float(v) for v in values], dtype=torch.float64, device=device)  # (len(values),)
    dist.all_reduce(t, op={"sum": dist.ReduceOp.SUM, "min": dist.ReduceOp.MIN, "max": dist.ReduceOp.MAX}[op])
    return t.tolist()
