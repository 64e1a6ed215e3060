"""Rollout wall time with the policy in the loop: env in-process vs env workers vs workers + overlap.

Where ``env_speed.py`` times env steps alone, this times what the trainer does each epoch: the
DataModule's ``run`` (batched generation with the KV-cached actor, then env steps, turn after turn)
for the same tasks, with the same sampling seed, under three settings, interleaved over ``--rounds``:

* ``in-process``: ``data.env_runtime.workers=0`` (generation, then each env steps in turn);
* ``workers``: ``data.env_runtime.workers=W`` (env steps of all live episodes in parallel);
* ``workers+overlap``: also ``data.env_runtime.chunks=2`` (one half generates while the other half's steps run).

It prints the median rollout seconds and the speed-up over in-process. The policy is the tiny model
(``debug=fast`` by default: a micro model, so generation is cheap and env time dominates, as it does
for slow envs with a large model on a GPU; ``--overrides`` changes that).

Usage: ``python -m bench.rollout_speed --env textworld [--workers 2] [--episodes 16] [--rounds 3]
[--overrides model.warm_start_tasks=16]``
"""
from __future__ import annotations

import argparse
import os
import statistics
import time
from dataclasses import replace
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--env", default="textworld")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--episodes", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--overrides", nargs="*", default=[])
    ap.add_argument("--cache-dir", default=os.environ.get("COPE_CACHE", str(Path.home() / ".cache/cope-trainer")))
    args = ap.parse_args()

    from hydra import compose, initialize_config_dir
    from hydra.utils import instantiate
    from omegaconf import OmegaConf

    from cope.envs.base import Task
    from cope.run.train import instantiate_plain

    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3", job_name="bench"):
        cfg = compose(config_name="config", overrides=["debug=fast", f"env={args.env}", "paths.output_dir=/tmp/cope-bench",
                                                       f"paths.cache_dir={args.cache_dir}", *args.overrides])
    factory = instantiate(cfg.env)
    policy = instantiate_plain(cfg.model)(env_factory=factory)  # as train.py builds it (plain containers: LoraConfig serializes)
    settings = {"in-process": dict(workers=0), "workers": dict(workers=args.workers),  # data.env_runtime.*
                "workers+overlap": dict(workers=args.workers, chunks=2)}
    dms = {}
    for name, kw in settings.items():
        dm = instantiate(OmegaConf.merge(cfg.data, {"env_runtime": kw}), env=factory, progress=False)
        dm.connect(policy)
        dms[name] = dm
    tasks = [Task(dms["in-process"].env_name, "train", i // 4) for i in range(args.episodes)]  # groups of 4
    groups = [i // 4 for i in range(args.episodes)]
    for dm in dms.values():  # warm-up: workers started, games generated, caches filled
        dm.engine.rollout(tasks, groups, replace(dm.sampling, seed=0))
    secs: dict[str, list[float]] = {k: [] for k in dms}
    steps = {}
    try:
        for r in range(args.rounds):
            for name, dm in dms.items():
                t0 = time.perf_counter()  # the same sampling seed for every setting in a round
                eps, stats = dm.engine.rollout(tasks, groups, replace(dm.sampling, seed=r))
                secs[name].append(time.perf_counter() - t0)
                steps[name] = stats.env_steps
    finally:
        for dm in dms.values():
            dm.teardown("fit")
    base = statistics.median(secs["in-process"])
    print(f"rollout seconds, env={args.env}, {args.episodes} episodes, median of {args.rounds} interleaved rounds "
          f"({os.cpu_count()} cores)")
    for name, v in secs.items():
        m = statistics.median(v)
        print(f"{name:<18}{m:8.2f} s   env steps {steps[name]:>5}   speed-up {base / m:5.2f}x")


if __name__ == "__main__":
    main()
