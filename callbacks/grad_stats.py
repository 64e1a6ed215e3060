"""Per-objective gradient diagnostics on sampled steps: measured and logged, nothing else.

Every ``every_n_steps`` optimizer steps, before the step (``on_train_batch_start``: the parameters are those the
step's gradient is taken at), one more forward of the policy and one ``torch.autograd.grad`` per active objective
give each objective's gradient (:func:`cope.train.step.grad_stats.measure_gradients`); logged on that step only
(the loggers' rows of the other steps have no ``grad/*`` value):
``grad/<name>_norm`` (its contribution, weight x gradient), ``grad/cos_<name>_<reference>``,
``grad/ratio_<name>_<reference>`` and ``grad/total_norm`` (:func:`cope.train.step.grad_stats.gradient_metrics`).
The metrics describe the step's update: every scale an objective carries is already fixed for the step.

CoPE's separate update (``cope.update=separate``: forecast batches with their own optimizer steps after the
epoch's policy steps) is measured too: the first forecast step after a measured policy step logs, on its own
step, ``grad/<forecast>_norm`` (weight x gradient, on that forecast batch) and its cosine and ratio with the
policy gradient *kept from that measured policy step* (``grad/cos_<forecast>_<reference>``,
``grad/ratio_<forecast>_<reference>``): does the forecast step push where the policy gradient pushed? Those two
gradients are taken at different parameters (the policy steps in between moved them) and on different rows;
a separate step's learning rate is also scaled by its ``lr_scale``, which the norms leave out. The kept gradient
is dropped at each epoch's start (an epoch without forecast batches leaves nothing stale behind) and is not
checkpointed (after a resume the first forecast measurement waits for the next measured policy step). Holding it
costs 4 bytes per trainable parameter on the device, between the two steps, and only with a separate update.

It feeds nothing: turning it on or off does not change training. CoPE's ``normalize=gradnorm`` scale is fed by
CoPE's own ``LossBalance`` callback (:mod:`cope.algos.cope.loss_balance`, with the same measurement).

Where it deliberately differs from the step it describes:
    * with micro-batches (``module.max_tokens_per_microbatch``) only the first micro-batch's rows are live
      (the others held at ``old_logprobs``, as the module's own backward does), so the norms are those of that
      micro-batch's share of the gradient: every objective's share alike, which keeps cosines and ratios
      meaningful at a fraction of the cost;
    * norms are before gradient clipping;
    * under DDP each rank measures its own rows and the metrics are averaged over ranks; that is the mean of
      per-rank statistics, not the statistics of the rank-averaged gradient.

It leaves the step as it was: no ``.grad`` is written (``autograd.grad`` returns gradients), the RNG state is
forked (dropout, if any, draws the same masks in the step), the train/eval mode is not touched. The cost, on a
sampled step: one extra forward and one backward per active objective.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from lightning.pytorch import Callback

from cope.train.dist import log_now
from cope.train.objectives import ROLLOUT, batch_kind
from cope.train.step.grad_stats import ObjectiveGradient, gradient_metrics, mean_over_ranks, measure_gradients


class GradientStats(Callback):
    """Logs ``grad/*`` on every ``every_n_steps``-th optimizer step.

    Args:
        every_n_steps: measure on steps whose ``global_step`` is a multiple of this; 0 switches it off (no work).
        reference: the objective the others are compared with (the policy gradient).
    """

    def __init__(self, every_n_steps: int = 0, reference: str = "pg"):
        if every_n_steps < 0:
            raise ValueError(f"callbacks.grad_stats.every_n_steps must be >= 0 (0: off), got {every_n_steps}")
        self.every_n_steps, self.reference = int(every_n_steps), reference
        self._kept: ObjectiveGradient | None = None  # the last measured policy step's reference gradient (this rank's)

    def setup(self, trainer, pl_module, stage: str) -> None:
        names = [o.name for o in getattr(pl_module, "objectives", [])]
        if self.every_n_steps >= 1 and self.reference not in names:
            raise ValueError(f"callbacks.grad_stats.reference {self.reference!r} is not among the module's objectives {names}")

    def on_train_epoch_start(self, trainer, pl_module) -> None:
        self._kept = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if self.every_n_steps < 1 or not isinstance(batch, Mapping):
            return
        if batch_kind(batch) == ROLLOUT:
            if trainer.global_step % self.every_n_steps != 0:
                return
            grads = measure_gradients(trainer, pl_module, batch, pl_module.objectives)
            if any(o.batch_kind != ROLLOUT for o in pl_module.objectives):  # kept only for a separate step to come
                self._kept = grads.get(self.reference)
            metrics, _ = gradient_metrics(grads, self.reference)
        elif self._kept is not None:  # the first separate forecast step after a measured policy step
            grads = measure_gradients(trainer, pl_module, batch, pl_module.objectives)  # the forecast objectives only
            metrics, _ = gradient_metrics({self.reference: self._kept, **grads}, self.reference)
            # the policy step's norm was logged on its own step; a sum of the two steps' gradients is no update
            metrics = {k: v for k, v in metrics.items() if k not in (f"grad/{self.reference}_norm", "grad/total_norm")}
            self._kept = None
        else:
            return
        if metrics:
            names = sorted(metrics)
            values = mean_over_ranks(trainer, torch.stack([metrics[k].detach().float() for k in names]))  # (K,)
            self._log(trainer, dict(zip(names, values.tolist())))

    @staticmethod
    def _log(trainer, metrics: dict[str, float]) -> None:
        """Straight to the loggers, for this step only (rank zero; the values are already rank means).

        Not ``pl_module.log``: Lightning keeps a value logged from a hook until the epoch's reset and reports it
        again with every later step's metrics, so a measurement taken on 1 step in 4 read as 4 measurements."""
        if trainer.is_global_zero:
            log_now(trainer.loggers, metrics, trainer.global_step)
