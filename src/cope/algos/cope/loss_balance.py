"""Adaptive normalization of an auxiliary loss against the policy gradient (CoPE's forecast term).

CoPE (arXiv 2610.20597) normalizes the forecast loss so that the multi-step targets cannot
overwhelm the policy gradient; its exact rule is not known to us. Here the objective owns the rule
and its state (:class:`cope.algos.cope.loss.AdaptiveScale` inside ``ForecastLoss(normalize=adaptive)``:
``scale * |L_objective|`` tracks ``target_ratio * EMA(|L_reference|)``, checkpointed once with the
objective). This callback only reports each step's two magnitudes to it (``objective.observe``);
the new scale applies from the next batch on. It holds no state of its own.

``normalize=gradnorm`` balances gradient norms instead; those are measured and fed by the
``GradientStats`` callback (``cope.callbacks.grad_stats``), and this callback leaves such an
objective alone. It does check, at setup, that the feeder is there (``callbacks.grad_stats`` with
``every_n_steps >= 1``): without it the scale would silently stay 1. The check lives here, not in
``GradientStats``, because this callback already finds the objective and is part of ``algo=cope``,
whereas ``GradientStats`` may be absent altogether (the config path also fails earlier, in
:mod:`cope.config_check`, before the model is built).

Reads the detached metrics that ``training_step`` returns in its output dict: ``loss/<reference>``
and ``<objective>/raw`` (the unscaled loss; falls back to ``loss/<objective> / scale``). Under DDP
both magnitudes are averaged over ranks first, so every rank keeps the same scale.
"""
from __future__ import annotations

from collections.abc import Mapping

import torch
from lightning.pytorch import Callback


class LossBalance(Callback):
    """Feeds an adaptive objective the magnitudes it balances against a reference objective.

    Args:
        objective: name of the balanced objective (it must have ``observe`` and ``scale``).
        reference: name of the reference objective (its ``loss/<name>`` is read).
    """

    def __init__(self, objective: str = "forecast", reference: str = "pg"):
        self.objective, self.reference = objective, reference
        self._obj = None

    def _find(self, pl_module):
        objs = list(getattr(pl_module, "objectives", []))
        for obj in objs:
            if obj.name == self.objective:
                if not hasattr(obj, "observe") or not hasattr(obj, "scale"):
                    raise TypeError(f"LossBalance: objective {self.objective!r} has no adaptive scale (observe/scale)")
                return obj
        raise ValueError(f"LossBalance.objective {self.objective!r} not among the module's objectives {[o.name for o in objs]}")

    def setup(self, trainer, pl_module, stage: str) -> None:
        self._obj = self._find(pl_module)
        if getattr(self._obj, "balance", None) == "gradient":
            # GradientStats.measures_gradients: on (every_n_steps >= 1); read by name, so no import of cope.callbacks
            if not any(getattr(cb, "measures_gradients", False) for cb in getattr(trainer, "callbacks", [])):
                raise ValueError(f"{self.objective} normalize=gradnorm (cope.normalize=gradnorm) needs the gradient-norm "
                                 "measurements of the GradientStats callback: set callbacks.grad_stats.every_n_steps >= 1 "
                                 "(or use cope.normalize=adaptive, which balances loss values)")

    @staticmethod
    def _value(x) -> float | None:
        if x is None:
            return None
        return float(x.detach().float().mean()) if torch.is_tensor(x) else float(x)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if not isinstance(outputs, Mapping):
            return
        if self._obj is None:
            self._obj = self._find(pl_module)
        if getattr(self._obj, "adaptive", None) is None or getattr(self._obj, "balance", "loss") != "loss":
            return  # a fixed normalization (none / per_step), or one GradientStats feeds (gradnorm)
        pg = self._value(outputs.get(f"loss/{self.reference}"))
        raw = self._value(outputs.get(f"{self.objective}/raw"))
        if raw is None:
            scaled = self._value(outputs.get(f"loss/{self.objective}"))
            cur = float(self._obj.scale)
            raw = scaled / cur if scaled is not None and cur > 0 else None
        if pg is None or raw is None:
            return  # nothing measured this step
        if getattr(trainer, "world_size", 1) > 1:
            both = trainer.strategy.reduce(torch.tensor([abs(pg), abs(raw)], device=pl_module.device), reduce_op="mean")
            pg, raw = (float(v) for v in both.tolist())
        self._obj.observe(abs(pg), abs(raw))
        pl_module.log(f"{self.objective}/scale", self._obj.scale, on_step=True, on_epoch=False, batch_size=1)
