"""The epoch's trust region (``module.max_approx_kl``): PPO's early stop on the approximate KL.

Stable-Baselines3's ``target_kl``, without its 1.5 factor. Once a rollout minibatch's ``policy/approx_kl`` (the policy
now against the one that sampled the epoch, mean over ranks) exceeds the limit, that policy step and the epoch's later
ones are not taken: the importance ratios are trusted only near the sampler. CoPE's separate forecast steps (no ratio)
are not the trust region's. The demo's collapse came from such excursions (README: "The demo's collapse").

The module asks :func:`kl_stop` before a minibatch's forward (an earlier step tripped it: the step is not forwarded)
and, after the forward, with the step's metrics: its KL is averaged over ranks and handed to :meth:`TrustRegion.measure`
(so every rank decides alike) before :meth:`TrustRegion.stops` answers. The dropped steps are counted over the run and
checkpointed.
"""
from __future__ import annotations

import logging

import torch

from cope.train.objectives import ROLLOUT

log = logging.getLogger(__name__)


class TrustRegion:
    """Which policy steps of an epoch fall outside ``max_approx_kl`` (None: no limit, every step is taken)."""

    def __init__(self, max_approx_kl: float | None = None):
        if max_approx_kl is not None and not max_approx_kl > 0:
            raise ValueError(f"module.max_approx_kl must be null or > 0, got {max_approx_kl}")
        self.max_approx_kl = max_approx_kl
        self.stopped_steps = 0  # policy steps dropped over the run (checkpointed by the module)
        self._epoch: int | None = None  # the epoch whose remaining policy steps are dropped

    @property
    def on(self) -> bool:
        return self.max_approx_kl is not None

    def open(self, epoch: int) -> bool:
        """Whether ``epoch``'s policy steps are still taken (nothing measured in it tripped the limit)."""
        return self._epoch != epoch

    def measure(self, kl: float, epoch: int, step: int) -> None:
        """A step of ``epoch`` measured ``kl`` (mean over ranks): past the limit, the epoch's later steps are dropped."""
        if self.on and self.open(epoch) and kl > self.max_approx_kl:
            self._epoch = epoch
            log.info("epoch %d: approx KL %.4f > module.max_approx_kl %g at global step %d: the epoch's remaining "
                     "policy steps are not taken", epoch, kl, self.max_approx_kl, step)

    def stops(self, epoch: int) -> bool:
        """Whether this policy step of ``epoch`` is dropped (it, or an earlier step, tripped the limit); a True counts it."""
        if self.open(epoch):
            return False
        self.stopped_steps += 1
        return True


def kl_stop(module, kind: str, metrics: dict | None = None) -> bool:
    """Whether this step of ``module`` (a batch of ``kind``) falls outside the epoch's trust region
    (``module.trust_region``; only rollout steps are its): asked before the forward (no ``metrics``), for the earlier
    steps alone (True: the step is not forwarded); after it, with the step's metrics, it also measures this one, its
    ``policy/approx_kl`` averaged over ranks first, so every rank decides alike (the answer before the forward reads
    only that decision: no collective)."""
    region, epoch = module.trust_region, module.current_epoch
    if not region.on or kind != ROLLOUT:
        return False
    if metrics is not None and region.open(epoch) and "policy/approx_kl" in metrics:
        kl = torch.as_tensor(metrics["policy/approx_kl"], dtype=torch.float32, device=module.device).detach()
        if module._trainer is not None and module.trainer.world_size > 1:
            kl = module.trainer.strategy.reduce(kl, reduce_op="mean")
        region.measure(float(kl), epoch, module.global_step)
    return region.stops(epoch)
