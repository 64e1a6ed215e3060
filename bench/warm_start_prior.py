"""Starting success of the tiny model's warm starts: random walks vs noisy expert walks at several expert_prob.

``model.warm_start_policy=expert`` behaviour-clones walks that take the env's ``expert_action()`` (the
maze's shortest-path move) with probability ``model.warm_start_expert_prob`` per turn, else a random
admissible move (src/cope/models/warm_start.py): a "competent prior" for sample-efficiency runs, in place of
the default random-walk clone (a cold start). Cloning a per-turn mixture does not give a policy that
follows the expert a fraction ``p`` of the time: greedy decoding takes the mixture's argmax, the
expert's move wherever the clone fits well, so the starting success has to be measured.

For each entry of ``--probs`` (a number: ``warm_start_policy=expert`` with that ``warm_start_expert_prob``;
``random``: the default random-walk warm start) this builds the warm start (or loads it from
``--cache-dir``, keyed like training: a study with the same overrides reuses it) with the run config's
model and env (``conf/config.yaml``: ``model=tiny``, ``env=maze``, plus ``--overrides``), then runs
``--tasks`` held-out test tasks (indices 0..N-1; the validation panel is the first 64) through the
DataModule's own rollout engine (cope.rollout.engine.HFEngine, cope.rollout.loop.run_episodes):

* ``greedy``: success at temperature 0, as validation runs it (``val/success``);
* ``sampled``: success at temperature 1 (seed ``--seed``), as training rollouts sample.

* ``val panel``: the greedy success on validation's panel (``data.val_tasks`` test tasks from ``data.val_offset``,
  run as validation runs them, in batches of ``data.val_batch_size``): the ``val/success`` a training run
  from this warm start starts at. The same tasks inside the 256-task batch can end differently (batch
  composition changes fp32 rounding, and a greedy near-tie can flip).

``--build-seeds`` builds each entry with those ``model.seed`` values (the tokenizer, the walks and the init
all change): how much the prior itself varies. It prints a table (build seconds; ``*``: built by an
earlier run, loaded from the cache now) and writes it to ``--out``; rows of an earlier run with the same
``--tasks``, ``--seed`` and ``--overrides`` that this run did not redo are kept there.

Usage: ``OMP_NUM_THREADS=1 python -m bench.warm_start_prior --probs random 0.1 0.25 0.5 [--build-seeds 0 1] [--tasks 256]
[--cache-dir $COPE_CACHE/tiny] [--overrides ...] [--out bench/results/warm_start_prior.json]``
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _episodes(dm, tasks, sampling) -> list:
    """One rollout call over ``tasks`` through the DataModule's engine; the episodes in task order."""
    return dm.engine.rollout(tasks, list(range(len(tasks))), sampling)[0]


def _rate(eps) -> float:
    return round(sum(e.success for e in eps) / len(eps), 4)


