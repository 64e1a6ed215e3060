"""Tables and plots of the sample-efficiency study (:mod:`bench.study.launch`), from the run folders alone.

Per run (``run_curve``): the held-out curve of ``csv/learning_curve.csv``, the gradient diagnostics and
probes of ``csv/metrics.csv`` and the wall time of its ``done`` marker. Per regime and arm (``report``):
episodes and env steps to the regime's threshold (median over seeds, bootstrap 95%), final held-out
success and AUC (mean, bootstrap 95%), the paired difference to GRPO in AUC and in final success (mean
over seeds, bootstrap 95%; "better"/"worse" when the interval excludes 0), the mean cosine of each
auxiliary gradient with the PG gradient and the mean ratio of their norms, and the wall time.

Per maze size (``by_size``, a regime's list of maze sizes): the same final success and AUC, and their paired
differences to GRPO, on the panel's tasks of each size alone, read from each run's per-task validation files
(``csv/val_episodes/episodes<N>.csv``, :mod:`cope.callbacks.val_episodes`); a task's size is what the maze env
builds for it. A run without those files is left out of this table (its ``n`` says so).

The final evaluation (a regime's ``final_eval``: each test run's last checkpoint on a larger panel) is read and
compared by :mod:`bench.study.final_eval`.
"""
from __future__ import annotations

import csv
import json
import math
from pathlib import Path

from bench.study import aux_signal, equal_steps, final_eval, stages
from bench.study.markdown import AUX, NAMES, STABILITY, markdown, mean_of
from bench.study.stats import auc_norm, bootstrap, first_reaching, fmt_interval, mean_band, paired_difference, paired_t

COLORS = {"grpo": "C0", "cope": "C1", "echo": "C2", "cope_authors": "C3", "cope_turns": "C4", "rwml_grpo": "C5", "wm_sft": "C6",
          "grpo_sft": "C7", "grpo_branch": "C8"}  # an arm's colour in every panel
DIAG = ("grad/cos_{aux}_pg", "grad/ratio_{aux}_pg")
PROBES = ("probe/forecast_action_acc", "probe/obs_nll")
VAL_LAST = ("val/multi_action", "val/strict_valid", "val/projected_actions")  # held-out answer forms at the last validation
EARLY_EPOCHS = 2  # "are the forecast samples non-empty in the first epochs": forecast/samples over these, per epoch


def _rows(path: Path) -> list[dict]:
    if not path.exists():
        return []
    with path.open() as f:
        return [{k: (float(v) if v not in ("", None) else None) for k, v in r.items()} for r in csv.DictReader(f)]


