"""Episode-level metrics shared by training rollouts and validation (pure, no trainer access).

Two steps, so that several processes can pool their episodes: :func:`episode_tally` counts sums and counts
over a list of episodes (sums over ranks are the sums over all ranks' episodes), :func:`tally_metrics` turns a
tally into the logged ratios. :func:`episode_metrics` is both in one process."""
from __future__ import annotations

from cope.episode import Episode

# what episode_tally counts: episodes (all), ok (not aborted); over the ok episodes: success, reward, score,
# steps, tokens, and per step invalid, projected, strict, multi_action, action_cap; over all: truncated, aborted (by a
# failure: Episode.failed, not the episodes a collector skipped on purpose, which are neither ok nor aborted)
TALLY_KEYS = ("episodes", "ok", "success", "reward", "score", "steps", "tokens", "invalid", "projected", "strict",
              "multi_action", "action_cap", "truncated", "aborted")


def episode_tally(eps: list[Episode]) -> dict[str, float]:
    """The sums and counts behind :func:`episode_metrics` (keys :data:`TALLY_KEYS`, in that order), as floats."""
    ok = [e for e in eps if not e.aborted]
    steps = [s for e in ok for s in e.steps]
    return {
        "episodes": float(len(eps)),
        "ok": float(len(ok)),
        "success": float(sum(e.success for e in ok)),
        "reward": float(sum(e.reward for e in ok)),
        "score": float(sum(e.score for e in ok)),
        "steps": float(sum(e.num_steps for e in ok)),
        "tokens": float(sum(len(e.tokens) for e in ok)),
        "invalid": float(sum(not s.valid for s in steps)),
        "projected": float(sum(s.projected for s in steps)),
        "strict": float(sum(s.strict for s in steps)),
        "multi_action": float(sum(s.multi_action for s in steps)),
        "action_cap": float(sum(not s.closed for s in steps)),
        "truncated": float(sum(e.truncated for e in eps)),
        "aborted": float(sum(e.failed for e in eps)),
    }


# logged name -> (numerator, denominator) in the tally: means over the non-aborted episodes, shares of their steps,
# shares of all episodes
RATIOS = {"success": ("success", "ok"), "reward": ("reward", "ok"), "score": ("score", "ok"), "len": ("steps", "ok"),
          "tokens": ("tokens", "ok"), "invalid_rate": ("invalid", "steps"), "projected_actions": ("projected", "steps"),
          "strict_valid": ("strict", "steps"), "multi_action": ("multi_action", "steps"),
          "action_cap": ("action_cap", "steps"), "truncated": ("truncated", "episodes"),
          "aborted": ("aborted", "episodes")}


def tally_metrics(tally: dict[str, float], prefix: str) -> dict[str, float]:
    """``<prefix>/*`` of :func:`episode_metrics` from a tally of :func:`episode_tally` (or a sum of several)."""
    return {f"{prefix}/{name}": tally[num] / max(tally[den], 1.0) for name, (num, den) in RATIOS.items()}


def episode_metrics(eps: list[Episode], prefix: str) -> dict[str, float]:
    """``<prefix>/success``, ``/reward``, ``/score``, ``/len`` (steps), ``/tokens``, ``/invalid_rate``,
    ``/truncated`` and ``/aborted`` as means over the episodes (aborted ones excluded from the first ones),
    ``/projected_actions``: the share of steps whose action the env read out of free text
    (``env.action_parsing=project``; 0 under strict parsing), ``/strict_valid``: the share of steps
    that were valid without projection (the format a model has to learn; ``1 - invalid_rate`` when strict),
    ``/multi_action``: the share of steps that wrote a complete admissible action and went on (``westwest``,
    :attr:`cope.episode.Step.multi_action`), and ``/action_cap``: the share of steps that hit the per-action
    token cap (no end-of-turn id sampled)."""
    return tally_metrics(episode_tally(eps), prefix)
