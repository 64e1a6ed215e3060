"""Held-out success at equal env steps (and at equal generated tokens): arms whose epochs cost different env steps and
tokens (branched groups).

The study's runs have equal epochs (equal leaves per group, equal optimizer steps), but a branched group's tree takes
fewer env steps than the flat group of the same leaves, so at its last validation a branching run has spent fewer env
steps than its GRPO pair. Compared at equal epochs it is judged at equal updates; this module compares the arms at
equal *env steps*, the sampling cost: per seed, the budget is the smallest last-validation env-step count over the
arms that ran that seed, and every arm's held-out success there is read from its success-vs-env-steps curve by linear
interpolation between its validations (the warm start at 0 env steps included). Then per arm: the mean success at the
budget (bootstrap 95%), the paired difference to GRPO (bootstrap and paired t, as the study's other deltas), and the
env steps of the run's whole budget relative to GRPO's (mean per-seed ratio). The same comparison at equal generated
tokens (``key="generated_tokens"``: the counter of the tokens the policy sampled, the other half of the sampling cost)
reads the success-vs-tokens curves instead.

A regime opts in with ``equal_env_steps=True`` (:class:`bench.study.regimes.Regime`).
"""
from __future__ import annotations

import numpy as np

from bench.study.stats import bootstrap, fmt_interval, paired_difference, paired_t, separates

COSTS = {"env_steps": "env steps", "generated_tokens": "generated tokens"}  # the run curve's cost counters, by key


def success_at(curve: dict, steps: float, key: str = "env_steps") -> float | None:
    """The run's held-out success at ``steps`` of the counter ``key`` (linear between validations); None past its last
    one."""
    xs, ys = curve.get(key) or [], curve.get("success") or []
    if not xs or steps > xs[-1]:
        return None
    return float(np.interp(steps, xs, ys))


def summarize(arms: dict, key: str = "env_steps") -> dict:
    """{"key", "budget": {seed: count}, "arms": {arm: {n, success, delta, delta_t, steps_ratio}}} over the seeds every
    arm ran, at equal counts of ``key`` (:data:`COSTS`); ``arms``: the study summary's {arm: {"runs": {seed: curve}}}."""
    runs = {arm: row["runs"] for arm, row in arms.items()}
    seeds = sorted(set.intersection(*(set(r) for r in runs.values()))) if runs else []
    seeds = [s for s in seeds if all(runs[a][s].get(key) for a in runs)]
    budget = {s: min(runs[a][s][key][-1] for a in runs) for s in seeds}
    at = {a: {s: success_at(runs[a][s], budget[s], key) for s in seeds} for a in runs}
    out: dict = {"key": key, "budget": budget, "arms": {}}
    base = at.get("grpo", {})
    for arm, vals in at.items():
        row = {"n": len(vals), "success": bootstrap(list(vals.values()), "mean")}
        if "grpo" in runs and arm != "grpo":
            row["delta"], row["delta_t"] = paired_difference(vals, base), paired_t(vals, base)
            ratios = [runs[arm][s][key][-1] / runs["grpo"][s][key][-1] for s in seeds if runs["grpo"][s][key][-1]]
            row["steps_ratio"] = float(np.mean(ratios)) if ratios else None
        out["arms"][arm] = row
    return out


def lines(summary: dict | None, names: dict[str, str]) -> list[str]:
    """The markdown section of one regime (empty without a summary)."""
    if not summary or not summary["arms"]:
        return []
    budget, cost = summary["budget"], COSTS[summary.get("key", "env_steps")]
    out = [f"### Held-out success at equal {cost}", "",
           f"Per seed the budget is the fewest {cost} any arm had spent at its last validation "
           f"({', '.join(f'seed {s}: {int(b):,}' for s, b in budget.items())}); each arm's success there is read from its "
           f"success-vs-{cost.replace(' ', '-')} curve (linear between validations). Δ paired by seed vs GRPO, bootstrap "
           "(paired t).", "",
           f"| arm | n | success at the budget | Δ vs GRPO | {cost} of the whole run vs GRPO |", "|---|---:|---|---|---:|"]
    for arm, row in summary["arms"].items():
        delta, ratio = "–", "–"
        if "delta" in row:
            d, t = row["delta"], row["delta_t"]
            delta = (f"{d[0]:+.3f} [{d[1]:+.3f}, {d[2]:+.3f}] {separates(d[1], d[2])} "
                     f"(t: {separates(t[1], t[2]) if t[3] > 1 else '–'})")
            ratio = f"{row['steps_ratio']:.2f}x" if row.get("steps_ratio") is not None else "–"
        out.append(f"| {names.get(arm, arm)} | {row['n']} | {fmt_interval(*row['success'])} | {delta} | {ratio} |")
    return [*out, ""]


def draw(ax, arms: dict, colors: dict, names: dict, threshold: float, key: str = "env_steps") -> None:
    """Mean held-out success against the counter ``key`` per arm (the x range every seed's curve covers)."""
    from bench.study.stats import mean_band

    for arm, row in arms.items():
        curves = [(c[key], c["success"]) for c in row["runs"].values() if len(c.get(key) or []) > 1]
        if not curves:
            continue
        grid, mean, lo, hi = mean_band(curves)
        (line,) = ax.plot(grid, mean, "o-", ms=2.5, color=colors.get(arm), label=f"{names.get(arm, arm)} (n={len(curves)})")
        ax.fill_between(grid, lo, hi, color=line.get_color(), alpha=0.18, lw=0)
    ax.axhline(threshold, color="gray", ls="--", lw=0.8)
    ax.set(xlabel=COSTS[key], ylabel="held-out success", ylim=(-0.02, 1.02))


def plot(summary: dict, meta: dict, out, colors: dict, names: dict) -> None:
    """``success_vs_env_steps.png``: one panel per regime that opts in (``equal_env_steps``), where the arms' epochs
    cost different env steps, against env steps (top) and generated tokens (bottom); nothing without one."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    regimes = [r for r, info in meta["regimes"].items() if info.get("equal_env_steps") and r in summary["test"]]
    if not regimes:
        return
    fig = Figure(figsize=(4.2 * len(regimes), 3.8 * len(COSTS)), dpi=100)
    FigureCanvasAgg(fig)
    for j, key in enumerate(COSTS):
        for i, regime in enumerate(regimes):
            ax = fig.add_subplot(len(COSTS), len(regimes), j * len(regimes) + i + 1)
            draw(ax, summary["test"][regime], colors, names, meta["regimes"][regime]["threshold"], key)
            ax.set_title(regime, fontsize=9)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7, loc="best")
    fig.tight_layout()
    fig.savefig(out / "success_vs_env_steps.png")