def run_curve(d: Path, threshold: float | None = None, aux: str | None = None) -> dict:
    """One run's numbers (see the module docstring); ``aux`` names the auxiliary objective whose
    gradient diagnostics are read (``forecast``, ``echo``)."""
    val = [r for r in _rows(d / "csv/learning_curve.csv") if r.get("val_success") is not None]
    xs, steps, ys = [r["episodes"] for r in val], [r["env_steps"] for r in val], [r["val_success"] for r in val]
    tokens = [r.get("generated_tokens") for r in val]  # [] for a record without the column
    out = {"episodes": xs, "env_steps": steps, "generated_tokens": tokens if None not in tokens else [], "success": ys,
           "auc": auc_norm(xs, ys), "final": ys[-1] if ys else None, "start": ys[0] if ys else None,
           "success_drop": max(ys) - ys[-1] if ys else None}  # a late collapse: peak - last
    if threshold is not None:
        out["episodes_to"] = first_reaching(xs, ys, threshold)
        out["env_steps_to"] = first_reaching(steps, ys, threshold)
    metrics = _rows(d / "csv/metrics.csv")
    if aux:
        # steps where either gradient is 0 (no group with a reward spread: no PG gradient; no forecast
        # target) log a cosine of 0 by convention: they are no measurement of the angle, so they are left out
        # (the ratio is > 0 exactly when both are non-zero). CoPE's separate forecast steps log theirs on their own
        # step, against the kept PG gradient of the last measured policy step: no grad/pg_norm on that row.
        every = grad_every(d)
        measured = [r for r in metrics if (r.get(f"grad/ratio_{aux}_pg") or 0) > 0 and (r.get(f"grad/{aux}_norm") or 0) > 0
                    and (r.get("grad/pg_norm") is None or every is None or r.get("step") is None or int(r["step"]) % every == 0)]
        out["grad/measured_steps"] = len(measured)
        for key in DIAG:
            k = key.format(aux=aux)
            series = [(r["step"], r[k]) for r in measured if r.get(k) is not None and r.get("step") is not None]
            out[k] = series
            out[k + "/mean"] = sum(v for _, v in series) / len(series) if series else None
    for k in PROBES:
        vals = [r[k] for r in metrics if r.get(k) is not None]
        out[k + "/last"] = vals[-1] if vals else None
    chunks = [r["probe/forecast_chunks"] for r in metrics if r.get("probe/forecast_chunks") is not None]
    if chunks and chunks[-1] == 0:  # no held-out success to probe: the logged 0 is no accuracy
        out["probe/forecast_action_acc/last"] = None
    for k in VAL_LAST:  # the last validation's rate
        vals = [r[k] for r in metrics if r.get(k) is not None]
        out[k + "/last"] = vals[-1] if vals else None
    out["forecast/samples_early"] = early_forecast_samples(metrics)
    # groups without a reward spread (no PG signal), the epoch's share, mean over epochs
    out["zero_signal_groups"] = mean_of([r.get("rollout/zero_signal_groups") for r in metrics])
    for k, how in STABILITY:  # the run's extreme of an epoch metric: how close it came to a collapse
        vals = [r[k] for r in metrics if r.get(k) is not None and measured_stop(r, k)]
        out[f"{k}/{how}"] = (max if how == "max" else min)(vals) if vals else None
    out["collapsed_validations"] = collapsed_validations([r["val/invalid_rate"] for r in metrics if r.get("val/invalid_rate") is not None])
    out["invalid_rate"] = invalid_rate(d)
    out["aux"] = aux_signal.of_run(metrics)  # what an RWML or WM-SFT stage had to train on
    done = d / "done"
    out["wall_s"] = json.loads(done.read_text())["wall_s"] if done.exists() else None
    return out


def collapsed_validations(rates: list[float], level: float = 0.99) -> int:
    """Validations with every held-out action invalid (rate >= ``level``) after one that was not: a regression.
    All invalid from the start is a cold start (SmolLM2 before it learns a readable answer), not a collapse."""
    seen_readable, count = False, 0
    for r in rates:
        count += seen_readable and r >= level
        seen_readable = seen_readable or r < level
    return count


def measured_stop(row: dict, key: str) -> bool:
    """Whether ``row``'s end-of-turn probability (``stop/prob``, ``stop/prob_val``) measured anything: over at least
    one complete action (``stop/positions``, ``stop/positions_val``). A row from before those counts were logged is
    taken as measured unless its value is exactly 0, which a softmax probability is not; the callback logs 0 for none
    (answers in prose that the projection reads, SmolLM2's: no complete action)."""
    if key not in ("stop/prob", "stop/prob_val"):
        return True
    count = row.get(key.replace("prob", "positions"))
    return count > 0 if count is not None else row[key] != 0.0


def early_forecast_samples(metrics: list[dict]) -> float | None:
    """Forecast samples per epoch over the first ``EARLY_EPOCHS`` epochs (None: the run logs none, e.g. GRPO)."""
    early = [r["forecast/samples"] for r in metrics if r.get("forecast/samples") is not None and (r.get("epoch") or 0) < EARLY_EPOCHS]
    return sum(early) / EARLY_EPOCHS if early else None


def validation_files(d: Path) -> list[tuple[int, Path]]:
    """A run's per-task held-out files (``csv/val_episodes/episodes<N>.csv``) as (N: episodes trained before that
    validation, path), oldest first."""
    files = [(p.stem.removeprefix("episodes"), p) for p in (d / "csv/val_episodes").glob("episodes*.csv")]
    return sorted((int(n), p) for n, p in files if n.isdigit())


