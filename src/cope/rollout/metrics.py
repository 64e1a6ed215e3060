"""Episode-level metrics shared by training rollouts and validation (pure, no trainer access)."""
from __future__ import annotations

from cope.episode import Episode


def episode_metrics(eps: list[Episode], prefix: str) -> dict[str, float]:
    """``<prefix>/success``, ``/reward``, ``/score``, ``/len`` (steps), ``/tokens``, ``/invalid_rate``,
    ``/truncated`` and ``/aborted`` as means over the episodes (aborted ones excluded from the first ones),
    ``/projected_actions``: the share of steps whose action the env read out of free text
    (``env.action_parsing=project``; 0 under strict parsing), ``/strict_valid``: the share of steps
    that were valid without projection (the format a model has to learn; ``1 - invalid_rate`` when strict),
    ``/multi_action``: the share of steps that wrote a complete admissible action and went on (``westwest``,
    :attr:`cope.episode.Step.multi_action`), and ``/action_cap``: the share of steps that hit the per-action
    token cap (no end-of-turn id sampled)."""
    ok = [e for e in eps if not e.aborted]
    n = max(len(ok), 1)
    steps = sum(e.num_steps for e in ok)
    invalid = sum(not s.valid for e in ok for s in e.steps)
    projected = sum(s.projected for e in ok for s in e.steps)
    strict = sum(s.strict for e in ok for s in e.steps)
    multi = sum(s.multi_action for e in ok for s in e.steps)
    capped = sum(not s.closed for e in ok for s in e.steps)
    return {
        f"{prefix}/success": sum(e.success for e in ok) / n,
        f"{prefix}/reward": sum(e.reward for e in ok) / n,
        f"{prefix}/score": sum(e.score for e in ok) / n,
        f"{prefix}/len": steps / n,
        f"{prefix}/tokens": sum(len(e.tokens) for e in ok) / n,
        f"{prefix}/invalid_rate": invalid / max(steps, 1),
        f"{prefix}/projected_actions": projected / max(steps, 1),
        f"{prefix}/strict_valid": strict / max(steps, 1),
        f"{prefix}/multi_action": multi / max(steps, 1),
        f"{prefix}/action_cap": capped / max(steps, 1),
        f"{prefix}/truncated": sum(e.truncated for e in eps) / max(len(eps), 1),
        f"{prefix}/aborted": sum(e.aborted for e in eps) / max(len(eps), 1),
    }
