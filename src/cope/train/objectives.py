"""Objectives: named, weighted loss terms summed in one place, and the contract between them and the forward pass.

Each objective wraps a pure loss function (in :mod:`cope.algos`, beside it) and reads what it needs from the
forward output and the batch. The LightningModule holds a list of them, built from config
(``algo.objectives``), and calls :func:`combine`; adding CoPE or ECHO is adding a list entry.

Every forward gives per-token log-probs and entropy. Anything more an objective states as its :class:`Needs`
(the reference log-probs; full predictive rows at positions a batch key of its own lists); the module fills the union
of what the run's objectives declare (:meth:`Needs.of`) without knowing which objective asked, and one
micro-batch's part of it comes back as :class:`TokenScores`. An objective computed on batches of its own kind (its
own optimizer steps) also declares the prefix of those steps' metrics (:func:`step_prefix`).
"""
from __future__ import annotations

import abc
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

Metrics = dict[str, float | torch.Tensor]


@dataclass(frozen=True)
class Needs:
    """What an objective needs from the forward pass beyond per-token log-probs and entropy.

    Attributes:
        ref_logprobs: the reference policy's per-token log-probs (``ForwardOut.ref_logprobs``, from the scoring pass).
        rows_at: batch keys, each a (P, 2) long tensor of [row, column] positions: the full predictive rows there
            (untempered logits predicting the token at [row, column], (P, V) fp32, with gradient) come back in
            ``ForwardOut.rows[key]``, one row per listed position, in its order. A batch without the key gets none.

    Later needs (hidden states, log-probs at other tokens) are further fields, filled the same way.
    """

    ref_logprobs: bool = False
    rows_at: tuple[str, ...] = ()

    def __or__(self, other: Needs) -> Needs:
        """What both need (the keys in first-declared order)."""
        return Needs(ref_logprobs=self.ref_logprobs or other.ref_logprobs,
                     rows_at=tuple(dict.fromkeys((*self.rows_at, *other.rows_at))))

    @classmethod
    def of(cls, objectives: Iterable[Objective]) -> Needs:
        """What the forward must give ``objectives``: the union of the needs of those whose weight is non-zero at some
        step (a scheduled one that starts at 0 must find its reference log-probs from the epoch's scoring pass)."""
        needs = cls()
        for o in objectives:
            if o.ever_on:
                needs = needs | o.needs
        return needs


@dataclass
class ForwardOut:
    """What one forward pass of the policy gives every objective.

    logprobs[:, t] = log p(input_ids[:, t] | input_ids[:, :t]); at action tokens under the sampling
    distribution softmax(logits / temperature), elsewhere under the model's raw one; 0 at t = 0 and on
    right padding. entropy[:, t] is that predictive distribution's entropy at action tokens, 0 elsewhere.
    The rest is there when an objective of the run declared it (:class:`Needs`).

    Contract for micro-batching (``module.max_tokens_per_microbatch``): an objective's loss is a sum of
    per-row terms (per-position terms for ``rows``) whose normalizers come from the batch's masks, never from other
    rows' log-probs (the module runs it on log-probs live on one micro-batch's rows and constant elsewhere;
    tests/test_microbatch.py checks every objective). Its ``__call__`` has no side effects (it may run several times
    per step).
    """

    logprobs: torch.Tensor  # (N, T)
    entropy: torch.Tensor  # (N, T), detached
    ref_logprobs: torch.Tensor | None = None  # (N, T) from the reference model, when declared (Needs.ref_logprobs)
    rows: dict[str, torch.Tensor] = field(default_factory=dict)  # key -> (P, V) untempered logits at batch[key]'s positions


@dataclass(frozen=True)
class TokenScores:
    """One scoring of some rows of a batch (``AgentRLModule.logprobs``): a micro-batch's part of a :class:`ForwardOut`.

    Attributes:
        logprobs, entropy: (n, T') of the rows and columns scored (entropy 0 where not asked).
        rows: per batch key asked for, (P', V) untempered logits at the key's positions that fall in the rows and
            columns scored (all of them when the whole batch is scored).
        row_index: per batch key, (P',) long: those positions' indices into ``batch[key]``.
    """

    logprobs: torch.Tensor
    entropy: torch.Tensor
    rows: dict[str, torch.Tensor] = field(default_factory=dict)
    row_index: dict[str, torch.Tensor] = field(default_factory=dict)