def invalid_rate(d: Path) -> float | None:
    """Invalid actions per step over the held-out tasks at the run's last validation (its newest per-task file)."""
    files = validation_files(d)
    if not files:
        return None
    with files[-1][1].open() as f:
        rows = list(csv.DictReader(f))
    steps = sum(float(r["steps"]) for r in rows)
    return sum(float(r["invalid"]) for r in rows) / steps if steps else None


def grad_every(d: Path) -> int | None:
    """The run's ``callbacks.grad_stats.every_n_steps`` from its resolved config (None without one).

    The gradient diagnostics are measured on the steps that are multiples of it. Runs made before the callback
    logged to the loggers directly (2026-12-02) also repeat each measurement on the following steps of its
    epoch (Lightning re-reports a hook's logged value); only the measured steps' rows are read."""
    cfg = d / ".hydra/config.yaml"
    if not cfg.exists():
        return None
    import yaml  # noqa: PLC0415 - a dependency of hydra

    every = ((yaml.safe_load(cfg.read_text()) or {}).get("callbacks") or {}).get("grad_stats", {}).get("every_n_steps")
    return int(every) if every else None


def maze_sizes(indices: list[int], sizes: list[int]) -> dict[int, int]:
    """The size of each held-out maze (test split) the env builds with ``sizes``."""
    from cope.envs.base import Task
    from cope.envs.maze import MazeEnv

    env = MazeEnv(sizes=list(sizes))
    try:
        return {i: int(env.reset(Task(env.name, "test", i)).info["size"]) for i in indices}
    finally:
        env.close()


def _outcomes(path: Path) -> list[dict]:
    """A per-task validation file's rows as {index, success}."""
    with path.open() as f:
        return [{"index": int(r["index"]), "success": float(r["success"])} for r in csv.DictReader(f)]


def size_curves(d: Path, sizes: list[int]) -> dict[int, dict]:
    """{size: {episodes, success, auc, final}} from a run's per-task validation files ({} without them)."""
    points = [(n, _outcomes(p)) for n, p in validation_files(d)]
    if not points:
        return {}
    size_of = maze_sizes(sorted({int(r["index"]) for _, rows in points for r in rows}), sizes)
    out = {}
    for size in sizes:
        xs, ys = [], []
        for n, rows in points:
            hits = [r["success"] for r in rows if size_of[int(r["index"])] == size]
            if hits:
                xs.append(n)
                ys.append(sum(hits) / len(hits))
        if xs:
            out[size] = {"episodes": xs, "success": ys, "auc": auc_norm(xs, ys), "final": ys[-1],
                         "tasks": sum(size_of[int(r["index"])] == size for r in points[-1][1])}
    return out


def _deltas(runs: dict, base: dict) -> dict:
    """``delta_auc`` and ``delta_final``: the arm's runs minus GRPO's, paired by seed (``paired_difference``, the
    bootstrap), and ``delta_auc_t`` / ``delta_final_t``: the paired Student-t interval of the same differences."""
    out = {}
    for key in ("auc", "final"):
        arm = {s: c[key] for s, c in runs.items() if c[key] is not None}
        ref = {s: c[key] for s, c in base.items() if c[key] is not None}
        out[f"delta_{key}"], out[f"delta_{key}_t"] = paired_difference(arm, ref), paired_t(arm, ref)
    return out


def _by_size(arms: dict, sizes: list[int]) -> dict:
    """{size: {arm: {n, final, auc, delta_final, delta_auc}}} over the runs that have per-task files."""
    out: dict = {}
    per_run = {arm: {s: c for s, c in row["size_runs"].items() if c} for arm, row in arms.items()}
    for size in sizes:
        base = {seed: c[size] for seed, c in per_run.get("grpo", {}).items() if size in c}
        for arm, runs in per_run.items():
            cs = {seed: c[size] for seed, c in runs.items() if size in c}
            if not cs:
                continue
            row = {"n": len(cs), "tasks": next(iter(cs.values()))["tasks"],
                   "final": bootstrap([c["final"] for c in cs.values()], "mean"),
                   "auc": bootstrap([c["auc"] for c in cs.values() if c["auc"] is not None], "mean")}
            if arm != "grpo" and base:
                row.update(_deltas(cs, base))
            out.setdefault(size, {})[arm] = row
    return out


