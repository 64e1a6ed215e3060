"""GRPO policy-gradient loss (PPO clipped surrogate on action tokens) and the k3 KL penalty.

Follows PPO (Schulman et al. 2017) as used by GRPO (Shao et al. 2024), with asymmetric clip bounds
(DAPO's "clip-higher", Yu et al. 2025) and three aggregation rules picked by name from
:data:`AGGREGATIONS`:

* ``token-mean``: sum over every masked token of the batch / number of masked tokens (DAPO; TRL's
  ``loss_type="bnpo"``).
* ``seq-mean-token-mean`` (the default): mean per sequence, then mean over the sequences that have tokens
  (original GRPO; TRL's ``loss_type="grpo"``). In a multi-turn episode every action turn ends with the
  end-of-turn id; under ``token-mean`` a group's push on it is proportional to sum_i A_i n_i (n_i turns), which
  is negative when failures run longer than wins, and the whole update is net-negative (the demo's action collapse,
  :mod:`cope.algos.stop_stats`: ``pg/adv_balance`` -0.25 on the demo). Per-episode normalization gives every
  episode the same total weight (balance 0). It did not remove every collapse of the demo (README).
* ``seq-mean-token-sum-norm``: sum / (num_seqs * norm_len) with a constant ``norm_len``
  (Dr.GRPO, Liu et al. 2025).

Deliberate choices:
    * ``num_seqs`` in ``seq-mean-token-sum-norm`` counts only sequences with at least one masked
      token, so rows without action tokens (aborted episodes, packed forecast rows) do not shrink
      the policy gradient.
    * Log-ratios are zeroed outside the mask before ``exp`` so that junk values at padded positions
      can neither overflow nor leak NaN into the gradient.
    * An empty mask gives a loss of exactly 0 that is still attached to the graph.

Stale episodes (``data.max_lag`` >= 1: decoupled PPO, Hilton et al. 2021, "Batch size-invariance for policy
optimization", arXiv 2110.00641, as AReaL runs it, Fu et al. 2025, arXiv 2505.24298). An epoch may train on episodes
sampled by an older *behaviour* policy pi_b (the sampler's own log-probs, ``batch["behaviour_logprobs"]``). The
"old" policy of PPO then plays two roles that are kept apart: the clip is taken around the *proximal* policy
pi_prox, the policy at the start of this epoch (``old_logprobs`` of the scoring pass), and each token is weighted by
the behaviour importance weight ``w = min(pi_prox / pi_b, behaviour_cap)``:
``per_tok = -w * min(r A, clip(r, 1 - clip_low, 1 + clip_high) A)``, ``r = pi_theta / pi_prox``.

* Why the proximal policy anchors the clip: the clip limits how far one epoch moves the policy (a trust region
  around a recent policy), which has nothing to do with who sampled the data. Anchored on pi_b, a lagged token's
  ratio starts the epoch away from 1 by however much the policy moved since sampling, so the clip is already active
  (no gradient at all from that token) or the step it allows shrinks with the lag. Anchored on pi_prox, r = 1 at the
  epoch's first step, as at lag 0, and the update size no longer depends on the lag (Hilton et al.).
* Why w is detached: it corrects the sampling distribution, a fixed coefficient per sample from two frozen
  policies (pi_prox, pi_b); the parameters enter only through r. A weight built on the live policy (pi_theta / pi_b)
  would double the gradient's dependence on pi_theta and escape the clip.
* The cap truncates, ``min(w, cap)``; it does not mask. Default 5.0, AReaL's setting: its
  ``behav_imp_weight_cap`` defaults to none (no cap), must be > 1 (kept here) and is 5.0 in its example configs
  (inclusionAI/AReaL ``examples/math/gsm8k_grpo.yaml``). AReaL *drops* the tokens above the cap (weight 0;
  ``areal/utils/functional.py``, ``ppo_actor_loss_fn``; its config help: tokens whose weight exceeds the cap are
  filtered out of the loss). We truncate instead, as IMPALA's V-trace (Espeholt et al. 2018) and verl's truncated
  importance sampling do: the tokens above the cap are those the proximal policy now prefers far more than the
  sampler did, i.e. what the updates since sampling reinforced; masking silences exactly them, truncation keeps
  their direction at a bounded size, and the weight stays continuous in w (no jump from the cap to 0). The weight
  also absorbs the sampler's numerics (``rollout/logprob_gap``: bf16 serving vs the trainer's fp32), as verl's does.
* ``policy/approx_kl`` (the trust region's measure, ``module.max_approx_kl``) estimates KL(pi_prox || pi_theta) from
  tokens that pi_b sampled: each token's k3 term is weighted by the same w, self-normalized (sum w k3 / sum w). Unweighted,
  the tokens the proximal policy now rarely samples (w << 1) most likely dominated it: the lag-1 demo runs measured
  step KLs up to 5.7 at clip fractions of 0.001; weighted, at most 0.174 at lag 1 and 0.084 at lag 2 (docs/overlap.md).
* Without ``behaviour_logprobs`` (lag 0) the code path is the plain PPO one above, unchanged.

The KL penalty is the k3 estimator (Schulman, "Approximating KL divergence", 2020) of
KL(pi || pi_ref): ``exp(ref - lp) - (ref - lp) - 1``, token mean over the mask.
"""
from __future__ import annotations

