"""Objectives: named, weighted loss terms summed in one place.

Each objective wraps a pure loss function (in :mod:`cope.algos`, beside it) and reads what it needs from the
forward output and the batch. The LightningModule holds a list of them, built from config
(``algo.objectives``), and calls :func:`combine`; adding CoPE or ECHO is adding a list entry.
"""
from __future__ import annotations

import abc
from dataclasses import dataclass

import torch

Metrics = dict[str, float | torch.Tensor]


@dataclass
class ForwardOut:
    """What one forward pass of the policy gives every objective.

    logprobs[:, t] = log p(input_ids[:, t] | input_ids[:, :t]); at action tokens under the sampling
    distribution softmax(logits / temperature), elsewhere under the model's raw one; 0 at t = 0 and on
    right padding. entropy[:, t] is that predictive distribution's entropy at action tokens, 0 elsewhere.

    Contract for micro-batching (``module.max_tokens_per_microbatch``): an objective's loss is a sum of
    per-row terms whose normalizers come from the batch's masks, never from other rows' log-probs (the
    module runs it on log-probs live on one micro-batch's rows and constant elsewhere; tests/test_microbatch.py
    checks every objective). Its ``__call__`` has no side effects (it may run several times per step).
    """

    logprobs: torch.Tensor  # (N, T)
    entropy: torch.Tensor  # (N, T), detached
    ref_logprobs: torch.Tensor | None = None  # (N, T) from the adapter-disabled model, when needed


class Objective(abc.ABC):
    """Base class: a name, a weight (optionally scheduled), and ``__call__(out, batch) -> (loss, metrics)``.

    Args:
        weight: multiplier of the loss in the total, >= 0 (0 switches the objective off).
        schedule: ``constant`` or ``linear`` (from ``weight`` to ``final_weight`` over ``schedule_steps``
            optimizer steps, then flat).
        final_weight: end point of the linear schedule, >= 0.
        schedule_steps: length of the linear schedule in optimizer steps.
    """

    name: str = "objective"
    needs_ref: bool = False  # set when the objective reads ForwardOut.ref_logprobs

    def __init__(self, weight: float = 1.0, schedule: str = "constant", final_weight: float = 0.0, schedule_steps: int = 0):
        if schedule not in ("constant", "linear"):
            raise ValueError(f"{type(self).__name__}.schedule must be 'constant' or 'linear', got {schedule!r}")
        if schedule == "linear" and schedule_steps <= 0:
            raise ValueError(f"{type(self).__name__}.schedule_steps must be > 0 for a linear schedule")
        for key, w in (("weight", weight), ("final_weight", final_weight)):
            if not w >= 0:  # a negative weight would ascend the loss (for KL: push away from the reference)
                raise ValueError(f"{type(self).__name__}.{key} must be >= 0, got {w}")
        self.weight = float(weight)
        self.schedule = schedule
        self.final_weight = float(final_weight)
        self.schedule_steps = int(schedule_steps)

    def weight_at(self, step: int) -> float:
        if self.schedule == "constant":
            return self.weight
        frac = min(1.0, step / self.schedule_steps)
        return self.weight + frac * (self.final_weight - self.weight)

    @abc.abstractmethod
    def __call__(self, out: ForwardOut, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, Metrics]:
        """Return (loss, metrics); metrics use slash names."""

    def state_dict(self) -> dict:
        """State that must survive a resume (checkpointed once, by the module, under ``objectives``)."""
        return {}

    def load_state_dict(self, state: dict) -> None:  # noqa: B027 - a stateless objective has nothing to restore
        """Restores :meth:`state_dict`."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r}, weight={self.weight})"


def combine(objectives: list[Objective], out: ForwardOut, batch: dict[str, torch.Tensor], step: int) -> tuple[torch.Tensor, Metrics]:
    """Sum of weight * loss over the objectives. Logs each raw loss as ``loss/<name>``, its weighted
    contribution as ``loss/<name>_weighted``, the objective's own metrics, and ``loss/total``.
    An objective whose weight is 0 at this step is off: it is neither computed nor logged."""
    total = out.logprobs.new_zeros(())
    metrics: Metrics = {}
    for obj in objectives:
        w = obj.weight_at(step)
        if w == 0.0:
            continue
        loss, m = obj(out, batch)
        total = total + w * loss
        metrics[f"loss/{obj.name}"] = loss.detach()
        metrics[f"loss/{obj.name}_weighted"] = (w * loss).detach()
        if obj.schedule != "constant":
            metrics[f"weight/{obj.name}"] = w
        metrics.update(m)
    metrics["loss/total"] = total.detach()
    return total, metrics
