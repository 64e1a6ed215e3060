"""EMPG: Entropy-Modulated Policy Gradients (Wang et al., arXiv 2509.09265), a baseline.

Re-weights each agent step's share of the episode advantage by the step's uncertainty:

1. step entropy H_t = mean entropy of the step's action tokens (under the policy that sampled them);
2. batch min-max normalization Hn_t = (H_t - min H) / (max H - min H + eps) over every step of the batch;
3. self-calibrating scale g_t = exp(-k Hn_t) / mean_batch(exp(-k Hn)), so the batch mean of g is 1:
   confident steps are amplified, uncertain ones damped, whatever the outcome's sign;
4. future-clarity bonus zeta * exp(-k_future Hn_{t+1}) for steps that have a next step;
5. A_t = g_t * A_episode + bonus_t, then (paper) batch-level normalization of the final advantages
   to zero mean and unit std.

Used as a scored transform: the module's scoring pass fills ``old_entropy``, then
:func:`apply_empg` rewrites ``advantages`` of every minibatch of the epoch in place.

Deviations from the paper (and its project-page pseudocode):
    * Steps are read from ``step_ids`` and ``action_mask`` instead of searching the token stream
      for chat delimiters; a step's tokens are exactly its sampled action tokens (including a sampled
      end-of-turn id, excluding scaffold ids the engine added).
    * Aborted episodes (no action tokens) and rows that are not transcripts (``aux_row``) take no part: they
      neither contribute statistics nor get rewritten.
    * "Next step" means step t+1 of the same episode; the last step gets no bonus.
    * The final normalization is token-weighted over all action tokens of the epoch's EMPG steps
      (every minibatch together), population std; it can be switched off with ``normalize=False``.
    * Degenerate batches: a single step (or all equal entropies) gives Hn = 0, g = 1.
"""
from __future__ import annotations

import torch

Metrics = dict[str, float | torch.Tensor]


def empg_step_advantages(
    step_entropy: torch.Tensor,
    episode_adv: torch.Tensor,
    has_next: torch.Tensor,
    next_entropy: torch.Tensor,
    k: float = 1.0,
    k_future: float = 1.0,
    zeta: float = 0.1,
    eps: float = 1e-8,
) -> tuple[torch.Tensor, Metrics]:
    """Modulated step advantages ``g(H_t) * A + zeta * exp(-k_future * Hn_{t+1})`` (no final normalization).

    Args:
        step_entropy: (M,) mean action-token entropy of each step in the batch.
        episode_adv: (M,) advantage of the episode each step belongs to.
        has_next: (M,) bool, the step has a next step in its episode.
        next_entropy: (M,) entropy of that next step (ignored where ``has_next`` is False).
        k: sharpness of the self-calibrating scale.
        k_future: sharpness of the future-clarity bonus.
        zeta: size of the future-clarity bonus.
        eps: guards the min-max range and the mean of the scale.

    Returns:
        (advantages (M,), metrics ``empg/scale_mean|min|max``, ``empg/bonus_mean``).
    """
    m = step_entropy.shape[0]
    if m == 0:
        zero = {"empg/scale_mean": 0.0, "empg/scale_min": 0.0, "empg/scale_max": 0.0, "empg/bonus_mean": 0.0}
        return episode_adv.new_zeros(0), zero
    h = step_entropy.to(torch.float64)  # (M,)
    h_min, h_max = h.min(), h.max()
    span = h_max - h_min + eps
    hn = (h - h_min) / span  # (M,) in [0, 1)
    hn_next = (next_entropy.to(torch.float64) - h_min) / span  # (M,) same batch scale as hn
    u = torch.exp(-k * hn)  # (M,)
    scale = u / (u.mean() + eps)  # (M,) mean 1
    bonus = torch.where(has_next.bool(), zeta * torch.exp(-k_future * hn_next), torch.zeros_like(hn))  # (M,)
    adv = scale * episode_adv.to(torch.float64) + bonus  # (M,)
    metrics: Metrics = {
        "empg/scale_mean": float(scale.mean()),
        "empg/scale_min": float(scale.min()),
        "empg/scale_max": float(scale.max()),
        "empg/bonus_mean": float(bonus.mean()),
    }
    out_dtype = episode_adv.dtype if episode_adv.is_floating_point() else torch.float32
    return adv.to(out_dtype), metrics


