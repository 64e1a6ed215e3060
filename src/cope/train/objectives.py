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
    te_rows: torch.Tensor | None = None  # (P, V) untempered logits predicting the tokens at batch["te_position"] (CoPE TE)


SCHEDULES = ("constant", "linear", "power", "cutoff")
ROLLOUT, FORECAST = "rollout", "forecast"  # batch kinds: a rollout minibatch, or CoPE's separate forecast batch


def batch_kind(batch) -> str:
    """``forecast`` for the separate-update batches of CoPE's forecast samples (``batch["kind"]``), else ``rollout``."""
    return FORECAST if batch.get("kind") == FORECAST else ROLLOUT


class Objective(abc.ABC):
    """Base class: a name, a weight (optionally scheduled), and ``__call__(out, batch) -> (loss, metrics)``.

    Args:
        weight: multiplier of the loss in the total, >= 0 (0 switches the objective off).
        schedule: from ``weight`` to ``final_weight`` over ``schedule_steps`` optimizer steps: ``constant``
            (``weight`` throughout), ``linear``, ``power`` (``weight + (step / steps) ** power x (final - weight)``),
            ``cutoff`` (``weight`` before ``schedule_steps``, ``final_weight`` from then on); flat afterwards.
            (CoPE's coefficient annealing: fixed, linear, power, cutoff.)
        final_weight: end point of the schedule, >= 0.
        schedule_steps: length of the schedule in optimizer steps.
        power: the exponent of the ``power`` schedule, > 0.

    Class attributes: ``batch_kind`` is the kind of batch the objective is computed on (``rollout``: the
    epoch's minibatches; ``forecast``: CoPE's separate forecast batches, see :func:`batch_kind`); ``lr_scale``
    multiplies the learning rate of the optimizer steps taken on batches of that kind (1: the policy's).
    """

    name: str = "objective"
    needs_ref: bool = False  # set when the objective reads ForwardOut.ref_logprobs
    batch_kind: str = ROLLOUT
    lr_scale: float = 1.0

    def __init__(self, weight: float = 1.0, schedule: str = "constant", final_weight: float = 0.0, schedule_steps: int = 0,
                 power: float = 2.0):
        if schedule not in SCHEDULES:
            raise ValueError(f"{type(self).__name__}.schedule must be one of {SCHEDULES}, got {schedule!r}")
        if schedule != "constant" and schedule_steps <= 0:
            raise ValueError(f"{type(self).__name__}.schedule_steps must be > 0 for a {schedule} schedule")
        if not power > 0:
            raise ValueError(f"{type(self).__name__}.power must be > 0, got {power}")
        for key, w in (("weight", weight), ("final_weight", final_weight)):
            if not w >= 0:  # a negative weight would ascend the loss (for KL: push away from the reference)
                raise ValueError(f"{type(self).__name__}.{key} must be >= 0, got {w}")
        self.weight = float(weight)
        self.schedule = schedule
        self.final_weight = float(final_weight)
        self.schedule_steps = int(schedule_steps)
        self.power = float(power)

    def weight_at(self, step: int) -> float:
        if self.schedule == "constant":
            return self.weight
        if self.schedule == "cutoff":
            return self.weight if step < self.schedule_steps else self.final_weight
        frac = min(1.0, step / self.schedule_steps)
        if self.schedule == "power":
            frac = frac**self.power
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
    """Sum of weight * loss over the objectives of the batch's kind (:func:`batch_kind`). Logs each raw loss
    as ``loss/<name>``, its weighted contribution as ``loss/<name>_weighted``, the objective's own metrics,
    and ``loss/total``. An objective whose weight is 0 at this step is off: it is neither computed nor logged."""
    total = out.logprobs.new_zeros(())
    metrics: Metrics = {}
    kind = batch_kind(batch)
    for obj in objectives:
        w = obj.weight_at(step)
        if w == 0.0 or obj.batch_kind != kind:
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
