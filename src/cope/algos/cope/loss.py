"""CoPE forecast loss: NLL of the forecast action chunks, and the scale that keeps it in proportion.

Follows CoPE (arXiv 2610.20597): total = L_pg + lambda * L_forecast, with L_forecast normalized so
that the multi-step targets cannot overwhelm the policy gradient. The targets and their layout in
the batch come from :mod:`cope.algos.cope.targets`; this file only reads ``forecast_mask``,
``forecast_chunk`` and ``forecast_actions``.

Where we are specific (the paper's exact normalization is not known to us):
    * Per chunk, the mean token NLL over its target tokens; then the mean over chunks that have any
      target token in the batch. ``per_step`` further divides each chunk's mean by its number of
      supervised actions.
    * The optional adaptive scale (:class:`AdaptiveScale`, driven by the ``LossBalance`` callback)
      keeps ``scale * |L_forecast|`` at ``target_ratio`` times an EMA of ``|L_pg|``. The scale is a
      plain float: no gradient flows through it. Note that a PPO/GRPO loss *value* is only a rough
      proxy of its gradient's size (it hovers near 0 on-policy), hence the clamp.
"""
from __future__ import annotations

import math

import torch

from cope.objectives import ForwardOut, Metrics, Objective

NORMALIZE = ("none", "per_step")