from typing import Callable

import torch

from cope.train.objectives import ForwardOut, Metrics, Needs, Objective


def _token_mean(per_tok: torch.Tensor, mask: torch.Tensor, norm_len: int) -> torch.Tensor:
    return per_tok.sum() / mask.sum()


def _seq_mean_token_mean(per_tok: torch.Tensor, mask: torch.Tensor, norm_len: int) -> torch.Tensor:
    counts = mask.sum(-1)  # (N,)
    has = counts > 0  # (N,)
    seq = per_tok.sum(-1) / counts.clamp(min=1)  # (N,)
    return seq[has].mean()


def _seq_mean_token_sum_norm(per_tok: torch.Tensor, mask: torch.Tensor, norm_len: int) -> torch.Tensor:
    num_seqs = (mask.sum(-1) > 0).sum()
    return per_tok.sum() / (num_seqs * norm_len)


# name -> fn(per-token loss already zeroed off-mask (N, T), mask (N, T) bool, norm_len) -> scalar.
# Each is only called when the mask has at least one token.
AGGREGATIONS: dict[str, Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor]] = {
    "token-mean": _token_mean,
    "seq-mean-token-mean": _seq_mean_token_mean,
    "seq-mean-token-sum-norm": _seq_mean_token_sum_norm,
}


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of ``x`` over ``mask`` (0 when the mask is empty)."""
    n = mask.sum()
    return torch.where(mask, x, torch.zeros_like(x)).sum() / n.clamp(min=1)


BEHAVIOUR_CAP = 5.0  # AReaL's example configs' behav_imp_weight_cap (module docstring); truncated here, not masked


def behaviour_weight(old_logprobs: torch.Tensor, behaviour_logprobs: torch.Tensor, mask: torch.Tensor,
                     cap: float = BEHAVIOUR_CAP) -> tuple[torch.Tensor, Metrics]:
    """The detached behaviour importance weight ``min(exp(old - behaviour), cap)`` (N, T) on mask tokens (1 off
    the mask, where the loss is 0 anyway) and its metrics over mask tokens: ``policy/behaviour_weight_mean`` (the
    applied, truncated weight), ``policy/behaviour_weight_max`` (the largest weight before the cap: how stale the
    stalest token is) and ``policy/behaviour_capped_frac`` (tokens whose weight the cap truncated)."""
    with torch.no_grad():
        old = old_logprobs.detach()
        log_w = torch.where(mask, old - behaviour_logprobs.detach().to(old.dtype), torch.zeros_like(old))  # (N, T)
        raw = log_w.exp()  # (N, T), 1 off-mask
        capped = (raw > cap) & mask  # (N, T)
        weight = raw.clamp(max=cap)  # (N, T)
        metrics: Metrics = {
            "policy/behaviour_weight_mean": masked_mean(weight, mask),
            "policy/behaviour_weight_max": torch.where(mask, raw, torch.zeros_like(raw)).max(),
            "policy/behaviour_capped_frac": masked_mean(capped.float(), mask),
        }
    return weight, metrics


def clipped_pg_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    agg: str = "seq-mean-token-mean",
    norm_len: int = 1024,
    behaviour_logprobs: torch.Tensor | None = None,
    behaviour_cap: float = BEHAVIOUR_CAP,
) -> tuple[torch.Tensor, Metrics]:
    """PPO clipped surrogate ``-min(r A, clip(r, 1 - clip_low, 1 + clip_high) A)`` over mask tokens; with
    ``behaviour_logprobs``, decoupled PPO: each token times ``w = min(pi_old / pi_behaviour, behaviour_cap)``
    (detached; module docstring).

    Args:
        logprobs: (N, T) current log-probs (with grad).
        old_logprobs: (N, T) log-probs of the scoring pass (no grad): the proximal policy, the clip's anchor.
        advantages: (N, T) per-token advantages.
        mask: (N, T) bool, the policy-gradient targets.
        clip_low, clip_high: the ratio is clipped to ``[1 - clip_low, 1 + clip_high]``.
        agg: a key of :data:`AGGREGATIONS`.
        norm_len: the constant length of ``seq-mean-token-sum-norm``.
        behaviour_logprobs: (N, T) log-probs of the policy that sampled the tokens (no grad), or None: plain PPO.
        behaviour_cap: the behaviour weight is truncated to at most this.

    Returns:
        (loss, metrics) with detached ``policy/clip_frac``, ``policy/ratio_mean``, ``policy/approx_kl``, and with
        ``behaviour_logprobs`` those of :func:`behaviour_weight`.
    """
    if agg not in AGGREGATIONS:
        raise ValueError(f"clipped_pg_loss: unknown agg {agg!r}; allowed: {sorted(AGGREGATIONS)}")
    mask = mask.bool()
    old = old_logprobs.detach()
    log_ratio = torch.where(mask, logprobs - old, torch.zeros_like(logprobs))  # (N, T), 0 off-mask
    ratio = log_ratio.exp()  # (N, T)
    adv = torch.where(mask, advantages.detach().to(logprobs.dtype), torch.zeros_like(logprobs))  # (N, T)
    surr = ratio * adv  # (N, T)
    surr_clipped = ratio.clamp(1.0 - clip_low, 1.0 + clip_high) * adv  # (N, T)
    per_tok = -torch.minimum(surr, surr_clipped)  # (N, T), 0 off-mask

    with torch.no_grad():
        clipped = (surr_clipped < surr) & mask  # (N, T) the clipped branch is the active one
        metrics: Metrics = {
            "policy/clip_frac": masked_mean(clipped.float(), mask),
            "policy/ratio_mean": masked_mean(ratio, mask),
            "policy/approx_kl": masked_mean((ratio - 1.0) - log_ratio, mask),
        }
    if behaviour_logprobs is not None:
        weight, behaviour_metrics = behaviour_weight(old, behaviour_logprobs, mask, behaviour_cap)
        per_tok = per_tok * weight.to(per_tok.dtype)  # (N, T), 0 off-mask
        metrics.update(behaviour_metrics)
        with torch.no_grad():  # the KL to the proximal policy, estimated on tokens the behaviour policy sampled
            w = torch.where(mask, weight.to(ratio.dtype), torch.zeros_like(ratio))  # (N, T), 0 off-mask
            metrics["policy/approx_kl"] = (w * ((ratio - 1.0) - log_ratio)).sum() / w.sum().clamp_min(1e-12)
    if not bool(mask.any()):
        return (logprobs * 0).sum(), metrics
    return AGGREGATIONS[agg](per_tok, mask, norm_len), metrics


def kl_k3(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, Metrics]:
    """k3 estimate of KL(pi || pi_ref), token mean over ``mask``.

    Args:
        logprobs: (N, T) current log-probs (with grad).
        ref_logprobs: (N, T) reference log-probs (no grad).
        mask: (N, T) bool.

    Returns:
        (loss, {"policy/kl": detached loss}).
    """
    mask = mask.bool()
    d = torch.where(mask, ref_logprobs.detach() - logprobs, torch.zeros_like(logprobs))  # (N, T), 0 off-mask
    k3 = d.exp() - d - 1.0  # (N, T), exactly 0 off-mask
    if not bool(mask.any()):
        loss = (logprobs * 0).sum()
    else:
        loss = k3.sum() / mask.sum()
    return loss, {"policy/kl": loss.detach()}


class PolicyGradient(Objective):
    """The clipped policy-gradient term on action tokens (``loss/pg``).

    Reads ``batch["old_logprobs"]``, ``batch["advantages"]``, ``batch["action_mask"]``, ``out.logprobs`` and, when
    the batch has it (``data.max_lag`` >= 1), ``batch["behaviour_logprobs"]`` (decoupled PPO, module docstring);
    also logs ``policy/entropy``, the mean entropy over action tokens.

    Args:
        weight: multiplier in the total loss.
        clip_low: lower clip, ratio >= 1 - clip_low; in [0, 1).
        clip_high: upper clip, ratio <= 1 + clip_high; >= 0.
        agg: loss aggregation, a key of :data:`AGGREGATIONS`.
        norm_len: constant length for ``seq-mean-token-sum-norm``; > 0.
        behaviour_cap: the behaviour importance weight of stale tokens is truncated to at most this; > 1
            (AReaL's rule: a cap <= 1 would shrink tokens the sampler and the proximal policy agree on).
        schedule, final_weight, schedule_steps: see :class:`cope.train.objectives.Objective`.
    """

    name = "pg"
    reads_advantages = True  # learns nothing from an epoch without a reward spread (callbacks/run_health.py)

    def __init__(
        self,
        weight: float = 1.0,
        clip_low: float = 0.2,
        clip_high: float = 0.2,
        agg: str = "seq-mean-token-mean",
        norm_len: int = 1024,
        behaviour_cap: float = BEHAVIOUR_CAP,
        schedule: str = "constant",
        final_weight: float = 0.0,
        schedule_steps: int = 0,
    ):
        super().__init__(weight=weight, schedule=schedule, final_weight=final_weight, schedule_steps=schedule_steps)
        if not 0.0 <= clip_low < 1.0:
            raise ValueError(f"PolicyGradient.clip_low must be in [0, 1), got {clip_low}")
        if clip_high < 0.0:
            raise ValueError(f"PolicyGradient.clip_high must be >= 0, got {clip_high}")
        if agg not in AGGREGATIONS:
            raise ValueError(f"PolicyGradient.agg must be one of {sorted(AGGREGATIONS)}, got {agg!r}")
        if norm_len <= 0:
            raise ValueError(f"PolicyGradient.norm_len must be > 0, got {norm_len}")
        if not behaviour_cap > 1.0:
            raise ValueError(f"algo.objectives.pg.behaviour_cap (PolicyGradient.behaviour_cap) must be > 1, got {behaviour_cap}")
        self.clip_low = float(clip_low)
        self.clip_high = float(clip_high)
        self.agg = agg
        self.norm_len = int(norm_len)
        self.behaviour_cap = float(behaviour_cap)

    def __call__(self, out: ForwardOut, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, Metrics]:
        mask = batch["action_mask"].bool()  # (N, T)
        loss, metrics = clipped_pg_loss(
            out.logprobs,
            batch["old_logprobs"],
            batch["advantages"],
            mask,
            clip_low=self.clip_low,
            clip_high=self.clip_high,
            agg=self.agg,
            norm_len=self.norm_len,
            behaviour_logprobs=batch.get("behaviour_logprobs"),
            behaviour_cap=self.behaviour_cap,
        )
        metrics["policy/entropy"] = masked_mean(out.entropy.detach(), mask)
        return loss, metrics


class KLPenalty(Objective):
    """k3 KL to the reference policy on action tokens (``loss/kl``); reads ``out.ref_logprobs``.

    Args:
        weight: multiplier in the total loss (0 by default: the KL is logged, not optimized).
        schedule, final_weight, schedule_steps: see :class:`cope.train.objectives.Objective`.
    """

    name = "kl"
    needs = Needs(ref_logprobs=True)

    def __init__(self, weight: float = 0.0, schedule: str = "constant", final_weight: float = 0.0, schedule_steps: int = 0):
        super().__init__(weight=weight, schedule=schedule, final_weight=final_weight, schedule_steps=schedule_steps)

    def __call__(self, out: ForwardOut, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, Metrics]:
        if out.ref_logprobs is None:
            raise ValueError(
                "KLPenalty needs ForwardOut.ref_logprobs, but it is None: the module must run the "
                "reference (adapter-disabled) forward when any objective declares Needs(ref_logprobs=True)"
            )
        return kl_k3(out.logprobs, out.ref_logprobs, batch["action_mask"].bool())
