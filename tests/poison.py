"""A test-only objective whose gradient is NaN on chosen calls (composed in with ``+algo.objectives.poison``)."""
from __future__ import annotations

import torch

from cope.train.objectives import ForwardOut, Objective


class PoisonLoss(Objective):
    """NaN on its ``bad_calls``-th gradient-carrying calls (0-based; None: every call), 0 otherwise."""

    name = "poison"

    def __init__(self, bad_calls: list[int] | None = None, weight: float = 1.0):
        super().__init__(weight=weight)
        self.bad_calls, self.calls = bad_calls, 0

    def __call__(self, out: ForwardOut, batch: dict) -> tuple[torch.Tensor, dict]:
        zero = out.logprobs.sum() * 0.0
        if not torch.is_grad_enabled() or not out.logprobs.requires_grad:
            return zero.detach(), {}
        bad = self.bad_calls is None or self.calls in self.bad_calls
        self.calls += 1
        return (zero * float("nan") if bad else zero), {}


class PulseLoss(Objective):
    """A real gradient (the action tokens' log-likelihood) on its ``good_calls``-th gradient-carrying calls, exactly
    zero otherwise: with ``data.group_size=1`` (no advantage) the steps after a pulse have no signal at all."""

    name = "pulse"

    def __init__(self, good_calls: list[int], weight: float = 1.0):
        super().__init__(weight=weight)
        self.good_calls, self.calls = list(good_calls), 0

    def __call__(self, out: ForwardOut, batch: dict) -> tuple[torch.Tensor, dict]:
        if not torch.is_grad_enabled() or not out.logprobs.requires_grad:
            return out.logprobs.sum().detach() * 0.0, {}
        good = self.calls in self.good_calls
        self.calls += 1
        return -out.logprobs.sum() * (1.0 if good else 0.0), {}
