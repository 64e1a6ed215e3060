"""CoPE forecast loss: NLL of the forecast samples, and the scale that keeps it in proportion.

Follows CoPE (arXiv 2610.20597) as its authors' code computes it: per sample, the mean token cross-entropy
over its target tokens times the sample's group weight (``forecast_weight``: 1/m_g renormalized to mean 1);
the mean over the samples of the batch (their reduction, at their micro-batch of one sample). Where it enters:
``update=separate`` (the authors' default) computes it on CoPE's own forecast batches, after the epoch's policy
steps, in optimizer steps of their own (learning rate times ``lr_scale``); ``update=joint`` adds it to the
policy-gradient loss of the rollout minibatches (the samples packed after their transcripts). The samples and
their packing come from :mod:`cope.algos.cope.prompted`, :mod:`cope.algos.cope.chunks` and
:mod:`cope.algos.cope.packing`; this file only reads ``forecast_mask``, ``forecast_chunk``,
``forecast_actions`` and ``forecast_weight``.

The variants of the earlier reading of the explainer (``cope.sample=continuation``):
    * ``per_step`` further divides each chunk's mean by its number of supervised actions.
    * The optional adaptive scale (:class:`AdaptiveScale`) keeps a magnitude of the forecast term at
      ``adaptive_ratio`` times an EMA of the same magnitude of the policy-gradient term. The scale is a
      plain float: no gradient flows through it. Two choices of magnitude:

      - ``adaptive``: loss values, ``scale * |L_forecast| ~= ratio * |L_pg|`` (fed after every step by
        the ``LossBalance`` callback). Cheap, but a PPO/GRPO loss *value* is only a rough proxy of its
        gradient's size (it hovers near 0 on-policy), hence the clamp.
      - ``gradnorm``: gradient norms, ``scale * |grad L_forecast| ~= ratio * |grad (w_pg L_pg)|`` (measured
        by the same ``LossBalance`` callback before every ``gradnorm_every_n_steps``-th step, one extra
        forward and one backward per objective, and fed at that step's end; the scale holds in between).
        The forecast term's contribution to the update is then ``weight * ratio * |grad (w_pg L_pg)|``;
        with ``weight`` 1 its gradient norm is held at ``ratio`` times the policy gradient's, what
        ``adaptive`` only approximates through loss values (in the spirit of GradNorm, Chen et al. 2018,
        with a fixed target ratio instead of learned task weights).

      Either way a new measurement moves the scale from the next step on: a step's scale is fixed
      before the step.
"""
from __future__ import annotations

import math

import torch

from cope.train.objectives import ROLLOUT, ForwardOut, Metrics, Objective

FORECAST = "forecast"  # the batch kind (and metric prefix) of the separate update's batches (packing.forecast_batch)
NORMALIZE = ("none", "per_step")  # the chunk math of forecast_nll
UPDATES = ("separate", "joint")
# ForecastLoss.normalize: the chunk math, or `none`'s with a scale held at a ratio of the policy-gradient term,
# fed loss magnitudes (adaptive) or gradient norms (gradnorm); value -> what feeds the scale
BALANCED = {"adaptive": "loss", "gradnorm": "gradient"}


def forecast_nll(
    logprobs: torch.Tensor,
    forecast_mask: torch.Tensor,
    forecast_chunk: torch.Tensor,
    num_chunks: int,
    normalize: str = "none",
    chunk_actions: torch.Tensor | None = None,
    chunk_weight: torch.Tensor | None = None,
) -> tuple[torch.Tensor, Metrics]:
    """Mean over chunks of the (weighted) mean token NLL inside each chunk.

    Args:
        logprobs: (N, T) log p(token t | tokens < t), with grad.
        forecast_mask: (N, T) bool, the target tokens.
        forecast_chunk: (N, T) long, chunk id of each token (-1 outside chunks).
        num_chunks: C, the number of chunks the ids refer to.
        normalize: ``none`` or ``per_step`` (divide each chunk's mean by its supervised actions).
        chunk_actions: (C,) supervised actions per chunk (needed for ``per_step``).
        chunk_weight: (C,) each chunk's weight (CoPE's group weights); None: 1.

    Returns:
        (loss, metrics): ``forecast/nll`` (the loss, detached), ``forecast/chunks`` (chunks with
        target tokens here), ``forecast/tokens``. No target token: a loss of exactly 0, attached.
    """
    if normalize not in NORMALIZE:
        raise ValueError(f"forecast_nll: normalize must be one of {NORMALIZE}, got {normalize!r}")
    if normalize == "per_step" and chunk_actions is None:
        raise ValueError("forecast_nll: normalize='per_step' needs chunk_actions")
    sel = forecast_mask.bool() & (forecast_chunk >= 0)  # (N, T)
    ids = forecast_chunk[sel]  # (M,)
    nll = -logprobs[sel].float()  # (M,)
    sums = nll.new_zeros(num_chunks).index_add(0, ids, nll)  # (C,)
    counts = nll.new_zeros(num_chunks).index_add(0, ids, torch.ones_like(nll))  # (C,)
    has = counts > 0  # (C,)
    per_chunk = sums / counts.clamp(min=1)  # (C,)
    if normalize == "per_step":
        per_chunk = per_chunk / chunk_actions.to(per_chunk).clamp(min=1)  # (C,)
    if chunk_weight is not None:
        per_chunk = per_chunk * chunk_weight.to(per_chunk)  # (C,)
    n = has.sum()
    loss = torch.where(has, per_chunk, torch.zeros_like(per_chunk)).sum() / n.clamp(min=1)
    metrics: Metrics = {"forecast/nll": loss.detach(), "forecast/chunks": n.detach().float(), "forecast/tokens": counts.sum().detach()}
    return loss, metrics