def _iv(values: list[float], stat: str, spec: str) -> str:
    return fmt_interval(*bootstrap(values, stat), spec) if values else "–"


def summarize(results: list[dict], meta: dict) -> dict:
    """{regime: {arm: row}} of the test runs, and {regime: {arm: {setting: tuning score}}}."""
    table: dict = {}
    tuning: dict = {}
    for res in results:
        job = res["job"]
        if res["rc"] != 0:
            continue
        thr = meta["regimes"][job.regime]["threshold"]
        c = run_curve(Path(res["dir"]), thr, AUX.get(job.arm))
        if job.phase == "tune":
            tuning.setdefault(job.regime, {}).setdefault(job.arm, {}).setdefault(job.setting, []).append(c)
        else:
            row = table.setdefault(job.regime, {}).setdefault(job.arm, {"setting": job.setting, "runs": {}, "size_runs": {}})
            row["runs"][job.seed] = c
            sizes = meta["regimes"][job.regime].get("by_size")
            row["size_runs"][job.seed] = size_curves(Path(res["dir"]), sizes) if sizes else {}
    by_size = {r: _by_size(arms, meta["regimes"][r]["by_size"]) for r, arms in table.items() if meta["regimes"][r].get("by_size")}
    for arms in table.values():
        base = arms.get("grpo", {}).get("runs", {})
        for arm, row in arms.items():
            runs = row["runs"]
            cs = list(runs.values())
            row["seeds"] = sorted(runs)
            row["episodes_to"] = bootstrap([c["episodes_to"] for c in cs], "median")
            row["env_steps_to"] = bootstrap([c["env_steps_to"] for c in cs], "median")
            row["final"] = bootstrap([c["final"] for c in cs if c["final"] is not None], "mean")
            row["auc"] = bootstrap([c["auc"] for c in cs if c["auc"] is not None], "mean")
            row["start"] = mean_of([c["start"] for c in cs])
            row["wall_s"] = mean_of([c["wall_s"] for c in cs])
            if arm != "grpo" and base:
                row.update(_deltas(runs, base))
            if arm in AUX:
                for key in DIAG:
                    k = key.format(aux=AUX[arm])
                    row[k] = mean_of([c.get(k + "/mean") for c in cs])
                row["grad/measured_steps"] = mean_of([c.get("grad/measured_steps") for c in cs])
            for k in (*PROBES, *VAL_LAST):
                row[k] = mean_of([c.get(k + "/last") for c in cs])
            row["forecast/samples_early"] = mean_of([c.get("forecast/samples_early") for c in cs])
            row["zero_signal_groups"] = mean_of([c.get("zero_signal_groups") for c in cs])
            for k, how in STABILITY:
                vals = [c.get(f"{k}/{how}") for c in cs if c.get(f"{k}/{how}") is not None]
                row[f"{k}/{how}"] = (mean_of(vals), (max if how == "max" else min)(vals)) if vals else None
            row["collapsed_validations"] = sum(c.get("collapsed_validations", 0) > 0 for c in cs)
            drops = [c["success_drop"] for c in cs if c.get("success_drop") is not None]
            row["success_drop"] = (mean_of(drops), max(drops)) if drops else None
            rates = [c["invalid_rate"] for c in cs if c.get("invalid_rate") is not None]
            row["invalid_rate"] = mean_of(rates)
            row["collapsed"] = sum(r >= 0.99 for r in rates)  # seeds whose held-out actions are all invalid
    between = {r: _between(arms) for r, arms in table.items() if _between(arms)}
    for arms in table.values():
        for row in arms.values():
            row.pop("size_runs", None)  # summarized in by_size
    gain = {r: stages.sft_gain({a: {s: c["final"] for s, c in row["runs"].items() if c["final"] is not None}
                                for a, row in arms.items()}) for r, arms in table.items()}
    equal = {r: [equal_steps.summarize(arms, key) for key in equal_steps.COSTS] for r, arms in table.items()
             if meta["regimes"][r].get("equal_env_steps")}
    return {"test": table, "tuning": tuning, "by_size": by_size, "between": between, "final": final_eval.summarize(results),
            "sft_gain": {r: g for r, g in gain.items() if g}, "equal_steps": equal,
            "aux_signal": {r: a for r, a in ((r, aux_signal.summarize(arms)) for r, arms in table.items()) if a}}