def forecast_nll(
    logprobs: torch.Tensor,
    forecast_mask: torch.Tensor,
    forecast_chunk: torch.Tensor,
    num_chunks: int,
    normalize: str = "none",
    chunk_actions: torch.Tensor | None = None,
) -> tuple[torch.Tensor, Metrics]:
    """Mean over chunks of the mean token NLL inside each chunk.

    Args:
        logprobs: (N, T) log p(token t | tokens < t), with grad.
        forecast_mask: (N, T) bool, the target tokens.
        forecast_chunk: (N, T) long, chunk id of each token (-1 outside chunks).
        num_chunks: C, the number of chunks the ids refer to.
        normalize: ``none`` or ``per_step`` (divide each chunk's mean by its supervised actions).
        chunk_actions: (C,) supervised actions per chunk (needed for ``per_step``).

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
    n = has.sum()
    loss = torch.where(has, per_chunk, torch.zeros_like(per_chunk)).sum() / n.clamp(min=1)
    metrics: Metrics = {"forecast/nll": loss.detach(), "forecast/chunks": n.detach().float(), "forecast/tokens": counts.sum().detach()}
    return loss, metrics


class AdaptiveScale:
    """EMA bookkeeping for ``scale * |L_forecast| ~= target_ratio * EMA(|L_pg|)``.

    Both magnitudes are EMAs (initialized at their first value, so no warm-up bias); a forecast
    value of 0 (a step without targets, e.g. cold start) is not a measurement and is skipped.
    Before the first forecast measurement the scale is 1.

    Args:
        target_ratio: the wanted ratio of the forecast term to the policy-gradient term; > 0.
        beta: EMA decay in [0, 1).
        min_scale, max_scale: clamp of the scale.
        eps: magnitudes below it are treated as 0.
    """

    def __init__(self, target_ratio: float = 0.5, beta: float = 0.9, min_scale: float = 1e-3, max_scale: float = 1e3, eps: float = 1e-8):
        if target_ratio <= 0:
            raise ValueError(f"AdaptiveScale.target_ratio must be > 0, got {target_ratio}")
        if not 0.0 <= beta < 1.0:
            raise ValueError(f"AdaptiveScale.beta must be in [0, 1), got {beta}")
        if not 0 < min_scale <= max_scale:
            raise ValueError(f"AdaptiveScale needs 0 < min_scale <= max_scale, got {min_scale}, {max_scale}")
        self.target_ratio, self.beta = float(target_ratio), float(beta)
        self.min_scale, self.max_scale, self.eps = float(min_scale), float(max_scale), float(eps)
        self.ema_pg: float | None = None
        self.ema_forecast: float | None = None

    def _ema(self, old: float | None, x: float) -> float:
        return x if old is None else self.beta * old + (1.0 - self.beta) * x

    def update(self, pg_abs: float, forecast_raw: float) -> None:
        pg, fc = abs(float(pg_abs)), abs(float(forecast_raw))
        if math.isfinite(pg):
            self.ema_pg = self._ema(self.ema_pg, pg)
        if math.isfinite(fc) and fc > self.eps:
            self.ema_forecast = self._ema(self.ema_forecast, fc)

    @property
    def scale(self) -> float:
        if self.ema_pg is None or self.ema_forecast is None:
            return 1.0
        s = self.target_ratio * self.ema_pg / max(self.ema_forecast, self.eps)
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
        normalize: ``none`` or ``per_step`` (see :func:`forecast_nll`), or ``adaptive``: ``none``'s
            per-chunk mean, scaled so the term stays at ``adaptive_target`` (default 0.5) times the
            running magnitude of the policy-gradient term (needs the ``LossBalance`` callback).
        adaptive_target: when set, the objective owns an :class:`AdaptiveScale` with this target
            ratio (the only copy of that state; checkpointed through :meth:`state_dict`); the
            ``LossBalance`` callback reports ``|loss/pg|`` and the raw forecast loss after each step
            (:meth:`observe`), and ``scale`` follows (without that callback it stays 1).
        adaptive_beta: EMA decay of the adaptive scale.
        schedule, final_weight, schedule_steps: see :class:`cope.objectives.Objective`.
    """

    name = "forecast"

    def __init__(
        self,
        weight: float = 0.1,
        normalize: str = "none",
        adaptive_target: float | None = None,
        adaptive_beta: float = 0.9,
        schedule: str = "constant",
        final_weight: float = 0.0,
        schedule_steps: int = 0,
    ):
        super().__init__(weight=weight, schedule=schedule, final_weight=final_weight, schedule_steps=schedule_steps)
        if normalize not in (*NORMALIZE, "adaptive"):
            raise ValueError(f"ForecastLoss.normalize must be one of {(*NORMALIZE, 'adaptive')}, got {normalize!r}")
        if normalize == "adaptive":  # chunk math of `none`, magnitude held at a ratio of |L_pg| (LossBalance)
            adaptive_target = 0.5 if adaptive_target is None else adaptive_target
            normalize = "none"
        else:  # `none` / `per_step` are fixed scalings: no adaptive scale, whatever adaptive_target says
            adaptive_target = None
        self.normalize = normalize
        self.adaptive = AdaptiveScale(adaptive_target, adaptive_beta) if adaptive_target is not None else None

    @property
    def scale(self) -> float:
        """The multiplier of the raw forecast loss: a plain float (no gradient flows through it); 1 unless adaptive."""
        return self.adaptive.scale if self.adaptive is not None else 1.0

    def observe(self, reference_abs: float, raw_abs: float) -> None:
        """One step's magnitudes (``|L_pg|``, ``|L_forecast raw|``) for the adaptive scale; a no-op otherwise."""
        if self.adaptive is not None:
            self.adaptive.update(reference_abs, raw_abs)

    def state_dict(self) -> dict:
        return {"adaptive": self.adaptive.state_dict()} if self.adaptive is not None else {}

    def load_state_dict(self, state: dict) -> None:
        if self.adaptive is not None and "adaptive" in state:
            self.adaptive.load_state_dict(state["adaptive"])

    def __call__(self, out: ForwardOut, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, Metrics]:
        if "forecast_mask" in batch:
            actions = batch["forecast_actions"]  # (C,)
            raw, metrics = forecast_nll(
                out.logprobs, batch["forecast_mask"], batch["forecast_chunk"], int(actions.numel()), self.normalize, actions
            )
        else:
            raw = out.logprobs.flatten()[:0].sum()  # exactly 0, attached to the graph
            metrics = {"forecast/nll": raw.detach()}
        scale = float(self.scale)
        loss = raw * scale
        metrics.update({"forecast/raw": raw.detach(), "forecast/scale": scale, "forecast/scaled": loss.detach()})
        return loss, metrics
