"""Arms that start from another run's adapter: GRPO on an SFT'd model (ECHO's comparison), or on an RWML run's.

An arm listed in :data:`PREREQUISITES` trains from the adapter of a run of its own kind made first, per seed: the
*prerequisite* run (phase ``pre``, folder ``<out>/<regime>/pre/<algo>/<label>/seed<s>``) gets the regime's overrides,
panels and the prerequisite's own overrides (its budget last, so it wins), and the arm's test run gets
``model.adapter=<that run>/csv/adapter`` (the adapter export's folder). The path is written relative to the
repository when the run folder is inside it (the launcher's working directory), so a job's overrides, and with them its
committed record (:mod:`bench.study.records`), do not name the machine.

A record keeps no adapter: a prerequisite whose adapter is gone (a fresh checkout) while a run that starts from it has
not finished is trained again (training is deterministic given the command: the same adapter).

The ECHO paper's comparison (arXiv 2605.24517): GRPO on the base, ECHO on the base, GRPO on an SFT'd model;
the share of the SFT gain ECHO recovers is (ECHO - GRPO) / (GRPO on SFT - GRPO), per seed (:func:`sft_gain`).
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path

from bench.study import stats
from bench.study.runs import finished, run_state, train_one

REPO = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class Prerequisite:
    """The run an arm starts from: its ``algo``, a label for its folder, and its overrides (budget included)."""

    algo: str
    label: str
    overrides: tuple[str, ...]
    smoke: tuple[str, ...] = ("trainer.max_epochs=1", "data.tasks_per_epoch=4", "data.minibatch_size=4")


# Behaviour cloning of the env's expert (algo=sft: demonstrations by the env's expert_action, the action tokens'
# cross-entropy), 4 epochs of 32 demonstrations: the "expert SFT" ECHO's paper compares against.
PREREQUISITES: dict[str, Prerequisite] = {
    "grpo_sft": Prerequisite("sft", "expert", ("sft.source=expert", "trainer.max_epochs=4", "data.tasks_per_epoch=32",
                                               "data.minibatch_size=8")),
}


def _adapter_override(run: Path) -> str:
    path = run / "csv/adapter"
    try:
        path = path.relative_to(REPO)
    except ValueError:
        pass
    return f"model.adapter={path}"


def prerequisites(tests: list, make_job, regime_overrides, smoke: bool) -> list:
    """The prerequisite jobs of ``tests``: one per regime, arm that needs one and seed.

    Args:
        tests: the launcher's test jobs (:class:`bench.study.launch.Job`).
        make_job: ``make_job(regime, phase, arm, setting, seed, overrides)`` -> a Job.
        regime_overrides: ``regime_overrides(regime)`` -> what every run of that regime gets (budget, panel, overrides).
        smoke: the launcher's ``--smoke`` (a prerequisite's miniature budget).
    """
    pre = {}
    for job in tests:
        need = PREREQUISITES.get(job.arm)
        if need is not None and (job.regime, need.algo, job.seed) not in pre:
            ov = (*regime_overrides(job.regime), *need.overrides, *(need.smoke if smoke else ()))
            pre[(job.regime, need.algo, job.seed)] = make_job(job.regime, "pre", need.algo, need.label, job.seed, ov)
    return list(pre.values())


def with_adapters(tests: list, pre: list, out_dir: Path) -> list:
    """``tests`` with ``model.adapter=<its prerequisite's adapter>`` on the jobs of an arm that has one."""
    by_key = {(j.regime, j.seed, j.arm): j for j in pre}
    jobs = []
    for job in tests:
        need = PREREQUISITES.get(job.arm)
        p = by_key.get((job.regime, job.seed, need.algo)) if need else None
        jobs.append(job if p is None else dataclasses.replace(job, overrides=(*job.overrides, _adapter_override(p.dir(out_dir)))))
    return jobs


def run_prerequisites(pre: list, tests: list, out_dir: Path, threads: int) -> list[dict]:
    """Trains the prerequisite runs one after another (each a few minutes), reusing a finished one whose adapter is
    there; one whose adapter is gone is trained again while a run that starts from it is unfinished. A prerequisite
    that no unfinished run starts from (its runs finished, or restored from their records) is not trained."""
    results = []
    waiting = {(j.regime, PREREQUISITES[j.arm].algo, j.seed) for j in tests
               if j.arm in PREREQUISITES and not finished(j.dir(out_dir))}
    for i, job in enumerate(pre):
        d = job.dir(out_dir)
        needed = (job.regime, job.arm, job.seed) in waiting
        if not needed and not finished(d):
            print(f"[pre {i + 1}/{len(pre)}] {job.regime} {job.arm} {job.setting} seed {job.seed}: not needed (every run "
                  f"that starts from it is finished)", flush=True)
            results.append({"algo": job.arm, "seed": job.seed, "dir": str(d), "rc": 0, "skipped": True, "wall_s": 0.0,
                            "job": job})
            continue
        force = finished(d) and not (d / "csv/adapter").exists() and needed
        r = train_one(job.arm, job.seed, d, list(job.overrides), threads, force=force, resume=True)
        print(f"[pre {i + 1}/{len(pre)}] {job.regime} {job.arm} {job.setting} seed {job.seed}: {r['wall_s']:.0f} s "
              f"({run_state(r)})", flush=True)
        results.append({**r, "job": job})
    return results


def sft_gain(final: dict[str, dict[int, float]]) -> dict | None:
    """ECHO's "share of the SFT gain recovered", per seed and its mean: (ECHO - GRPO) / (GRPO on SFT - GRPO), from
    each arm's final held-out success by seed (``final[arm][seed]``); None without the three arms on a common seed.
    A seed whose SFT gain is 0 has no share (left out, counted). ``pooled``: the ratio of the mean gains over the
    common seeds with its bootstrap interval (:func:`bench.study.stats.paired_ratio`), None where the mean SFT gain
    is 0: the number to read at few seeds, where one seed's small gain makes its own share large."""
    arms = ("grpo", "echo", "grpo_sft")
    if not all(a in final for a in arms):
        return None
    seeds = sorted(set.intersection(*(set(final[a]) for a in arms)))
    shares, flat = {}, 0
    for s in seeds:
        gain = final["grpo_sft"][s] - final["grpo"][s]
        if gain == 0:
            flat += 1
            continue
        shares[s] = (final["echo"][s] - final["grpo"][s]) / gain
    pooled = None
    if seeds:
        point, lo, hi, _ = stats.paired_ratio(final["echo"], final["grpo_sft"], final["grpo"])
        pooled = None if math.isnan(point) else [point, lo, hi]
    mean = sum(shares.values()) / len(shares) if shares else None
    return {"seeds": seeds, "shares": shares, "mean": mean, "no_gain_seeds": flat, "pooled": pooled}
