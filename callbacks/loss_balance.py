"""Adaptive normalization of an auxiliary loss against the policy gradient (CoPE's forecast term).

CoPE (arXiv 2610.20597) normalizes the forecast loss so that the multi-step targets cannot
overwhelm the policy gradient; its exact rule is not known to us. Here, after every training batch,
the named objective's ``scale`` is set so that ``scale * |L_objective|`` tracks
``target_ratio * EMA(|L_reference|)`` (see :class:`cope.losses.forecast.AdaptiveScale`); the new
scale applies from the next batch on. It is a plain float, so no gradient flows through it.

Reads the detached metrics that ``training_step`` returns in its output dict: ``loss/<reference>``
and ``<objective>/raw`` (the unscaled loss; falls back to ``loss/<objective> / scale``). When the
objective owns an ``adaptive`` AdaptiveScale (``ForecastLoss(adaptive_target=...)``), that one is
driven, with its own target ratio; otherwise the callback's own. Under DDP both magnitudes are
averaged over ranks first so that every rank uses the same scale.
"""
from __future__ import annotations

from collections.abc import Mapping

import torch
from lightning.pytorch import Callback

from cope.losses.forecast import AdaptiveScale


class LossBalance(Callback):
    """Keeps an objective's magnitude at a fixed ratio of a reference objective's.

    Args:
        target_ratio: wanted ``|scale * L_objective| / EMA|L_reference|``; > 0.
        beta: EMA decay in [0, 1).
        objective: name of the scaled objective (must have a ``scale`` attribute).
        reference: name of the reference objective (its ``loss/<name>`` is read).
        min_scale, max_scale: clamp of the scale.
    """

    def __init__(
        self,
        target_ratio: float = 0.5,
        beta: float = 0.9,
        objective: str = "forecast",
        reference: str = "pg",
        min_scale: float = 1e-3,
        max_scale: float = 1e3,
    ):
        self._own = AdaptiveScale(target_ratio, beta, min_scale, max_scale)  # validates the numbers
        self.objective, self.reference = objective, reference
        self._obj = None
        self._balancer = self._own

    def _find(self, pl_module):
        objs = list(getattr(pl_module, "objectives", []))
        for obj in objs:
            if obj.name == self.objective:
                if not hasattr(obj, "scale"):
                    raise TypeError(f"LossBalance: objective {self.objective!r} has no `scale` attribute")
                return obj
        raise ValueError(f"LossBalance.objective {self.objective!r} not among the module's objectives {[o.name for o in objs]}")

    def setup(self, trainer, pl_module, stage: str) -> None:
        self._obj = self._find(pl_module)
        owned = getattr(self._obj, "adaptive", None)
        if owned is not None and owned is not self._balancer:
            owned.load_state_dict(self._own.state_dict())  # carries a restored state over
            self._balancer = owned

    def _value(self, x) -> float | None:
        if x is None:
            return None
        return float(x.detach().float().mean()) if torch.is_tensor(x) else float(x)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if not isinstance(outputs, Mapping):
            return
        if self._obj is None:
            self._obj = self._find(pl_module)
        pg = self._value(outputs.get(f"loss/{self.reference}"))
        raw = self._value(outputs.get(f"{self.objective}/raw"))
        if raw is None:
            scaled = self._value(outputs.get(f"loss/{self.objective}"))
            cur = float(self._obj.scale)
            raw = scaled / cur if scaled is not None and cur > 0 else None
        if pg is None or raw is None or (hasattr(self._obj, "adaptive") and self._obj.adaptive is None):
            return  # nothing measured, or the objective is not in adaptive mode (normalize none/per_step)
        if getattr(trainer, "world_size", 1) > 1:
            both = trainer.strategy.reduce(torch.tensor([abs(pg), abs(raw)], device=pl_module.device), reduce_op="mean")
            pg, raw = (float(v) for v in both.tolist())
        self._balancer.update(abs(pg), abs(raw))
        self._obj.scale = self._balancer.scale
        pl_module.log(f"{self.objective}/scale", self._obj.scale, on_step=True, on_epoch=False, batch_size=1)

    def on_train_start(self, trainer, pl_module) -> None:
        if self._obj is not None:
            self._obj.scale = self._balancer.scale  # a resumed run starts from its restored scale

    def state_dict(self) -> dict:
        return self._balancer.state_dict()

    def load_state_dict(self, state_dict: dict) -> None:
        for b in {id(self._own): self._own, id(self._balancer): self._balancer}.values():
            b.load_state_dict(state_dict)