SCHEDULES = ("constant", "linear", "power", "cutoff")
ROLLOUT = "rollout"  # the epoch's rollout minibatches: the policy steps


def batch_kind(batch) -> str:
    """A batch's kind: ``batch["kind"]`` when it has one (a batch source's own batches, e.g. CoPE's separate forecast
    batches), else ``rollout``."""
    return batch.get("kind") or ROLLOUT


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

    Class attributes: ``needs`` is what it reads from the forward beyond log-probs and entropy (:class:`Needs`);
    ``batch_kind`` is the kind of batch the objective is computed on (``rollout``: the epoch's minibatches; another
    kind: a batch source's own batches, each one optimizer step, see :func:`batch_kind`); ``lr_scale`` multiplies the
    learning rate of the optimizer steps taken on batches of that kind (1: the policy's); ``metric_prefix`` names
    those steps' own metrics (:func:`step_prefix`; None: the kind's name); ``alone`` says it must be the run's only
    objective that is ever on (ECHO without a verifier: :func:`check_objectives`); ``reads_advantages`` says its
    gradient comes from the episodes' advantages, so it learns nothing from an epoch without a reward spread (the
    run-health rule about such epochs applies only when such an objective is on).
    """

    name: str = "objective"
    alone: bool = False
    reads_advantages: bool = False
    needs: Needs = Needs()
    batch_kind: str = ROLLOUT
    lr_scale: float = 1.0
    metric_prefix: str | None = None

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

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if "needs_ref" in cls.__dict__:  # the old declaration would silently shadow the one read from ``needs``
            raise TypeError(f"{cls.__name__}: declare the reference log-probs as needs = Needs(ref_logprobs=True), "
                            "not needs_ref")

    @property
    def needs_ref(self) -> bool:
        """Whether it reads ``ForwardOut.ref_logprobs`` (``needs.ref_logprobs``)."""
        return self.needs.ref_logprobs

    @property
    def ever_on(self) -> bool:
        """Whether its weight is non-zero at some step (a schedule may ramp up from 0 within an epoch)."""
        return self.weight != 0 or (self.schedule != "constant" and self.final_weight != 0)

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


def check_objectives(objectives: list[Objective]) -> None:
    """The cross-objective rules of ``algo.objectives``: at least one, unique names, one metric prefix per batch
    kind other than ``rollout`` (:func:`step_prefix`), and an objective that trains ``alone`` has no other one on
    (the config check refuses the same before any work: :mod:`cope.run.config_rules`)."""
    if not objectives:
        raise ValueError("algo.objectives is empty: at least the policy-gradient objective is needed")
    names = [o.name for o in objectives]
    if len(set(names)) != len(names):
        raise ValueError(f"algo.objectives has duplicate names: {names}")
    for kind in {o.batch_kind for o in objectives} - {ROLLOUT}:
        step_prefix(objectives, kind)
    for o in objectives:
        others = [p.name for p in objectives if p is not o and p.ever_on]
        if o.alone and others:
            raise ValueError(f"algo.objectives.{o.name} trains alone (alone=true), but algo.objectives.{others[0]} is on: "
                             f"set algo.objectives.{others[0]}.weight=0")


def step_prefix(objectives: Iterable[Objective], kind: str) -> str:
    """The metric prefix of optimizer steps on batches of ``kind`` (other than ``rollout``): the ``metric_prefix``
    the objectives of that kind declare (they must agree), else the kind's name. Such a step logs
    ``<prefix>/loss_total``, ``<prefix>/grad_norm`` and ``<prefix>/tokens_forwarded``; ``loss/total`` and
    ``train/grad_norm`` stay the policy steps'."""
    declared = {o.metric_prefix for o in objectives if o.batch_kind == kind and o.metric_prefix}
    if len(declared) > 1:
        raise ValueError(f"the objectives of batch kind {kind!r} declare different metric prefixes: {sorted(declared)}")
    return declared.pop() if declared else kind
