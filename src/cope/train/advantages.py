"""Episode advantages from group rewards: GRPO and Dr.GRPO.

One scalar reward per episode; episodes of the same task form a group.

* ``grpo`` (Shao et al. 2024, DeepSeekMath): ``(r - mean_g) / (std_g + eps)``, population std.
* ``drgrpo`` (Liu et al. 2025, "Understanding R1-Zero-Like Training"): ``r - mean_g``, no std.

Deliberate choices:
    * Aborted episodes (env crash or timeout, ``valid=False``) get advantage 0 and are left out of
      their group's mean and std, so a crash neither rewards nor punishes the rest of the group.
    * A group whose valid rewards are all exactly equal gets advantage exactly 0 (not a rounding
      residue divided by ``eps``); the share of such groups is logged as ``rollout/zero_signal_groups``.
      A group with no valid episode counts as zero-signal.
    * Statistics are computed in float64 and cast back to the rewards' dtype.
"""
from __future__ import annotations

from typing import Callable

import torch

Metrics = dict[str, float | torch.Tensor]


def _grpo(centered: torch.Tensor, std: torch.Tensor, eps: float) -> torch.Tensor:
    return centered / (std + eps)


def _drgrpo(centered: torch.Tensor, std: torch.Tensor, eps: float) -> torch.Tensor:
    return centered


# name -> fn(r - group mean (N,), group std (N,), eps) -> advantages (N,)
ADVANTAGE_MODES: dict[str, Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]] = {
    "grpo": _grpo,
    "drgrpo": _drgrpo,
}


def _zero_signal(r: torch.Tensor, gid: torch.Tensor, valid: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    """(G,) bool: groups with no valid episode or whose valid rewards ``r`` (N,) float64 are all equal; ``gid`` (N,)
    each episode's group index, ``count`` (G,) each group's valid episodes. An exact equality test, so that an
    all-equal group gives exactly 0 and not rounding / eps."""
    big = torch.finfo(torch.float64).max
    G = count.shape[0]
    r_hi = torch.where(valid, r, torch.full_like(r, -big))  # (N,)
    r_lo = torch.where(valid, r, torch.full_like(r, big))  # (N,)
    g_max = torch.full((G,), -big, dtype=torch.float64, device=r.device).scatter_reduce(0, gid, r_hi, "amax")  # (G,)
    g_min = torch.full((G,), big, dtype=torch.float64, device=r.device).scatter_reduce(0, gid, r_lo, "amin")  # (G,)
    return (count == 0) | (g_max == g_min)


def zero_signal_groups(rewards: torch.Tensor, groups: torch.Tensor, valid: torch.Tensor) -> tuple[int, int]:
    """(groups without signal, groups) of :func:`group_advantages`'s ``rollout/zero_signal_groups`` share, as counts
    (sums over ranks give the share over all ranks' groups). Arguments as there; ``valid`` required."""
    if rewards.shape[0] == 0:
        return 0, 0
    uniq, gid = torch.unique(groups, return_inverse=True)  # (G,), (N,)
    count = torch.zeros(uniq.shape[0], dtype=torch.float64, device=rewards.device).index_add_(0, gid, valid.to(torch.float64))
    return int(_zero_signal(rewards.to(torch.float64), gid, valid, count).sum()), int(uniq.shape[0])


def group_advantages(
    rewards: torch.Tensor,
    groups: torch.Tensor,
    mode: str = "grpo",
    eps: float = 1e-6,
    valid: torch.Tensor | None = None,
) -> tuple[torch.Tensor, Metrics]:
    """Group-relative advantages.

    Args:
        rewards: (N,) episode rewards.
        groups: (N,) long group ids (any integers; need not be contiguous).
        mode: a key of :data:`ADVANTAGE_MODES` (``grpo`` or ``drgrpo``).
        eps: added to the group std (``grpo`` only).
        valid: (N,) bool, False for aborted episodes; None means all valid.

    Returns:
        (advantages (N,), metrics) with ``rollout/zero_signal_groups`` in metrics.
    """
    if mode not in ADVANTAGE_MODES:
        raise ValueError(f"group_advantages: unknown mode {mode!r}; allowed: {sorted(ADVANTAGE_MODES)}")
    if rewards.ndim != 1 or groups.shape != rewards.shape:
        raise ValueError(f"group_advantages: rewards and groups must both be (N,), got {tuple(rewards.shape)} and {tuple(groups.shape)}")
    n = rewards.shape[0]
    if valid is None:
        valid = torch.ones(n, dtype=torch.bool, device=rewards.device)
    if valid.shape != rewards.shape:
        raise ValueError(f"group_advantages: valid must be (N,)={tuple(rewards.shape)}, got {tuple(valid.shape)}")
    if n == 0:
        return torch.zeros(0, device=rewards.device), {"rollout/zero_signal_groups": 0.0}

    uniq, gid = torch.unique(groups, return_inverse=True)  # (G,), (N,)
    G = uniq.shape[0]
    r = rewards.to(torch.float64)  # (N,)
    w = valid.to(torch.float64)  # (N,)
    count = torch.zeros(G, dtype=torch.float64, device=r.device).index_add_(0, gid, w)  # (G,)
    total = torch.zeros(G, dtype=torch.float64, device=r.device).index_add_(0, gid, r * w)  # (G,)
    mean = total / count.clamp(min=1.0)  # (G,)
    centered = r - mean[gid]  # (N,)
    var = torch.zeros(G, dtype=torch.float64, device=r.device).index_add_(0, gid, centered.square() * w)  # (G,)
    std = (var / count.clamp(min=1.0)).sqrt()  # (G,) population std

    zero_signal = _zero_signal(r, gid, valid, count)  # (G,)

    adv = ADVANTAGE_MODES[mode](centered, std[gid], eps)  # (N,)
    adv = torch.where(valid & ~zero_signal[gid], adv, torch.zeros_like(adv))  # (N,)
    metrics: Metrics = {"rollout/zero_signal_groups": float(zero_signal.float().mean())}
    out_dtype = rewards.dtype if rewards.is_floating_point() else torch.float32
    return adv.to(out_dtype), metrics