class AdaptiveScale:
    """EMA bookkeeping for ``scale * m_forecast ~= adaptive_ratio * EMA(m_pg)``.

    ``m`` is a magnitude of each term: ``|loss|`` (``normalize=adaptive``) or a gradient norm
    (``normalize=gradnorm``); the math is the same, only what is fed differs. Both
    magnitudes are EMAs (initialized at their first value, so no warm-up bias); a forecast magnitude
    of ~0 (a step without targets, e.g. cold start) is not a measurement and is skipped. Before the
    first forecast measurement the scale is 1.

    Args:
        adaptive_ratio: the wanted ratio of the forecast term to the policy-gradient term; > 0.
        beta: EMA decay in [0, 1).
        min_scale, max_scale: clamp of the scale.
        eps: magnitudes below it are treated as 0.
    """

    def __init__(self, adaptive_ratio: float = 0.5, beta: float = 0.9, min_scale: float = 1e-3, max_scale: float = 1e3, eps: float = 1e-8):
        if adaptive_ratio <= 0:
            raise ValueError(f"AdaptiveScale.adaptive_ratio must be > 0, got {adaptive_ratio}")
        if not 0.0 <= beta < 1.0:
            raise ValueError(f"AdaptiveScale.beta must be in [0, 1), got {beta}")
        if not 0 < min_scale <= max_scale:
            raise ValueError(f"AdaptiveScale needs 0 < min_scale <= max_scale, got {min_scale}, {max_scale}")
        self.adaptive_ratio, self.beta = float(adaptive_ratio), float(beta)
        self.min_scale, self.max_scale, self.eps = float(min_scale), float(max_scale), float(eps)
        self.ema_pg: float | None = None
        self.ema_forecast: float | None = None

    def _ema(self, old: float | None, x: float) -> float:
        return x if old is None else self.beta * old + (1.0 - self.beta) * x

    def update(self, pg_abs: float, forecast_raw: float, skip_zero_reference: bool = False) -> None:
        """One measurement. ``skip_zero_reference``: a reference magnitude of ~0 is no measurement either
        (a policy gradient of 0 means every group had equal rewards: no signal to hold the forecast term to)."""
        pg, fc = abs(float(pg_abs)), abs(float(forecast_raw))
        if skip_zero_reference and not pg > self.eps:
            return
        if math.isfinite(pg):
            self.ema_pg = self._ema(self.ema_pg, pg)
        if math.isfinite(fc) and fc > self.eps:
            self.ema_forecast = self._ema(self.ema_forecast, fc)

    @property
    def scale(self) -> float:
        if self.ema_pg is None or self.ema_forecast is None:
            return 1.0
        s = self.adaptive_ratio * self.ema_pg / max(self.ema_forecast, self.eps)
        return float(min(self.max_scale, max(self.min_scale, s)))

    def state_dict(self) -> dict:
        return {"ema_pg": self.ema_pg, "ema_forecast": self.ema_forecast}

    def load_state_dict(self, state: dict) -> None:
        self.ema_pg, self.ema_forecast = state.get("ema_pg"), state.get("ema_forecast")


