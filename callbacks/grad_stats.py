"""Per-objective gradient diagnostics on sampled steps, and the gradient norms of ``normalize=gradnorm``.

Every ``every_n_steps`` optimizer steps, before the step (``on_train_batch_start``: the parameters are those the
step's gradient is taken at), one more forward of the policy and one ``torch.autograd.grad`` per active objective
give each objective's gradient (:func:`cope.grad_stats.objective_gradients`); logged on that step only
(the loggers' rows of the other steps have no ``grad/*`` value):
``grad/<name>_norm`` (its contribution, weight x gradient), ``grad/cos_<name>_<reference>``,
``grad/ratio_<name>_<reference>`` and ``grad/total_norm`` (:func:`cope.grad_stats.gradient_metrics`).

Every objective with ``observe_gradients`` (CoPE's ``ForecastLoss``; a no-op unless ``normalize=gradnorm``)
is then fed ``|grad (w_ref L_ref)|`` and its own raw gradient norm (its loss's gradient norm over its current
``scale``: the unscaled loss's). The new scale already applies to this step's update, and the logged metrics
describe that update: the objective's gradient is rescaled to the new scale before they are computed.

Where it deliberately differs from the step it describes:
    * with micro-batches (``module.max_tokens_per_microbatch``) only the first micro-batch's rows are live
      (the others held at ``old_logprobs``, as the module's own backward does), so the norms are those of that
      micro-batch's share of the gradient: every objective's share alike, which keeps cosines and ratios
      meaningful at a fraction of the cost;
    * norms are before gradient clipping;
    * under DDP each rank measures its own rows and the metrics (and the fed norms) are averaged over ranks
      (every rank keeps the same scale); that is the mean of per-rank statistics, not the statistics of the
      rank-averaged gradient.

It leaves the step as it was: no ``.grad`` is written (``autograd.grad`` returns gradients), the RNG state is
forked (dropout, if any, draws the same masks in the step), the train/eval mode is not touched. The cost, on a
sampled step: one extra forward and one backward per active objective.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from lightning.pytorch import Callback

from cope.grad_stats import ObjectiveGradient, gradient_metrics, objective_gradients
from cope.objectives import ForwardOut


class GradientStats(Callback):
    """Logs ``grad/*`` on every ``every_n_steps``-th optimizer step and feeds ``observe_gradients``.

    Args:
        every_n_steps: measure on steps whose ``global_step`` is a multiple of this; 0 switches it off (no work).
        reference: the objective the others are compared with and balanced against (the policy gradient).
    """

    def __init__(self, every_n_steps: int = 0, reference: str = "pg"):
        if every_n_steps < 0:
            raise ValueError(f"callbacks.grad_stats.every_n_steps must be >= 0 (0: off), got {every_n_steps}")
        self.every_n_steps, self.reference = int(every_n_steps), reference

    @property
    def measures_gradients(self) -> bool:
        """Whether it measures at all (``LossBalance`` checks it for ``normalize=gradnorm``)."""
        return self.every_n_steps >= 1

    def setup(self, trainer, pl_module, stage: str) -> None:
        names = [o.name for o in getattr(pl_module, "objectives", [])]
        if self.measures_gradients and self.reference not in names:
            raise ValueError(f"callbacks.grad_stats.reference {self.reference!r} is not among the module's objectives {names}")

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if not self.measures_gradients or trainer.global_step % self.every_n_steps != 0 or not isinstance(batch, Mapping):
            return
        dev = pl_module.device
        fork = [dev.index if dev.index is not None else torch.cuda.current_device()] if dev.type == "cuda" else []
        with torch.random.fork_rng(devices=fork), torch.enable_grad(), trainer.precision_plugin.train_step_context():
            grads = objective_gradients(
                pl_module.objectives, self._forward(pl_module, batch), batch, trainer.global_step, pl_module.policy.trainable_parameters()
            )
        self._observe(trainer, pl_module, grads)
        metrics, _ = gradient_metrics(grads, self.reference)
        if metrics:
            names = sorted(metrics)
            values = self._mean_over_ranks(trainer, torch.stack([metrics[k].detach().float() for k in names]))  # (K,)
            self._log(trainer, dict(zip(names, values.tolist())))

    @staticmethod
    def _log(trainer, metrics: dict[str, float]) -> None:
        """Straight to the loggers, for this step only (rank zero; the values are already rank means).

        Not ``pl_module.log``: Lightning keeps a value logged from a hook until the epoch's reset and reports it
        again with every later step's metrics, so a measurement taken on 1 step in 4 read as 4 measurements."""
        if trainer.is_global_zero:
            for logger in trainer.loggers:
                logger.log_metrics(metrics, step=trainer.global_step)

    @staticmethod
    def _forward(pl_module, batch: Mapping) -> ForwardOut:
        """The module's forward, live on the first micro-batch's rows only (as its own backward splices them)."""
        rows, n = pl_module.micro_batches(batch)[0]
        if rows is None:
            return pl_module(batch)
        live_lp, live_ent = pl_module.logprobs(batch, rows, n)  # (R, n) each
        lp = batch["old_logprobs"].to(pl_module.device, torch.float32).clone()  # (N, T), constant elsewhere
        ent = torch.zeros_like(lp)  # (N, T)
        lp[rows, :n], ent[rows, :n] = live_lp, live_ent
        return ForwardOut(lp, ent, batch.get("ref_logprobs") if pl_module.needs_ref else None)

    @staticmethod
    def _mean_over_ranks(trainer, values: torch.Tensor) -> torch.Tensor:
        if getattr(trainer, "world_size", 1) > 1:
            return trainer.strategy.reduce(values, reduce_op="mean")
        return values

    def _observe(self, trainer, pl_module, grads: dict[str, ObjectiveGradient]) -> None:
        """Feeds each ``observe_gradients`` objective, then rescales its gradient to its new ``scale``."""
        ref = grads.get(self.reference)
        fed = [o for o in pl_module.objectives if hasattr(o, "observe_gradients") and o.name in grads and o.name != self.reference]
        if ref is None or not fed:
            return
        scales = [float(getattr(o, "scale", 1.0)) for o in fed]
        norms = torch.stack(
            [abs(ref.weight) * ref.grad.norm()]  # (1 + len(fed),): reference contribution, raw norms
            + [grads[o.name].grad.norm() / (s if s > 0 else 1.0) for o, s in zip(fed, scales)]
        )
        norms = self._mean_over_ranks(trainer, norms).tolist()
        for o, old, raw in zip(fed, scales, norms[1:]):
            o.observe_gradients(norms[0], raw)
            new = float(getattr(o, "scale", 1.0))
            if new != old and old > 0:  # the step's loss will carry the new scale: describe that update
                g = grads[o.name]
                grads[o.name] = ObjectiveGradient(g.weight, g.grad * (new / old))
