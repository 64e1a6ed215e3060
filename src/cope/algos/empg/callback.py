"""EMPG (arXiv 2509.09265) switched on from config: reshapes the epoch's advantages per step.

Registers a *scored* transform on the LightningModule (``add_scored_transform``), so it runs once per
epoch after the module's scoring pass filled ``old_entropy`` and before any update; statistics span
the whole rollout batch. The math is in :mod:`cope.algos.empg.advantages`; this callback only wires it in and logs
``empg/*`` once per epoch (at its end). Under DDP each rank scales its own batch (the statistics are the rank's);
the logged values are reduced over ranks (see :meth:`EMPGAdvantages.on_train_epoch_end`).
"""
from __future__ import annotations

from lightning.pytorch import Callback

from cope.algos.empg.advantages import apply_empg


class EMPGAdvantages(Callback):
    """Args:
        k: sharpness of the self-calibrating scale g(H) = exp(-k Hn) / mean exp(-k Hn).
        k_future: sharpness of the future-clarity bonus exp(-k_future Hn_{t+1}).
        zeta: weight of the future-clarity bonus.
        normalize: zero-mean / unit-std the final advantages over the batch's action tokens.
    """

    def __init__(self, k: float = 1.0, k_future: float = 1.0, zeta: float = 0.1, normalize: bool = True):
        if k < 0 or k_future < 0 or zeta < 0:
            raise ValueError("EMPGAdvantages: k, k_future and zeta must be >= 0")
        self.k, self.k_future, self.zeta, self.normalize = k, k_future, zeta, normalize
        self.metrics: dict[str, float] = {}
        self._registered = False

    def setup(self, trainer, pl_module, stage: str) -> None:
        if not self._registered:
            if not hasattr(pl_module, "add_scored_transform"):
                raise TypeError("EMPGAdvantages needs a module with add_scored_transform (cope.train.module.AgentRLModule)")
            pl_module.add_scored_transform(self.transform)
            self._registered = True

    def transform(self, minibatches: list[dict], episodes) -> None:
        m = apply_empg(minibatches, k=self.k, k_future=self.k_future, zeta=self.zeta, normalize=self.normalize)
        self.metrics = {k: float(v) for k, v in m.items()}

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        """Logs ``empg/*`` reduced over ranks (each rank scales its own batch): the step count summed, the extremes
        as extremes, the means weighted by each rank's steps (Lightning's mean reduction with ``batch_size``)."""
        m, self.metrics = self.metrics, {}
        if not m:
            return
        steps = int(m["empg/steps"])
        pl_module.log("empg/steps", m["empg/steps"], on_step=False, on_epoch=True, sync_dist=True, reduce_fx="sum", batch_size=1)
        for key, fx in (("empg/scale_min", "min"), ("empg/scale_max", "max")):
            pl_module.log(key, m[key], on_step=False, on_epoch=True, sync_dist=True, reduce_fx=fx, batch_size=1)
        for key in ("empg/scale_mean", "empg/bonus_mean"):
            pl_module.log(key, m[key], on_step=False, on_epoch=True, sync_dist=True, reduce_fx="mean", batch_size=max(steps, 1))
