"""The study's tables (``study.md``), from :func:`bench.study.report.summarize`'s summary and the launcher's meta: per
regime, its budget, panels and seeds, the outcome table, the final evaluation's table, the smallest effect each
paired comparison could detect, the mechanism table, the per-size table and the tuning."""

from __future__ import annotations

import json
import math
from pathlib import Path

from bench.study import aux_signal, equal_steps
from bench.study.final_eval import REFERENCES, half_width
from bench.study.stats import fmt_interval, separates

STABILITY = (("rollout/invalid_rate", "max"), ("rollout/multi_action", "max"), ("stop/prob_val", "min"),
             ("train/kl_stopped_steps", "max"))  # per run: the worst epoch (kl_stopped_steps: the run's total)

NAMES = {
    "grpo": "GRPO",
    "cope": "CoPE (continuation)",
    "cope_authors": "CoPE (authors')",
    "echo": "ECHO",
    "cope_turns": "CoPE (authors', turns)",
    "rwml_grpo": "RWML+GRPO",
    "wm_sft": "WM-SFT+GRPO",
    "grpo_sft": "GRPO on SFT",
    "grpo_branch": "GRPO, branched groups",
}
AUX = {"cope": "forecast", "cope_authors": "forecast", "cope_turns": "forecast", "echo": "echo"}  # the arm's grad/* name


def write_table(out: Path, rows: list[dict] | dict, head: str, table: str) -> None:
    """An after-the-fact study table: ``head`` and ``table`` to ``out`` (markdown), every run's row to the ``.json``
    beside it; the table is printed."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(rows, indent=1) + "\n")
    out.write_text(head + table + "\n")
    print(table)


def mean_of(xs: list) -> float | None:
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else None


def _f(x: float | None, spec: str = ".3f") -> str:
    return "–" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def _pair(v: tuple | None, spec: str) -> str:
    """``0.42 (worst 0.86)``: the mean over seeds and the worst seed's value."""
    return "–" if v is None else f"{_f(v[0], spec)} (worst {_f(v[1], spec)})"


def delta_cell(row: dict, key: str) -> str:
    """``+0.031 [+0.010, +0.050] better (t: no)``: the bootstrap interval, its verdict, the t interval's verdict."""
    d, t = row.get(key), row.get(key + "_t")
    if not (d and d[3]):
        return "–"
    if d[3] == 1:  # one pair: a difference, no interval and no verdict
        return f"{d[0]:+.3f} (1 pair: no interval)"
    cell = f"{fmt_interval(*d[:3], '+.3f')} {separates(d[1], d[2])}"
    return cell + (f" (t: {separates(t[1], t[2])})" if t and t[3] > 1 else "")


def _mean_cell(v: tuple, n: int) -> str:
    """A mean over ``n`` seeds with its bootstrap interval; one seed has no interval."""
    if n == 0:
        return "–"
    return f"{v[0]:.3f} (1 seed)" if n == 1 else fmt_interval(*v)


def ran_seeds(summary: dict, regime: str) -> list[int]:
    """The test seeds that finished in any arm of ``regime`` (the planned ones are in the launcher's meta)."""
    return sorted({s for row in summary["test"].get(regime, {}).values() for s in row["seeds"]})


def _count(ns: set[int]) -> str:
    """``3 seeds``, ``3-5 seeds``: how many test seeds ran per regime."""
    lo, hi = min(ns, default=0), max(ns, default=0)
    return f"{lo} seed{'s' * (lo != 1)}" if lo == hi else f"{lo}-{hi} seeds"


def markdown(summary: dict, meta: dict) -> str:
    counts = {len(ran_seeds(summary, r)) for r in meta["regimes"]}
    lines = [
        "# Sample-efficiency study",
        "",
        f"Every run: `{' '.join(meta['common'])}`. Intervals: bootstrap 95% over "
        "seeds; Δ = paired by seed vs GRPO, its verdict (better/worse: the interval excludes 0), then in brackets the "
        "verdict of the paired t 95% interval of the same differences (the conservative check: at "
        f"{_count(counts)} the bootstrap interval is narrow).",
        "",
    ]
    for regime, info in meta["regimes"].items():
        lines += _regime(regime, info, summary, meta)
    return "\n".join(lines)