def _step_table(mb: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """Per-(row, step) sums of one minibatch, slot = row * S + step.

    Returns (key (N, T) long: the slot of each EMPG token, -1 elsewhere; present (N*S,) bool;
    entropy sum (N*S,); advantage sum (N*S,); token count (N*S,); S).
    """
    mask = mb["action_mask"].bool()  # (N, T)
    if "aux_row" in mb:
        mask = mask & ~mb["aux_row"].bool()[:, None]  # (N, T): rows that are not transcripts take no part
    step_ids = mb["step_ids"]  # (N, T)
    mask = mask & (step_ids >= 0)  # (N, T)
    n = mask.shape[0]
    s = int(step_ids.max().clamp(min=0)) + 1 if step_ids.numel() else 1
    rows = torch.arange(n, device=mask.device)[:, None].expand_as(step_ids)  # (N, T)
    key = torch.where(mask, rows * s + step_ids, torch.full_like(step_ids, -1))  # (N, T)
    flat = key[mask]  # (K,)
    ent = torch.zeros(n * s, dtype=torch.float64, device=mask.device).index_add_(0, flat, mb["old_entropy"][mask].to(torch.float64))
    adv = torch.zeros(n * s, dtype=torch.float64, device=mask.device).index_add_(0, flat, mb["advantages"][mask].to(torch.float64))
    cnt = torch.zeros(n * s, dtype=torch.float64, device=mask.device).index_add_(0, flat, torch.ones_like(flat, dtype=torch.float64))
    return key, cnt > 0, ent, adv, cnt, s


def apply_empg(
    minibatches: list[dict[str, torch.Tensor]],
    k: float = 1.0,
    k_future: float = 1.0,
    zeta: float = 0.1,
    normalize: bool = True,
    eps: float = 1e-8,
) -> Metrics:
    """Rewrite ``advantages`` (N, T) of every minibatch in place with EMPG step advantages.

    Statistics (entropy min/max, mean scale, final normalization) span all minibatches of the epoch.
    Reads ``old_entropy``, ``step_ids``, ``action_mask`` and ``advantages`` (the episode advantage
    on action tokens). Tokens outside the EMPG steps keep their advantage (0 off action tokens).

    Returns:
        metrics of :func:`empg_step_advantages` (plus ``empg/steps``).
    """
    tables = [_step_table(mb) for mb in minibatches]
    ents, advs, nexts, has_nexts, slot_idx = [], [], [], [], []
    for _key, present, ent, adv, cnt, s in tables:
        idx = present.nonzero().squeeze(-1)  # (M_b,) present slots, row-major so steps are ordered
        mean_ent = ent / cnt.clamp(min=1)  # (N*S,)
        nxt = idx + 1  # (M_b,) slot of step t+1 in the same row
        same_row = (idx % s) != (s - 1)  # (M_b,) step t+1 fits in this row
        nxt_c = torch.where(same_row, nxt, idx)  # (M_b,)
        has_next = same_row & present[nxt_c]  # (M_b,)
        ents.append(mean_ent[idx])
        advs.append(adv[idx] / cnt[idx])
        nexts.append(mean_ent[nxt_c])
        has_nexts.append(has_next)
        slot_idx.append(idx)
    step_entropy = torch.cat(ents) if ents else torch.zeros(0, dtype=torch.float64)  # (M,)
    episode_adv = torch.cat(advs) if advs else torch.zeros(0, dtype=torch.float64)  # (M,)
    step_adv, metrics = empg_step_advantages(
        step_entropy, episode_adv, torch.cat(has_nexts) if has_nexts else torch.zeros(0, dtype=torch.bool),
        torch.cat(nexts) if nexts else torch.zeros(0, dtype=torch.float64), k=k, k_future=k_future, zeta=zeta, eps=eps,
    )
    metrics["empg/steps"] = float(step_adv.shape[0])

    # scatter step advantages back to tokens
    offset = 0
    new_tok: list[torch.Tensor] = []
    for (key, present, _, _, _, _), idx, mb in zip(tables, slot_idx, minibatches):
        per_slot = torch.zeros(present.shape[0], dtype=torch.float64, device=present.device)  # (N*S,)
        per_slot[idx] = step_adv[offset : offset + idx.shape[0]]
        offset += idx.shape[0]
        tok = per_slot[key.clamp(min=0)]  # (N, T)
        new_tok.append(torch.where(key >= 0, tok, mb["advantages"].to(torch.float64)))  # (N, T)

    if normalize and minibatches:
        masks = [key >= 0 for key, *_ in tables]  # (N, T) each: the EMPG action tokens
        vals = torch.cat([a[m] for a, m in zip(new_tok, masks)])  # (K,) every EMPG action token of the epoch
        if vals.numel() > 0:
            mean, std = vals.mean(), vals.std(unbiased=False)
            new_tok = [torch.where(m, (a - mean) / (std + eps), a) for a, m in zip(new_tok, masks)]
    for mb, a in zip(minibatches, new_tok):
        mb["advantages"].copy_(a.to(mb["advantages"].dtype))
    return metrics
