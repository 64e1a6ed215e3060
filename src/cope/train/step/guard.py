"""The optimizer-step guard: a step whose gradient norm is not finite is dropped, and several in a row stop the run.

One bad minibatch (an overflow, a loss that blew up once) must not write NaN into the adapter and the optimizer
moments for the rest of a week-long run; a run whose every step is non-finite must not go on stepping. The module
computes the gradient norm after its backward (under DDP the gradients are already synced, so every rank decides
alike) and asks :meth:`StepGuard.allow` before clipping and stepping.
"""
from __future__ import annotations

import contextlib
import logging

import torch

log = logging.getLogger(__name__)


class StepGuard:
    """Counts dropped steps; ``max_in_a_row`` consecutive non-finite steps raise :class:`FloatingPointError`."""

    def __init__(self, max_in_a_row: int = 3):
        if isinstance(max_in_a_row, bool) or not isinstance(max_in_a_row, int) or max_in_a_row < 1:
            raise ValueError(f"module.max_nonfinite_steps must be an int >= 1, got {max_in_a_row!r}")
        self.max_in_a_row = max_in_a_row
        self.skipped = 0  # steps dropped over the run (checkpointed by the module)
        self.in_a_row = 0

    def allow(self, norm: torch.Tensor, step: int) -> bool:
        """Whether the step with gradient norm ``norm`` may be taken; counts and logs a dropped one."""
        if torch.isfinite(norm):
            self.in_a_row = 0
            return True
        self.skipped += 1
        self.in_a_row += 1
        log.warning("optimizer step skipped: gradient norm %s at global step %d (%d in a row, %d in all)",
                    float(norm), step, self.in_a_row, self.skipped)
        if self.in_a_row >= self.max_in_a_row:
            raise FloatingPointError(
                f"{self.in_a_row} optimizer steps in a row had a non-finite gradient norm ({float(norm)}): the loss "
                "diverged (a learning rate too high, a bad objective weight, fp16 overflow). The last checkpoint holds the "
                "weights before it; module.max_nonfinite_steps sets how many in a row are tolerated")
        return False


@contextlib.contextmanager
def lr_scaled(opt, scale: float):
    """Every param group's learning rate times ``scale`` for the steps taken inside (CoPE's separate forecast steps
    take the policy's optimizer at ``lr_scale`` times its rate), restored afterwards."""
    if scale == 1.0:
        yield
        return
    saved = [g["lr"] for g in opt.param_groups]
    for g in opt.param_groups:
        g["lr"] = g["lr"] * scale
    try:
        yield
    finally:
        for g, lr in zip(opt.param_groups, saved):
            g["lr"] = lr