class ForecastLoss(Objective):
    """The CoPE forecast term (``loss/forecast`` = ``scale * L_forecast``; times ``weight`` in the total).

    Reads ``forecast_mask``, ``forecast_chunk``, ``forecast_actions`` (added by the
    ``ForecastTargets`` callback); without them (callback off) the loss is exactly 0.

    Args:
        weight: lambda, the multiplier in the total loss.
        normalize: ``none`` or ``per_step`` (see :func:`forecast_nll`); or ``none``'s per-chunk mean
            times a scale held at ``adaptive_ratio`` (default 0.5) times the policy-gradient term:
            ``adaptive`` balances loss values (``scale * |L_forecast| ~= ratio * |L_pg|``), ``gradnorm``
            gradient norms (``scale * |grad L_forecast| ~= ratio * |grad (w_pg L_pg)|``, so the term's
            contribution to the update has norm ``weight * ratio * |grad (w_pg L_pg)|``); both are fed by
            the ``LossBalance`` callback (``algo.callbacks.loss_balance``, part of ``algo=cope``).
        adaptive_ratio: the ratio of the balanced modes; the objective owns an :class:`AdaptiveScale`
            with it (the only copy of that state; checkpointed through :meth:`state_dict`, per mode).
            Ignored by ``none`` / ``per_step``.
        adaptive_beta: EMA decay of the scale.
        schedule, final_weight, schedule_steps, power: the coefficient's annealing, see
            :class:`cope.train.objectives.Objective` (CoPE's fixed, linear, power and cutoff schedules).
        update: ``separate`` (computed on CoPE's forecast batches, optimizer steps of their own) or ``joint``
            (on the rollout minibatches, summed into the policy-gradient loss).
        lr_scale: the learning-rate multiplier of the separate steps (the authors' ``lr_scale``; a separate Adam
            step mostly normalizes the coefficient away, the learning rate is what sizes it). Joint: must be 1.
    """

    name = "forecast"

    def __init__(
        self,
        weight: float = 0.1,
        normalize: str = "none",
        adaptive_ratio: float | None = None,
        adaptive_beta: float = 0.9,
        schedule: str = "constant",
        final_weight: float = 0.0,
        schedule_steps: int = 0,
        power: float = 2.0,
        update: str = "joint",
        lr_scale: float = 1.0,
    ):
        super().__init__(weight=weight, schedule=schedule, final_weight=final_weight, schedule_steps=schedule_steps,
                         power=power)
        if update not in UPDATES:
            raise ValueError(f"ForecastLoss.update must be one of {UPDATES}, got {update!r}")
        if not lr_scale > 0 or (update == "joint" and lr_scale != 1.0):
            raise ValueError(f"ForecastLoss.lr_scale must be > 0, and 1 with update=joint (one step for both terms), got {lr_scale}")
        self.update, self.lr_scale = update, float(lr_scale)
        self.batch_kind = FORECAST if update == "separate" else ROLLOUT
        self.metric_prefix = FORECAST  # its separate steps log forecast/loss_total, forecast/grad_norm, ...
        if normalize not in (*NORMALIZE, *BALANCED):
            raise ValueError(f"ForecastLoss.normalize must be one of {(*NORMALIZE, *BALANCED)}, got {normalize!r}")
        self.mode = normalize  # as configured (`normalize` below is the chunk math)
        self.balance: str | None = BALANCED.get(normalize)  # what feeds the scale: loss | gradient | None (fixed)
        if self.balance is not None:  # chunk math of `none`, magnitude held at a ratio of the pg term
            adaptive_ratio = 0.5 if adaptive_ratio is None else adaptive_ratio
            normalize = "none"
        else:  # `none` / `per_step` are fixed scalings: no adaptive scale, whatever adaptive_ratio says
            adaptive_ratio = None
        self.normalize = normalize
        self.adaptive = AdaptiveScale(adaptive_ratio, adaptive_beta) if adaptive_ratio is not None else None

    @property
    def scale(self) -> float:
        """The multiplier of the raw forecast loss: a plain float (no gradient flows through it); 1 unless balanced."""
        return self.adaptive.scale if self.adaptive is not None else 1.0

    def observe(self, reference_abs: float, raw_abs: float) -> None:
        """One step's loss magnitudes (``|L_pg|``, ``|L_forecast raw|``) for ``adaptive``; a no-op otherwise."""
        if self.balance == "loss":
            self.adaptive.update(reference_abs, raw_abs)

    def observe_gradients(self, reference_norm: float, raw_norm: float) -> None:
        """One measurement of gradient norms for ``gradnorm``: ``|grad (w_pg L_pg)|`` and ``|grad L_forecast raw|``
        (unscaled, unweighted); a no-op otherwise."""
        if self.balance == "gradient":  # a zero PG gradient (no group with a reward spread) is skipped
            self.adaptive.update(reference_norm, raw_norm, skip_zero_reference=True)

    def state_dict(self) -> dict:
        # keyed by mode: a resume under the other balanced mode starts its scale afresh (different magnitudes)
        return {self.mode: self.adaptive.state_dict()} if self.adaptive is not None else {}

    def load_state_dict(self, state: dict) -> None:
        if self.adaptive is not None and self.mode in state:
            self.adaptive.load_state_dict(state[self.mode])

    def __call__(self, out: ForwardOut, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, Metrics]:
        if "forecast_mask" in batch:
            actions = batch["forecast_actions"]  # (C,)
            raw, metrics = forecast_nll(
                out.logprobs, batch["forecast_mask"], batch["forecast_chunk"], int(actions.numel()), self.normalize, actions,
                batch.get("forecast_weight"),
            )
        else:
            raw = out.logprobs.flatten()[:0].sum()  # exactly 0, attached to the graph
            metrics = {"forecast/nll": raw.detach()}
        scale = float(self.scale)
        loss = raw * scale
        metrics.update({"forecast/raw": raw.detach(), "forecast/scale": scale, "forecast/scaled": loss.detach()})
        return loss, metrics