def _between(arms: dict) -> list[dict]:
    """Each later non-GRPO arm against each earlier one (e.g. CoPE turns vs CoPE list), paired by seed as
    :func:`_deltas`: [{arm, base, delta_auc, delta_auc_t, delta_final, delta_final_t}]."""
    aux = [a for a in arms if a != "grpo"]
    return [{"arm": b, "base": a, **_deltas(arms[b]["runs"], arms[a]["runs"])}
            for i, a in enumerate(aux) for b in aux[i + 1:]]


def plot(summary: dict, meta: dict, out: Path) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    regimes = [r for r in meta["regimes"] if r in summary["test"]]
    if not regimes:
        return
    for name, draw in (("success_vs_episodes.png", _draw_success), ("mechanism.png", _draw_mechanism)):
        fig = Figure(figsize=(4.2 * len(regimes), 3.8), dpi=100)
        FigureCanvasAgg(fig)
        for i, regime in enumerate(regimes):
            ax = fig.add_subplot(1, len(regimes), i + 1)
            draw(ax, summary["test"][regime], meta["regimes"][regime])
            ax.set_title(regime, fontsize=9)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7, loc="best")
        fig.tight_layout()
        fig.savefig(out / name)
    equal_steps.plot(summary, meta, out, COLORS, NAMES)


def _draw_success(ax, arms: dict, info: dict) -> None:
    for arm, row in arms.items():
        curves = [(c["episodes"], c["success"]) for c in row["runs"].values() if len(c["episodes"]) > 1]
        if not curves:
            continue
        grid, mean, lo, hi = mean_band(curves)
        (line,) = ax.plot(grid, mean, "o-", ms=2.5, color=COLORS.get(arm), label=f"{NAMES.get(arm, arm)} (n={len(curves)})")
        ax.fill_between(grid, lo, hi, color=line.get_color(), alpha=0.18, lw=0)
    ax.axhline(info["threshold"], color="gray", ls="--", lw=0.8)
    ax.set(xlabel="episodes", ylabel="held-out success", ylim=(-0.02, 1.02))


def _draw_mechanism(ax, arms: dict, info: dict) -> None:
    for arm, row in arms.items():
        aux = AUX.get(arm)
        if not aux:
            continue
        key = f"grad/cos_{aux}_pg"
        per_step: dict[float, list[float]] = {}
        for c in row["runs"].values():
            for step, v in c.get(key, []):
                per_step.setdefault(step, []).append(v)
        if per_step:
            xs = sorted(per_step)
            ax.plot(xs, [sum(per_step[x]) / len(per_step[x]) for x in xs], lw=1, color=COLORS.get(arm),
                    label=f"cos({aux}, pg), {NAMES[arm]}")
    ax.axhline(0.0, color="gray", lw=0.8)
    ax.set(xlabel="optimizer step", ylabel="gradient cosine (mean over seeds)", ylim=(-1.02, 1.02))


def report(results: list[dict], meta: dict, out: Path) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    summary = summarize(results, meta)
    text = markdown(summary, meta)
    (out / "study.md").write_text(text)
    js = lambda x: None if isinstance(x, float) and (math.isinf(x) or math.isnan(x)) else x  # noqa: E731

    def clean(x):
        if isinstance(x, dict):
            return {str(k): clean(v) for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            return [clean(v) for v in x]
        return js(x)

    (out / "study.json").write_text(json.dumps(clean({"meta": meta, **summary}), indent=1))
    plot(summary, meta, out)
    print(text, flush=True)
    print(f"wrote {out / 'study.md'}, {out / 'study.json'}, {out / 'success_vs_episodes.png'}, {out / 'mechanism.png'}")
    return summary


__all__ = ["report", "run_curve", "summarize"]