def _regime(regime: str, info: dict, summary: dict, meta: dict) -> list[str]:
    arms = summary["test"].get(regime, {})
    ran = ran_seeds(summary, regime)
    per_arm = "".join(f"; {NAMES.get(a, a)} also `{' '.join(ov)}`" for a, ov in info.get("arm_overrides", {}).items() if ov)
    lines = [
        f"## {regime}: {info['title']}",
        "",
        f"Threshold {info['threshold']:g} held-out success; overrides `{' '.join(info['overrides']) or '(defaults)'}`"
        + per_arm
        + (f"; settings tuned in `{info['tuned_in']}`" if info["tuned_in"] else "")
        + ".",
        f"Budget per run `{' '.join(info['budget'])}`; panels: tuning `{' '.join(info['panels']['tune'])}`, reported "
        f"`{' '.join(info['panels']['test'])}`; seeds: tuning {info['seeds']['tune']}, test {_seeds_line(ran, info)}.",
        "",
    ]
    lines += [
        "| arm | setting | seeds | start | episodes to thr (median) | env steps to thr (median) | final success | "
        "AUC | Δ AUC vs GRPO | Δ final vs GRPO | wall s/run |",
        "|---|---|---:|---:|---|---|---|---|---|---|---:|",
    ]
    for arm, row in arms.items():
        deltas = [delta_cell(row, key) for key in ("delta_auc", "delta_final")]
        lines.append(
            " | ".join(
                [
                    f"| {NAMES.get(arm, arm)}",
                    f"`{row['setting']}`",
                    str(len(row["seeds"])),
                    _f(row["start"]),
                    fmt_interval(*row["episodes_to"], ".0f"),
                    fmt_interval(*row["env_steps_to"], ".0f"),
                    fmt_interval(*row["final"]),
                    fmt_interval(*row["auc"]),
                    *deltas,
                    _f(row["wall_s"], ".0f"),
                ]
            )
            + " |"
        )
    between = summary.get("between", {}).get(regime, [])
    if between:
        lines += ["", "Between the other arms (the first minus the second, paired by seed, as the Δ columns above):", "",
                  "| arm | vs | Δ AUC | Δ final |", "|---|---|---|---|"]
        lines += [f"| {NAMES.get(p['arm'], p['arm'])} | {NAMES.get(p['base'], p['base'])} | {delta_cell(p, 'delta_auc')} "
                  f"| {delta_cell(p, 'delta_final')} |" for p in between]
    final = summary.get("final", {}).get(regime, {})
    lines += _final(final, info)
    lines += _detectable(arms, between, final)
    lines += _sft_gain(summary.get("sft_gain", {}).get(regime))
    lines += aux_signal.lines(summary.get("aux_signal", {}).get(regime), NAMES)
    for costs in summary.get("equal_steps", {}).get(regime) or []:  # at equal env steps, then generated tokens
        lines += equal_steps.lines(costs, NAMES)
    lines += [
        "",
        "Mechanism (gradients: means over the steps where both are non-zero, then over seeds; groups without a reward "
        "spread (every episode of the group the same reward: no policy-gradient signal): the share per epoch, mean "
        "over epochs and seeds; probes and answer forms: the last validation's held-out episodes, mean over seeds; "
        "forecast samples: per epoch over the first 2 epochs, mean over seeds):",
        "",
        "| arm | cos(aux grad, pg grad) | aux / pg grad norm | steps measured per run (mean) | groups without a reward spread "
        "| forecast samples / epoch (early) "
        "| probe forecast action acc | probe obs NLL | held-out invalid actions / step | multi-action answers "
        "| strict-valid answers | projected answers | seeds with every held-out action invalid |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for arm, row in arms.items():
        aux = AUX.get(arm)
        lines.append(
            f"| {NAMES.get(arm, arm)} | {_f(row.get(f'grad/cos_{aux}_pg'))} | {_f(row.get(f'grad/ratio_{aux}_pg'))} | "
            f"{_f(row.get('grad/measured_steps'), '.1f')} | {_f(row.get('zero_signal_groups'), '.2f')} | "
            f"{_f(row.get('forecast/samples_early'), '.1f')} | "
            f"{_f(row.get('probe/forecast_action_acc'))} | {_f(row.get('probe/obs_nll'))} | "
            f"{_f(row.get('invalid_rate'))} | {_f(row.get('val/multi_action'))} | {_f(row.get('val/strict_valid'))} | "
            f"{_f(row.get('val/projected_actions'))} | {row.get('collapsed', 0)} of {len(row['seeds'])} |"
        )
    lines += ["", "Stability (per run its worst epoch, then the mean over seeds and the worst seed; rollouts: sampled training "
              "episodes; held-out stop p: the end-of-turn token's probability after a complete action, where one was measured; "
              "peak minus last: how far held-out success fell from its best validation by the last, a late collapse):", "",
              "| arm | peak rollout invalid | peak rollout multi-action | lowest held-out stop p | seeds with a validation "
              "all invalid after one that was not | policy steps dropped (trust region) | held-out success, peak minus last |",
              "|---|---|---|---|---:|---|---|"]
    for arm, row in arms.items():
        cells = [_pair(row.get(f"{k}/{how}"), ".0f" if k.startswith("train/") else ".2f") for k, how in STABILITY]
        lines.append(f"| {NAMES.get(arm, arm)} | {cells[0]} | {cells[1]} | {cells[2]} | "
                     f"{row.get('collapsed_validations', 0)} of {len(row['seeds'])} | {cells[3]} | "
                     f"{_pair(row.get('success_drop'), '.3f')} |")
    lines += _sized(summary.get("by_size", {}).get(regime))
    tune = summary["tuning"].get(info["tuned_in"] or regime, {})
    if tune and not info["tuned_in"]:
        lines += ["", "Tuning (mean AUC / final success on the tuning panel, tuning seeds, and the held-out observation NLL at the "
                  "last validation where the probe measured it; chosen in bold):", ""]
        for arm, settings in tune.items():
            chosen = meta["choice"].get(f"{regime}/{arm}", {}).get("setting")
            cells, aucs = [], {}
            for label, cs in settings.items():
                aucs[label] = mean_of([c['auc'] for c in cs])
                nll = mean_of([c.get("probe/obs_nll/last") for c in cs])  # what ECHO trains: its setting's visible effect
                cell = f"`{label}` {_f(aucs[label])} / {_f(mean_of([c['final'] for c in cs]))}" + (
                    f" (obs NLL {_f(nll)})" if nll is not None else "")
                cells.append(f"**{cell}**" if label == chosen else cell)
            tied = [lb for lb, a in aucs.items() if lb != chosen and chosen in aucs and a is not None and a == aucs[chosen]]
            tie = f" (a tie with {', '.join(f'`{lb}`' for lb in tied)}: the first in the grid's order)" if tied else ""
            lines.append(f"- {NAMES.get(arm, arm)}: " + ", ".join(cells) + tie)
        grid = meta.get("grid", {}).get(regime, {})
        for arm in grid:
            if arm not in tune and len(grid[arm]) > 1:
                lines.append(f"- {NAMES.get(arm, arm)}: no finished tuning run yet, so the arm is not reported")
    tune_walls = [c["wall_s"] for s in (tune.values() if not info["tuned_in"] else ()) for cs in s.values() for c in cs]
    test_walls = [c["wall_s"] for row in arms.values() for c in row["runs"].values()]
    walls = [w for w in (*tune_walls, *test_walls) if w is not None]
    if walls:  # what the regime cost: each run's wall time (done marker; shared cores included)
        lines += ["", f"Wall time of the finished runs: {len(tune_walls)} tuning + {len(test_walls)} test runs, "
                      f"{sum(walls) / 3600:.1f} run-hours in all."]
    return [*lines, ""]


def _final(final: dict, info: dict) -> list[str]:
    """The final evaluation's table (:mod:`bench.study.final_eval`), and the seeds without one, named with the reason."""
    if not final:
        return []
    count = info.get("final_eval") or max((t for row in final.values() for t in row["tasks"]), default=0)
    refs = [r for r in REFERENCES if r in final]
    lines = ["", f"Final evaluation (each test run's last checkpoint, greedy, on test tasks 0..{count - 1} by eval.py; "
             "mean over the evaluated seeds, bootstrap 95%; Δ paired by seed over the seeds both arms evaluated, both checks "
             "as above):", "",
             "| arm | setting | tasks | seeds evaluated | greedy success | " + " | ".join(f"Δ vs {NAMES.get(r, r)}" for r in refs) + " |",
             "|---|---|---:|---|---|" + "---|" * len(refs)]
    for arm, row in final.items():
        lines.append(f"| {NAMES.get(arm, arm)} | `{row['setting']}` | {'/'.join(map(str, row['tasks'])) or '–'} | "
                     f"{', '.join(map(str, row['seeds'])) or 'none'} | "
                     f"{_mean_cell(row['success'], len(row['seeds']))} | "
                     + " | ".join(delta_cell(row, f"delta_{r}") for r in refs) + " |")
    reasons: dict[str, list[str]] = {}
    for arm, row in final.items():
        for seed, why in sorted(row["missing"].items()):
            reasons.setdefault(why, []).append(f"{NAMES.get(arm, arm)} seed {seed}")
    for why, runs in reasons.items():
        lines += ["", f"Not evaluated ({why}): {', '.join(runs)}; these runs are reported from their curve only (the "
                      "first table)."]
    replayed = [f"{NAMES.get(arm, arm)} seed {s}" for arm, row in final.items() for s in row.get("replayed", [])]
    if replayed:
        lines += ["", f"Evaluated on a replay ({', '.join(replayed)}): the run's checkpoint was gone, so its recorded "
                      "command ran again from the same commit (bench.study.replay), and the replay's curves, metrics and "
                      "held-out outcomes equal the record's row for row before its last checkpoint was evaluated."]
    return lines


def _detectable(arms: dict, between: list[dict], final: dict) -> list[str]:
    """The smallest effect each paired comparison could detect: the paired t 95% interval's half-width of Δ final
    (an observed mean difference below it does not separate), per comparison, on the curve's last validation and on
    the final evaluation."""
    curve = [(a, "grpo", row.get("delta_final_t")) for a, row in arms.items() if a != "grpo"]
    curve += [(p["arm"], p["base"], p.get("delta_final_t")) for p in between]
    evaluated = [(a, r, row.get(f"delta_{r}_t")) for a, row in final.items() for r in REFERENCES]
    parts = []
    for label, comps in (("last validation", curve), ("final evaluation", evaluated)):
        cells = [f"{NAMES.get(a, a)} − {NAMES.get(b, b)} ±{half_width(t):.3f} ({t[3]} pairs)"
                 for a, b, t in comps if half_width(t) is not None]
        if cells:
            parts.append(f"{label}: " + ", ".join(cells))
    if not parts:
        return []
    return ["", "Smallest effect these seeds could detect (the paired t 95% half-width of Δ final success: an observed "
                "mean difference smaller than it does not separate): " + "; ".join(parts) + "."]


def _sft_gain(gain: dict | None) -> list[str]:
    """ECHO's "share of the SFT gain recovered" (bench.study.stages.sft_gain), when the regime has the three arms."""
    if not gain or not gain["seeds"]:
        return []
    per = ", ".join(f"seed {s} {v:+.2f}" for s, v in sorted(gain["shares"].items()))
    mean = "–" if gain["mean"] is None else f"{gain['mean']:+.2f}"
    flat = f"; {gain['no_gain_seeds']} seed(s) where SFT gained nothing have no share" if gain["no_gain_seeds"] else ""
    pooled = gain.get("pooled")
    pooled = ("–" if pooled is None else
              f"{pooled[0]:+.2f}" + (f" [{pooled[1]:+.2f}, {pooled[2]:+.2f}]" if len(gain["seeds"]) > 1 else " (1 seed)"))
    return ["", f"Share of the SFT gain ECHO recovers, (ECHO − GRPO) / (GRPO on SFT − GRPO) in final held-out success: "
                f"pooled (the ratio of the mean gains over {len(gain['seeds'])} seed(s), bootstrap 95% over seeds) "
                f"{pooled}; per seed: {per or 'none'}; their mean {mean}{flat}. GRPO on SFT also spent its SFT run's "
                "demonstrations (env steps of the expert, not counted in its curve)."]


def _seeds_line(ran: list[int], info: dict) -> str:
    """``[0, 1, 2]``, and the planned seeds that did not run, if any."""
    missing = [s for s in info["seeds"]["test"] if s not in ran]
    return f"{ran}" + (f" (planned {info['seeds']['test']}; {', '.join(map(str, missing))} did not run)" if missing else "")


def _sized(sized: dict | None) -> list[str]:
    if not sized:
        return []
    lines = [
        "",
        "Per maze size (the reported panel's tasks of that size; runs with per-task files):",
        "",
        "| size | tasks | arm | n | final success | AUC | Δ AUC vs GRPO | Δ final vs GRPO |",
        "|---|---:|---|---:|---|---|---|---|",
    ]
    for size, per_arm in sized.items():
        for arm, row in per_arm.items():
            deltas = [delta_cell(row, k) for k in ("delta_auc", "delta_final")]
            lines.append(
                f"| {size}x{size} | {row['tasks']} | {NAMES.get(arm, arm)} | {row['n']} | "
                f"{fmt_interval(*row['final'])} | {fmt_interval(*row['auc'])} | {deltas[0]} | {deltas[1]} |"
            )
    return lines


__all__ = ["AUX", "NAMES", "delta_cell", "markdown", "mean_of", "ran_seeds"]