def measure(entry: str, build_seed: int, args) -> dict:
    """Build/load the warm start named by ``entry`` (``model.seed=build_seed``) and measure its held-out success."""
    from dataclasses import replace

    from hydra import compose, initialize_config_dir
    from hydra.utils import instantiate

    from cope.envs.base import Task

    prior = [] if entry == "random" else ["model.warm_start_policy=expert", f"model.warm_start_expert_prob={float(entry)}"]
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3", job_name="bench"):
        cfg = compose(config_name="config", overrides=["paths.output_dir=/tmp/cope-bench", f"model.cache_dir={args.cache_dir}",
                                                       f"model.seed={build_seed}", *prior, *args.overrides])
    factory = instantiate(cfg.env)
    cache = Path(os.path.expanduser(args.cache_dir))
    before = set(cache.iterdir()) if cache.exists() else set()
    t0 = time.perf_counter()
    policy = instantiate(cfg.model)(env_factory=factory)
    seconds = time.perf_counter() - t0
    built = bool(set(cache.iterdir()) - before)
    dm = instantiate(cfg.data, env=factory, progress=False)
    dm.connect(policy)
    tasks = [Task(dm.env_name, "test", i) for i in range(args.tasks)]
    try:
        t1 = time.perf_counter()
        greedy = _episodes(dm, tasks, dm.val_sampling)
        sampled = _episodes(dm, tasks, replace(dm.sampling, temperature=1.0, top_p=1.0, seed=args.seed))
        for k, chunk in enumerate(dm.val_dataloader()):  # validation's own path: its panel, its batches
            dm.evaluate(chunk, first=k == 0)
        panel = dm.val_record.episodes if dm.val_record is not None else []
        eval_s = time.perf_counter() - t1
    finally:
        dm.teardown("validate")
    return dict(warm_start=entry, expert_prob=None if entry == "random" else float(entry), build_seed=build_seed,
                greedy=_rate(greedy), sampled=_rate(sampled), greedy_val_panel=_rate(panel) if panel else None,
                val_panel=len(panel), greedy_steps=round(sum(e.num_steps for e in greedy) / len(greedy), 2),
                sampled_steps=round(sum(e.num_steps for e in sampled) / len(sampled), 2),
                built=built, build_seconds=round(seconds, 1) if built else None, eval_seconds=round(eval_s, 1),
                cache=str(policy.source))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--probs", nargs="+", default=["random", "0.1", "0.25", "0.5"],
                    help="warm_start_expert_prob values; 'random' is the default random-walk warm start")
    ap.add_argument("--build-seeds", type=int, nargs="+", default=[0],
                    help="model.seed of each build (the tokenizer, the walks, the init): how much the prior varies")
    ap.add_argument("--tasks", type=int, default=256)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--cache-dir", default=str(Path(os.environ.get("COPE_CACHE", Path.home() / ".cache/cope-trainer")) / "tiny"))
    ap.add_argument("--overrides", nargs="*", default=[])
    ap.add_argument("--out", default=str(REPO / "bench" / "results" / "warm_start_prior.json"))
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")  # the build's progress
    for p in args.probs:
        if p != "random" and not 0.0 <= float(p) <= 1.0:
            ap.error(f"--probs: {p!r} is neither 'random' nor a number in [0, 1]")

    out = Path(args.out)
    meta = dict(tasks=args.tasks, seed=args.seed, overrides=args.overrides)
    todo = [(p, b) for p in args.probs for b in args.build_seeds]
    kept = {}  # rows of an earlier run with the same settings (refining a calibration adds rows)
    if out.exists():
        old = json.loads(out.read_text())
        if {k: old.get(k) for k in meta} == meta:
            kept = {(r["warm_start"], r.get("build_seed", 0)): r for r in old["rows"]}
    rows = []
    for p, b in todo:
        rows.append(measure(p, b, args))
        r = rows[-1]
        prev = kept.pop((p, b), None)
        if not r["built"] and prev and prev.get("build_seconds"):  # loaded from the cache an earlier run built
            r["build_seconds"] = prev["build_seconds"]
        print(f"  {r['warm_start']} (build seed {b}): greedy {r['greedy']:.3f}, sampled {r['sampled']:.3f} "
              f"({'built in %.0f s' % r['build_seconds'] if r['built'] else 'cached'})", flush=True)
        table = sorted([*rows, *kept.values()],
                       key=lambda r: (-1.0 if r["expert_prob"] is None else r["expert_prob"], r["build_seed"]))
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(dict(**meta, rows=table), indent=1))  # after every row: an interruption loses no build
    print(f"\ntiny warm starts, {args.tasks} held-out test tasks of the run config's env "
          f"({os.environ.get('OMP_NUM_THREADS', '?')} OMP threads; overrides: {args.overrides or 'none'})")
    print(f"{'warm start':>12} {'seed':>4} {'greedy':>7} {'sampled':>8} {'val panel':>9} {'greedy steps':>12} "
          f"{'sampled steps':>13} {'build s':>8} {'eval s':>7}")
    for r in table:
        name = r["warm_start"] if r["warm_start"] == "random" else f"expert {r['expert_prob']:g}"
        build = "cached" if r["build_seconds"] is None else f"{r['build_seconds']:.0f}" + ("" if r["built"] else "*")
        panel = "-" if r.get("greedy_val_panel") is None else f"{r['greedy_val_panel']:.3f}"
        print(f"{name:>12} {r['build_seed']:>4} {r['greedy']:>7.3f} {r['sampled']:>8.3f} {panel:>9} {r['greedy_steps']:>12.1f} "
              f"{r['sampled_steps']:>13.1f} {build:>8} {r['eval_seconds']:>7.0f}")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
