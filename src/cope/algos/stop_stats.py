"""The end-of-turn token under the policy gradient: pure measurements (no trainer access).

An action turn ends with the end-of-turn id; a policy that stops emitting it after a complete action writes
``westwest...`` until the per-action token cap, and every action is invalid. These functions say how the
policy-gradient objective pushes that id (:class:`cope.callbacks.stop_token.StopTokenStats` runs them once per
epoch, before its first update, on the epoch's rollout minibatches).

For the sampled token ``y_t`` at an action position, the surrogate's first-order push on a logit ``z_v``
(the descent direction, ratio 1 as at the start of an on-policy update) is
``A_t * w_t * (1[y_t = v] - p_t(v))``: ``A_t`` the advantage, ``w_t = d agg / d x_t`` the aggregation's weight
of that token (:func:`aggregation_weights`; ``token-mean``: 1 / the minibatch's action tokens, the same for
every token, so an episode's share grows with its length; ``seq-mean-token-mean``: 1 / (sequences x the
episode's own action tokens)).
"""
from __future__ import annotations

import torch

from cope.algos.grpo import AGGREGATIONS

# the sums an epoch's measurement adds up (per rank; pooled over ranks by summing)
TALLY = ("total_push", "stop_push_pos", "stop_push_neg", "net_push", "p_stop_sum", "positions", "adv_net", "adv_abs")


def aggregation_weights(agg: str, mask: torch.Tensor, norm_len: int = 1024) -> torch.Tensor:
    """(N, T) ``d agg(x) / d x`` of the policy-gradient aggregation ``agg`` over ``mask``: the weight of each token's
    term in the minibatch's loss (0 off the mask; all 0 for an empty mask). Every aggregation is linear in ``x``."""
    mask = mask.bool()
    if not bool(mask.any()):
        return torch.zeros(mask.shape)
    x = torch.zeros(mask.shape, dtype=torch.float64, requires_grad=True)
    loss = AGGREGATIONS[agg](torch.where(mask, x, torch.zeros_like(x)), mask, norm_len)
    (w,) = torch.autograd.grad(loss, x)
    return w.float()


def stop_push(
    advantages: torch.Tensor,
    weights: torch.Tensor,
    action_mask: torch.Tensor,
    sampled_p: torch.Tensor,
    is_stop: torch.Tensor,
    at_positions: tuple[torch.Tensor, torch.Tensor],
    p_stop: torch.Tensor,
) -> dict[str, float]:
    """One minibatch's tally (keys :data:`TALLY`).

    Args:
        advantages, weights, action_mask: (N, T) the advantage, aggregation weight and policy-gradient mask.
        sampled_p: (N, T) the policy's probability of each sampled token (at the sampling temperature).
        is_stop: (N, T) bool, the token is an end-of-turn id.
        at_positions: (rows, cols) of the P positions right after a complete action (where the policy should stop).
        p_stop: (P,) the policy's probability of any end-of-turn id there.

    Tally: ``total_push`` = sum over action tokens of ``|A w (1 - p_y)|`` (the push on the sampled tokens' logits,
    the scale of the shares); ``stop_push_pos`` / ``stop_push_neg`` = the same sum over sampled end-of-turn ids of
    episodes with A > 0 / A < 0; ``net_push`` = sum over the complete-action positions that are action tokens of
    ``A w (1[y = stop] - p_stop)``: the signed first-order push on the end-of-turn logits there (a continued
    action, ``y != stop``, contributes the counter-term); ``p_stop_sum`` and ``positions`` give the mean
    probability of stopping after a complete action; ``adv_net`` / ``adv_abs`` = sum over action tokens of ``A w`` /
    ``|A w|``: the update's net advantage mass (< 0: it pushes the sampled tokens down more than it pushes them up;
    every token that recurs once per turn, the end-of-turn id and the moves, then loses probability to the rest of
    the vocabulary).
    """
    act = action_mask.bool()
    g = torch.where(act, advantages * weights * (1.0 - sampled_p), torch.zeros_like(advantages))  # (N, T)
    stop = act & is_stop.bool()
    rows, cols = at_positions
    live = act[rows, cols]  # (P,) complete-action positions the policy sampled at (not an engine-added turn end)
    y_stop = is_stop.bool()[rows, cols].float()
    net = (advantages[rows, cols] * weights[rows, cols] * (y_stop - p_stop))[live]
    return {
        "total_push": float(g.abs().sum()),
        "stop_push_pos": float(g[stop & (advantages > 0)].abs().sum()),
        "stop_push_neg": float(g[stop & (advantages < 0)].abs().sum()),
        "net_push": float(net.sum()),
        "p_stop_sum": float(p_stop.sum()),
        "positions": float(p_stop.numel()),
        "adv_net": float((advantages * weights)[act].sum()),
        "adv_abs": float((advantages * weights)[act].abs().sum()),
    }


def stop_metrics(tally: dict[str, float], prefix: str = "stop") -> dict[str, float]:
    """``<prefix>/prob`` (mean end-of-turn probability after a complete action), ``<prefix>/share_pos`` and
    ``/share_neg`` (the end-of-turn ids' share of the push on sampled tokens, episodes with A > 0 / A < 0), and
    ``/push`` (the signed net push on the end-of-turn logits after complete actions, in the same units: < 0
    means the update lowers the probability of stopping); and ``pg/adv_balance``: the net advantage mass over its
    absolute sum, in [-1, 1] (0: the update pushes sampled tokens up as much as down); ``<prefix>/positions``: the
    complete actions ``/prob`` is over (0: no measurement, e.g. answers in prose that the env's projection reads)."""
    tot = tally["total_push"]
    return {
        f"{prefix}/prob": tally["p_stop_sum"] / tally["positions"] if tally["positions"] else 0.0,
        f"{prefix}/positions": float(tally["positions"]),
        f"{prefix}/share_pos": tally["stop_push_pos"] / tot if tot else 0.0,
        f"{prefix}/share_neg": tally["stop_push_neg"] / tot if tot else 0.0,
        f"{prefix}/push": tally["net_push"] / tot if tot else 0.0,
        "pg/adv_balance": tally["adv_net"] / tally["adv_abs"] if tally["adv_abs"] else 0.0,
    }
