"""What an arm's auxiliary stage had to train on, read from each run's own metrics (the study's ``baselines`` arms).

An RWML epoch trains only where a triplet's predictions disagree in reward, and a reward a copy of the previous
observation earns teaches no world model (``bench/rwml_calibration.py``); WM-SFT's term is a cross-entropy whose
first and last epochs show whether it moved. So the report prints, per arm and over its seeds:

* the RWML stage (``rwml/stage`` 1): its epochs, the mean prediction reward (``rwml/reward``), the share of triplets
  with a prediction scoring 1 (``rwml/pass_rate``) and, where the run logged it, the copy predictor's reward
  (``rwml/copy_reward``);
* WM-SFT: the observation NLL (``loss/wm``) of the first and the last epoch with samples, each the mean of that
  epoch's steps that had any (``wm/tokens`` > 0).

A run without either stage gives nothing, and an arm without any such run no row.
"""
from __future__ import annotations


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def of_run(rows: list[dict]) -> dict:
    """One run's signal from its metrics rows (``csv/metrics.csv`` as dicts of floats): {} without either stage."""
    out: dict = {}
    stage = [r for r in rows if r.get("rwml/stage") == 1.0]
    if stage:
        out["rwml_epochs"] = len(stage)
        for key in ("reward", "pass_rate", "copy_reward"):
            out[f"rwml_{key}"] = _mean([r[f"rwml/{key}"] for r in stage if r.get(f"rwml/{key}") is not None])
    wm = [r for r in rows if r.get("loss/wm") is not None and r.get("epoch") is not None
          and (r.get("wm/tokens") is None or r["wm/tokens"] > 0)]  # a step without samples logs a loss of 0
    if wm:
        first, last = min(r["epoch"] for r in wm), max(r["epoch"] for r in wm)
        out["wm_nll_first"] = _mean([r["loss/wm"] for r in wm if r["epoch"] == first])
        out["wm_nll_last"] = _mean([r["loss/wm"] for r in wm if r["epoch"] == last])
    return out


KEYS = ("rwml_epochs", "rwml_reward", "rwml_pass_rate", "rwml_copy_reward", "wm_nll_first", "wm_nll_last")


def summarize(arms: dict) -> dict:
    """Per arm of one regime (``{arm: {"runs": {seed: run}}}``, each run holding ``of_run``'s dict at ``"aux"``):
    the mean of each key over the seeds that logged it, and the seeds counted."""
    out = {}
    for arm, row in arms.items():
        runs = [c.get("aux") or {} for c in row["runs"].values()]
        runs = [r for r in runs if r]
        if runs:
            out[arm] = {"seeds": len(runs), **{k: _mean([r[k] for r in runs if r.get(k) is not None]) for k in KEYS}}
    return out


def _f(v: float | None, fmt: str) -> str:
    return "-" if v is None else format(v, fmt)


def lines(summary: dict | None, names: dict[str, str]) -> list[str]:
    """The report's table (nothing without an auxiliary stage in the regime)."""
    if not summary:
        return []
    out = ["", "What the auxiliary stages had to train on (each run's own metrics, mean over seeds; RWML: its stage's "
           "epochs, a prediction's mean reward, the share of triplets with a prediction scoring 1, and what repeating "
           "the previous observation scores where the run logged it; WM-SFT: the observation NLL of the first and the "
           "last epoch):", "",
           "| arm | seeds | RWML epochs | RWML reward | RWML pass rate | copy's reward | WM NLL first | WM NLL last |",
           "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for arm, s in summary.items():
        out.append(f"| {names.get(arm, arm)} | {s['seeds']} | {_f(s['rwml_epochs'], '.0f')} | {_f(s['rwml_reward'], '.3f')} "
                   f"| {_f(s['rwml_pass_rate'], '.3f')} | {_f(s['rwml_copy_reward'], '.3f')} | "
                   f"{_f(s['wm_nll_first'], '.3f')} | {_f(s['wm_nll_last'], '.3f')} |")
    return out
