"""CoPE's callback that feeds the forecast term's adaptive scale (its balance against the policy gradient).

CoPE (arXiv 2610.20597) normalizes the forecast loss so that the multi-step targets cannot
overwhelm the policy gradient; its exact rule is not known to us. Here the objective owns the rule
and its state (:class:`cope.algos.cope.loss.AdaptiveScale` inside ``ForecastLoss``, checkpointed once
with the objective); this callback only measures what the rule balances and reports it to the
objective. It holds no state across steps. Both balanced modes are fed at the end of a step
(``on_train_batch_end``), so a new scale applies from the next batch on and every step's scale is
fixed before the step starts, whatever the order of the trainer's callbacks:

* ``normalize=adaptive`` balances loss values (``objective.observe``): read from the detached metrics
  ``training_step`` returns in its output dict, ``loss/<reference>`` and ``<objective>/raw`` (the
  unscaled loss; falls back to ``loss/<objective> / scale``). Free: no extra forward.
* ``normalize=gradnorm`` balances gradient norms (``objective.observe_gradients``): on every
  ``gradnorm_every_n_steps``-th optimizer step, before the step (``on_train_batch_start``, at the
  parameters the step's gradient is taken at), one extra forward of the policy, live on the first
  micro-batch's rows only, and one backward per objective give ``|grad (w_ref L_ref)|`` and the raw
  (unscaled, unweighted) ``|grad L_objective|``
  (:func:`cope.train.step.grad_stats.measure_gradients`, the same measurement the diagnostics callback
  ``cope.callbacks.grad_stats`` logs from, which is independent of this one: turning the diagnostics
  on or off does not change training). The measurement leaves the step as it was (no ``.grad``
  written, the RNG forked); the norms are reported at the step's end. A step where either objective
  is off (weight 0) measures nothing; between measured steps the scale holds.

Under DDP both magnitudes are averaged over ranks first, so every rank keeps the same scale.
"""
from __future__ import annotations

from collections.abc import Mapping

import torch
from lightning.pytorch import Callback

from cope.train.objectives import ROLLOUT, batch_kind
from cope.train.step.grad_stats import mean_over_ranks, measure_gradients


class LossBalance(Callback):
    """Feeds an adaptive objective the magnitudes it balances against a reference objective.

    Args:
        objective: name of the balanced objective (it must have ``observe`` and ``scale``; ``observe_gradients``
            for ``normalize=gradnorm``).
        reference: name of the reference objective (the policy gradient).
        gradnorm_every_n_steps: ``normalize=gradnorm`` only: measure the gradient norms on optimizer steps whose
            ``global_step`` is a multiple of this (>= 1; the scale holds in between). Each measurement costs one
            extra forward and two backwards.
    """

    def __init__(self, objective: str = "forecast", reference: str = "pg", gradnorm_every_n_steps: int = 1):
        if isinstance(gradnorm_every_n_steps, bool) or not isinstance(gradnorm_every_n_steps, int) or gradnorm_every_n_steps < 1:
            raise ValueError(f"algo.callbacks.loss_balance.gradnorm_every_n_steps must be an int >= 1, got {gradnorm_every_n_steps!r}")
        self.objective, self.reference, self.gradnorm_every_n_steps = objective, reference, gradnorm_every_n_steps
        self._obj = None
        self._norms: tuple[float, float] | None = None  # this step's gradient norms (reference, raw), fed at its end

    def _find(self, pl_module):
        objs = list(getattr(pl_module, "objectives", []))
        for obj in objs:
            if obj.name == self.objective:
                if not hasattr(obj, "observe") or not hasattr(obj, "scale"):
                    raise TypeError(f"LossBalance: objective {self.objective!r} has no adaptive scale (observe/scale)")
                return obj
        raise ValueError(f"LossBalance.objective {self.objective!r} not among the module's objectives {[o.name for o in objs]}")

    def _balance(self, pl_module) -> str | None:
        """What feeds the objective's scale: ``loss`` (adaptive), ``gradient`` (gradnorm) or None (a fixed scale)."""
        if self._obj is None:
            self._obj = self._find(pl_module)
        return getattr(self._obj, "balance", None) if getattr(self._obj, "adaptive", None) is not None else None

    def setup(self, trainer, pl_module, stage: str) -> None:
        self._obj, self._norms = self._find(pl_module), None
        names = [o.name for o in pl_module.objectives]
        if self._balance(pl_module) == "gradient" and self.reference not in names:
            raise ValueError(f"algo.callbacks.loss_balance.reference {self.reference!r} is not among the module's objectives {names} "
                             f"({self.objective} normalize=gradnorm balances its gradient against it)")

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._norms = None
        if (self._balance(pl_module) != "gradient" or trainer.global_step % self.gradnorm_every_n_steps != 0
                or not isinstance(batch, Mapping) or batch_kind(batch) != ROLLOUT):
            return
        step = trainer.global_step
        pair = [o for o in pl_module.objectives if o.name in (self.reference, self.objective) and o.weight_at(step) != 0.0]
        if len(pair) < 2:
            return  # either objective off at this step: nothing to balance (the same on every rank: no collective)
        grads = measure_gradients(trainer, pl_module, batch, pair)
        ref, own = grads[self.reference], grads[self.objective]
        norms = torch.stack([abs(ref.weight) * ref.grad.norm(), own.grad.norm() / float(self._obj.scale)])  # (2,): its loss is raw x scale
        self._norms = tuple(float(v) for v in mean_over_ranks(trainer, norms).tolist())

    @staticmethod
    def _value(x) -> float | None:
        if x is None:
            return None
        return float(x.detach().float().mean()) if torch.is_tensor(x) else float(x)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        balance = self._balance(pl_module)
        if balance == "gradient":
            if self._norms is not None:  # measured before this step: the new scale applies from the next one
                self._obj.observe_gradients(*self._norms)
                self._norms = None
            return
        if balance != "loss" or not isinstance(outputs, Mapping):
            return  # a fixed normalization (none / per_step)
        pg = self._value(outputs.get(f"loss/{self.reference}"))
        raw = self._value(outputs.get(f"{self.objective}/raw"))
        if raw is None:
            scaled = self._value(outputs.get(f"loss/{self.objective}"))
            cur = float(self._obj.scale)
            raw = scaled / cur if scaled is not None and cur > 0 else None
        if pg is None or raw is None:
            return  # nothing measured this step
        if getattr(trainer, "world_size", 1) > 1:
            both = mean_over_ranks(trainer, torch.tensor([abs(pg), abs(raw)], device=pl_module.device))
            pg, raw = (float(v) for v in both.tolist())
        self._obj.observe(abs(pg), abs(raw))
        pl_module.log(f"{self.objective}/scale", self._obj.scale, on_step=True, on_epoch=False, batch_size=1)
