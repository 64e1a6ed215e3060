"""Per-objective gradient diagnostics: how large each objective's share of the update is, and how it aligns.

The training loss is a weighted sum of objectives (:func:`cope.train.objectives.combine`); its gradient is the same
weighted sum of the objectives' gradients. These pure functions take that sum apart: one gradient per
objective (:func:`objective_gradients`, flattened over the trainable parameters) and the metrics that compare
them (:func:`gradient_metrics`). Gradient-balancing schemes (GradNorm, Chen et al. 2018, arXiv 1711.02257)
read the same quantities.

Two callbacks take these gradients before a step, at the parameters the step's gradient is taken at: the
diagnostics ``GradientStats`` (``cope.callbacks.grad_stats``: logs ``grad/*``) and CoPE's ``LossBalance``
(:mod:`cope.algos.cope.loss_balance`: feeds ``normalize=gradnorm``'s scale). Their one shared measurement is
:func:`measure_gradients` (the module's forward live on the first micro-batch's rows,
:func:`first_microbatch_forward`, then :func:`objective_gradients`) and :func:`mean_over_ranks`; it leaves the
step as it was (no ``.grad`` written, the RNG state forked, the train/eval mode untouched), so neither callback
changes what the other, or the step, sees. The other functions are pure (no trainer, no module).

Conventions:
    * each objective's gradient is that of its loss as the objective returns it (scaled by the objective's
      own ``scale`` where it has one, e.g. ``ForecastLoss``), *unweighted*; its contribution to the update is
      ``weight * gradient``, and the logged norms are of the contributions;
    * an undefined cosine or ratio (a zero norm on either side) is logged as 0, not NaN: one rank's NaN would
      poison the average over ranks, and the logged norms next to it say which side is 0.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import torch

from cope.train.objectives import ForwardOut, Objective, batch_kind
from cope.train.step.backward import Spliced


class ObjectiveGradient(NamedTuple):
    """One objective's gradient at the current parameters."""

    weight: float  # weight_at(step): its multiplier in the total loss
    grad: torch.Tensor  # (P,) fp32, the unweighted loss's gradient, flattened over the trainable parameters


def objective_gradients(
    objectives: Sequence[Objective], out: ForwardOut, batch: Mapping[str, torch.Tensor], step: int, params: Sequence[torch.nn.Parameter]
) -> dict[str, ObjectiveGradient]:
    """The gradient of every active objective's (unweighted) loss with respect to ``params``.

    Args:
        objectives: the module's objectives; those whose ``weight_at(step)`` is 0 are skipped (off, as in
            :func:`~cope.train.objectives.combine`), and so are those of another batch kind than ``batch``'s
            (CoPE's separate forecast loss on a rollout batch, the policy gradient on a forecast batch).
        out: a forward output whose ``logprobs`` are live (attached to the graph of ``params``).
        batch: the minibatch the objectives read.
        step: the optimizer step (for scheduled weights).
        params: the trainable parameters, in a fixed order (the flattening order).

    Returns:
        ``{name: ObjectiveGradient(weight, grad)}`` in the objectives' order. A parameter the loss does not
        reach has a zero gradient. ``torch.autograd.grad`` returns the gradients instead of accumulating them:
        no ``.grad`` of ``params`` is written; the graph is kept until the last objective.
    """
    params = list(params)
    kind = batch_kind(batch)
    active = [(o, w) for o in objectives if o.batch_kind == kind and (w := o.weight_at(step)) != 0.0]
    result: dict[str, ObjectiveGradient] = {}
    for i, (obj, w) in enumerate(active):
        loss, _ = obj(out, batch)
        if loss.requires_grad:
            grads = torch.autograd.grad(loss, params, retain_graph=i < len(active) - 1, allow_unused=True)
        else:  # a constant loss (nothing live in it): no gradient
            grads = (None,) * len(params)
        flat = [(g if g is not None else torch.zeros_like(p)).reshape(-1).float() for g, p in zip(grads, params)]
        result[obj.name] = ObjectiveGradient(float(w), torch.cat(flat) if flat else loss.new_zeros(0))  # (P,)
    return result


