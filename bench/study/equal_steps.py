"""Held-out success at equal env steps: arms whose epochs cost different env steps (branched groups).

The study's runs have equal epochs (equal leaves per group, equal optimizer steps), but a branched group's tree takes
fewer env steps than the flat group of the same leaves, so at its last validation a branching run has spent fewer env
steps than its GRPO pair. Compared at equal epochs it is judged at equal updates; this module compares the arms at
equal *env steps*, the sampling cost: per seed, the budget is the smallest last-validation env-step count over the
arms that ran that seed, and every arm's held-out success there is read from its success-vs-env-steps curve by linear
interpolation between its validations (the warm start at 0 env steps included). Then per arm: the mean success at the
budget (bootstrap 95%), the paired difference to GRPO (bootstrap and paired t, as the study's other deltas), and the
env steps of the run's whole budget relative to GRPO's (mean per-seed ratio).

A regime opts in with ``equal_env_steps=True`` (:class:`bench.study.regimes.Regime`).
"""
from __future__ import annotations

import numpy as np

from bench.study.stats import bootstrap, fmt_interval, paired_difference, paired_t, separates


def success_at(curve: dict, steps: float) -> float | None:
    """The run's held-out success at ``steps`` env steps (linear between validations); None past its last one."""
    xs, ys = curve.get("env_steps") or [], curve.get("success") or []
    if not xs or steps > xs[-1]:
        return None
    return float(np.interp(steps, xs, ys))


def summarize(arms: dict) -> dict:
    """{"budget": {seed: env steps}, "arms": {arm: {n, success, delta, delta_t, steps_ratio}}} over the seeds every
    arm ran; ``arms``: the study summary's {arm: {"runs": {seed: curve}}}."""
    runs = {arm: row["runs"] for arm, row in arms.items()}
    seeds = sorted(set.intersection(*(set(r) for r in runs.values()))) if runs else []
    seeds = [s for s in seeds if all(runs[a][s].get("env_steps") for a in runs)]
    budget = {s: min(runs[a][s]["env_steps"][-1] for a in runs) for s in seeds}
    at = {a: {s: success_at(runs[a][s], budget[s]) for s in seeds} for a in runs}
    out: dict = {"budget": budget, "arms": {}}
    base = at.get("grpo", {})
    for arm, vals in at.items():
        row = {"n": len(vals), "success": bootstrap(list(vals.values()), "mean")}
        if "grpo" in runs and arm != "grpo":
            row["delta"], row["delta_t"] = paired_difference(vals, base), paired_t(vals, base)
            ratios = [runs[arm][s]["env_steps"][-1] / runs["grpo"][s]["env_steps"][-1] for s in seeds
                      if runs["grpo"][s]["env_steps"][-1]]
            row["steps_ratio"] = float(np.mean(ratios)) if ratios else None
        out["arms"][arm] = row
    return out


def lines(summary: dict | None, names: dict[str, str]) -> list[str]:
    """The markdown section of one regime (empty without a summary)."""
    if not summary or not summary["arms"]:
        return []
    budget = summary["budget"]
    out = ["### Held-out success at equal env steps", "",
           "Per seed the budget is the fewest env steps any arm had spent at its last validation "
           f"({', '.join(f'seed {s}: {int(b):,}' for s, b in budget.items())}); each arm's success there is read from its "
           "success-vs-env-steps curve (linear between validations). Δ paired by seed vs GRPO, bootstrap (paired t).", "",
           "| arm | n | success at the budget | Δ vs GRPO | env steps of the whole run vs GRPO |", "|---|---:|---|---|---:|"]
    for arm, row in summary["arms"].items():
        delta, ratio = "–", "–"
        if "delta" in row:
            d, t = row["delta"], row["delta_t"]
            delta = (f"{d[0]:+.3f} [{d[1]:+.3f}, {d[2]:+.3f}] {separates(d[1], d[2])} "
                     f"(t: {separates(t[1], t[2]) if t[3] > 1 else '–'})")
            ratio = f"{row['steps_ratio']:.2f}x" if row.get("steps_ratio") is not None else "–"
        out.append(f"| {names.get(arm, arm)} | {row['n']} | {fmt_interval(*row['success'])} | {delta} | {ratio} |")
    return [*out, ""]


def draw(ax, arms: dict, colors: dict, names: dict, threshold: float) -> None:
    """Mean held-out success against env steps per arm (the x range every seed's curve covers)."""
    from bench.study.stats import mean_band

    for arm, row in arms.items():
        curves = [(c["env_steps"], c["success"]) for c in row["runs"].values() if len(c.get("env_steps") or []) > 1]
        if not curves:
            continue
        grid, mean, lo, hi = mean_band(curves)
        (line,) = ax.plot(grid, mean, "o-", ms=2.5, color=colors.get(arm), label=f"{names.get(arm, arm)} (n={len(curves)})")
        ax.fill_between(grid, lo, hi, color=line.get_color(), alpha=0.18, lw=0)
    ax.axhline(threshold, color="gray", ls="--", lw=0.8)
    ax.set(xlabel="env steps", ylabel="held-out success", ylim=(-0.02, 1.02))


def plot(summary: dict, meta: dict, out, colors: dict, names: dict) -> None:
    """``success_vs_env_steps.png``: one panel per regime that opts in (``equal_env_steps``), where the arms' epochs
    cost different env steps; nothing without one."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    regimes = [r for r, info in meta["regimes"].items() if info.get("equal_env_steps") and r in summary["test"]]
    if not regimes:
        return
    fig = Figure(figsize=(4.2 * len(regimes), 3.8), dpi=100)
    FigureCanvasAgg(fig)
    for i, regime in enumerate(regimes):
        ax = fig.add_subplot(1, len(regimes), i + 1)
        draw(ax, summary["test"][regime], colors, names, meta["regimes"][regime]["threshold"])
        ax.set_title(regime, fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="best")
    fig.tight_layout()
    fig.savefig(out / "success_vs_env_steps.png")

