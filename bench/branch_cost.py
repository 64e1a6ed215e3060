"""Branched rollouts against the flat group at equal leaves: env steps, generated tokens and wall time per leaf.

For the same tasks (the epoch's task stream of one seed), each setting collects one epoch through the DataModule's
collector: ``flat`` (the default collector, G independent episodes per task) and ``branching`` with each of
``--roots`` (``+collector=branching``: G leaves grown from that many roots, ``--trigger``). Settings are interleaved
over ``--rounds`` (seeds 0..rounds-1) and the medians are printed, with each branching setting's ratio to flat. The
policy is the tiny model (``debug=fast``: a micro model; ``--overrides`` changes it, e.g. ``model=smollm2-135m
experiment=smollm2_maze``); the env is ``--env`` (an env that forks: the maze, TextWorld).

What it measures is the collection's cost, not learning: a random or barely trained policy runs its episodes to the
step budget, where a trained one ends earlier, so the savings of a trained policy may differ.

Usage: ``python -m bench.branch_cost [--env maze] [--group-size 8] [--tasks 8] [--roots 2 4 6] [--rounds 3]
[--out bench/results/branch_cost/maze.md]``
"""
from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _collect(cfg, factory, policy, seed: int, collector: dict | None) -> dict[str, float]:
    from hydra.utils import instantiate
    from omegaconf import OmegaConf

    data = OmegaConf.merge(cfg.data, {"seed": seed, "val_tasks": 1, "progress": False})
    if collector is not None:
        data = OmegaConf.merge(data, {"collector": collector})
    dm = instantiate(data, env=factory)
    dm.connect(policy)
    try:
        t0 = time.perf_counter()
        rec = dm.collect_epoch(0)
        seconds = time.perf_counter() - t0
    finally:
        dm.teardown("fit")
    leaves = len(rec.episodes)
    m = rec.metrics
    return {"env_steps": m["counters/env_steps"] / leaves, "tokens": m["counters/generated_tokens"] / leaves,
            "seconds": seconds / leaves, "leaves": leaves}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--env", default="maze")
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--tasks", type=int, default=8)
    ap.add_argument("--roots", type=int, nargs="+", default=[2, 4, 6])
    ap.add_argument("--trigger", default="uniform")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--overrides", nargs="*", default=[])
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--cache-dir", default=os.environ.get("COPE_CACHE", str(Path.home() / ".cache/cope-trainer")))
    args = ap.parse_args(argv)

    from hydra import compose, initialize_config_dir
    from hydra.utils import instantiate

    from cope.run.train import instantiate_plain

    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3", job_name="bench"):
        cfg = compose(config_name="config", overrides=[
            "debug=fast", f"env={args.env}", "paths.output_dir=/tmp/cope-bench", f"paths.cache_dir={args.cache_dir}",
            f"data.group_size={args.group_size}", f"data.tasks_per_epoch={args.tasks}", "+collector=branching",
            f"branch.trigger={args.trigger}", *args.overrides])
    branching = dict(cfg.data.collector)
    cfg.data.collector = None  # flat: the default collector
    factory = instantiate(cfg.env)
    policy = instantiate_plain(cfg.model)(env_factory=factory)
    settings = {"flat": None, **{f"branching roots={r}": {**branching, "roots": r} for r in args.roots}}
    runs: dict[str, list[dict]] = {name: [] for name in settings}
    for seed in range(args.rounds):  # interleaved: every setting once per round
        for name, collector in settings.items():
            runs[name].append(_collect(cfg, factory, policy, seed, collector))
    med = {name: {k: statistics.median(r[k] for r in rs) for k in ("env_steps", "tokens", "seconds")}
           for name, rs in runs.items()}
    flat = med["flat"]
    lines = [f"# Branched rollouts vs flat at equal leaves: env={args.env}, G={args.group_size}, {args.tasks} tasks, "
             f"trigger={args.trigger}, {args.rounds} rounds (medians per leaf)", "",
             "| setting | env steps / leaf | tokens / leaf | seconds / leaf | env steps vs flat | tokens vs flat | time vs flat |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for name, m in med.items():
        ratio = [m[k] / flat[k] if flat[k] else float("nan") for k in ("env_steps", "tokens", "seconds")]
        lines.append(f"| {name} | {m['env_steps']:.2f} | {m['tokens']:.1f} | {m['seconds']:.4f} | "
                     f"{ratio[0]:.2f}x | {ratio[1]:.2f}x | {ratio[2]:.2f}x |")
    lines += ["", f"overrides: {' '.join(args.overrides) or '(none)'}; policy: {cfg.model._target_}"]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)


if __name__ == "__main__":
    main()
