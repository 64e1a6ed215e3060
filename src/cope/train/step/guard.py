"""The optimizer-step guard: a step whose gradient norm is not finite is dropped, and several in a row stop the run.

One bad minibatch (an overflow, a loss that blew up once) must not write NaN into the adapter and the optimizer
moments for the rest of a week-long run; a run whose every step is non-finite must not go on stepping. The module
computes the gradient norm after its backward (under DDP the gradients are already synced, so every rank decides
alike) and asks :meth:`StepGuard.allow` before clipping and stepping.

``module.skip_zero_grad_steps`` also drops a step whose gradient is exactly zero (every group without a reward
spread, no other term with a gradient). AdamW would still move the weights on it: its first moment carries the last
real step's direction for about ten more steps (0.9 per step), so a run whose groups stop differing keeps going
where its last update pointed, with no data behind it. study5's GRPO-on-SFT seed 4 took such steps in epochs 4-8
(`rollout/zero_signal_groups` 1.0, `policy/approx_kl` up to 0.020 between its two minibatches) while it lost its
answer format; rerun with this on, it kept the format and failed anyway (bench/results/study5/zero_grad_check/).
"""
from __future__ import annotations

import contextlib
import logging

import torch

log = logging.getLogger(__name__)


class StepGuard:
    """Counts dropped steps; ``max_in_a_row`` consecutive non-finite steps raise :class:`FloatingPointError`. With
    ``skip_zero``, a step whose gradient norm is exactly 0 is dropped too and counted apart (``zero_skipped``)."""

    def __init__(self, max_in_a_row: int = 3, skip_zero: bool = False):
        if isinstance(max_in_a_row, bool) or not isinstance(max_in_a_row, int) or max_in_a_row < 1:
            raise ValueError(f"module.max_nonfinite_steps must be an int >= 1, got {max_in_a_row!r}")
        self.max_in_a_row, self.skip_zero = max_in_a_row, bool(skip_zero)
        self.skipped = 0  # steps dropped over the run (checkpointed by the module)
        self.zero_skipped = 0  # steps with an exactly zero gradient dropped over the run (checkpointed too)
        self.in_a_row = 0

    def allow(self, norm: torch.Tensor, step: int) -> bool:
        """Whether the step with gradient norm ``norm`` may be taken; counts and logs a dropped one."""
        if torch.isfinite(norm):
            self.in_a_row = 0
            if self.skip_zero and float(norm) == 0.0:  # no signal: no AdamW momentum step either
                self.zero_skipped += 1
                return False
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