def _safe_div(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.where(b > 0, a / b.clamp(min=torch.finfo(b.dtype).tiny), torch.zeros_like(a))


def gradient_metrics(
    grads: Mapping[str, ObjectiveGradient],
    reference: str = "pg",
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Norms, alignment and ratios of the objectives' gradients (0-d tensors).

    Args:
        grads: :func:`objective_gradients`' result.
        reference: the objective the others are compared with (the policy gradient, ``pg``). When it is not
            among ``grads`` (absent, or off at this step) only the norms are given.

    Returns:
        (metrics, raw_norms):

        * ``grad/<name>_norm``: |weight * gradient|, the objective's contribution to the update;
        * ``grad/cos_<name>_<reference>``: cosine of its gradient with the reference's (weights do not change
          it; 0 when either gradient is 0);
        * ``grad/ratio_<name>_<reference>``: its contribution norm over the reference's (0 when the
          reference's is 0);
        * ``grad/total_norm``: |sum of weight * gradient|, the norm of the whole update direction
          (before clipping);
        * ``raw_norms``: ``{name: |gradient|}``, unweighted (what a gradient-norm balancer is fed).
    """
    metrics: dict[str, torch.Tensor] = {}
    raw_norms = {name: g.grad.norm() for name, g in grads.items()}
    contrib = {name: abs(g.weight) * raw_norms[name] for name, g in grads.items()}
    for name in grads:
        metrics[f"grad/{name}_norm"] = contrib[name]
    if reference in grads:
        ref = grads[reference].grad  # (P,)
        for name, g in grads.items():
            if name == reference:
                continue
            cos = _safe_div(torch.dot(g.grad, ref), raw_norms[name] * raw_norms[reference])
            metrics[f"grad/cos_{name}_{reference}"] = cos.clamp(-1.0, 1.0)
            metrics[f"grad/ratio_{name}_{reference}"] = _safe_div(contrib[name], contrib[reference])
    if grads:
        total = sum(g.weight * g.grad for g in grads.values())  # (P,)
        metrics["grad/total_norm"] = total.norm()
    return metrics, raw_norms


def first_microbatch_forward(pl_module: Any, batch: Mapping[str, torch.Tensor]) -> ForwardOut:
    """The module's forward, live on the first micro-batch's rows only, as its own backward splices them.

    Without micro-batches (``module.max_tokens_per_microbatch`` unset, or the minibatch fits) that is the whole
    forward. Otherwise the rows of the first micro-batch are live and the others are held at ``old_logprobs``
    (entropy 0; the predictive rows the objectives declared, 0 outside it), so a gradient of it is that micro-batch's
    share of the step's gradient: every objective's share alike, which keeps norms comparable and cosines meaningful
    at a fraction of the cost (:class:`~cope.train.step.backward.Spliced`)."""
    rows, n = pl_module.micro_batches(batch)[0]
    if rows is None:
        return pl_module(batch)
    scores = pl_module.logprobs(batch, rows, n, rows_at=pl_module.needs.rows_at)  # (R, n) each
    return Spliced(pl_module, batch).live(rows, n, scores)


def measure_gradients(
    trainer: Any, pl_module: Any, batch: Mapping[str, torch.Tensor], objectives: Sequence[Objective]
) -> dict[str, ObjectiveGradient]:
    """:func:`objective_gradients` of ``objectives`` at the module's current parameters, on
    :func:`first_microbatch_forward`, for a callback's ``on_train_batch_start``: with gradients enabled, in the
    precision plugin's ``train_step_context()`` (the step's autocast) and with the RNG forked (dropout, if any,
    draws the same masks in the step). No ``.grad`` is written and the train/eval mode is not touched."""
    dev = pl_module.device
    fork = [dev.index if dev.index is not None else torch.cuda.current_device()] if dev.type == "cuda" else []
    with torch.random.fork_rng(devices=fork), torch.enable_grad(), trainer.precision_plugin.train_step_context():
        out = first_microbatch_forward(pl_module, batch)
        return objective_gradients(objectives, out, batch, trainer.global_step, pl_module.policy.trainable_parameters())


def mean_over_ranks(trainer: Any, values: torch.Tensor) -> torch.Tensor:
    """``values`` averaged over the DDP ranks (``trainer.strategy.reduce``; a collective: every rank calls it);
    as they are with one process."""
    if getattr(trainer, "world_size", 1) > 1:
        return trainer.strategy.reduce(values, reduce_op="mean")
    return values
