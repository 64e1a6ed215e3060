"""Env steps per second: the raw package vs our adapter vs our adapter in the worker pool, side by side.

For each env it first records one batch of episodes with a seeded random policy (an admissible action,
or one of ``example_actions()`` where the env lists none), untimed. Then, interleaved for ``--rounds``
rounds, it replays exactly those actions through:

* ``raw``: the env's own package, called the way its README calls it (functions in ``bench/env_raw.py``;
  absent for envs that are ours, such as the maze, the WebShop-compatible shop or the terminal tasks);
* ``adapter``: our env class, in this process, instances stepped one after another (what
  ``data.env_runtime.workers=0`` does);
* ``pool W``: our env in ``EnvWorkerPool`` with W worker processes, all live episodes' steps submitted
  together (what ``data.env_runtime.workers=W`` does).

Timers cover resets and steps only (instances are created and warmed up before). It prints steps/s
(median over rounds) and the ratios ``adapter / raw`` (our overhead; goal >= 0.9) and
``pool 2 / pool 1`` (goal > 1). Env packages must be installed (extras); envs whose package is
missing are skipped with the reason.

Usage: ``python -m bench.env_speed [--envs maze textworld scienceworld alfworld webshop terminal]
[--episodes 4] [--steps 10] [--rounds 3] [--workers 1 2] [--out bench/results/env_speed]``
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import time
from pathlib import Path

from bench.env_raw import RAW, RAW_NOTES

REPO = Path(__file__).resolve().parents[1]

ENV_OVERRIDES = {  # small, fast settings per env for the benchmark (each still the real engine)
    "alfworld": ["env.source=generated"],
}


def env_factory(name: str, cache_dir: str, extra: list[str]):
    from hydra import compose, initialize_config_dir
    from hydra.utils import instantiate

    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3", job_name="bench"):
        cfg = compose(config_name="config", overrides=[f"env={name}", "paths.output_dir=/tmp/cope-bench",
                                                       f"paths.cache_dir={cache_dir}", *ENV_OVERRIDES.get(name, []), *extra])
    return instantiate(cfg.env), cfg.env


def record(factory, episodes: int, steps: int, seed: int):
    """Tasks and the action lists of a seeded random walk (untimed)."""
    from cope.envs.base import Task

    rng = random.Random(seed)
    env = factory()
    tasks = [Task(env.name, "train", i) for i in range(episodes)]
    plans = []
    for t in tasks:
        r = env.reset(t)
        acts = []
        for _ in range(steps):
            options = r.admissible_actions or (env.example_actions() if hasattr(env, "example_actions") else None)
            if not options:
                break
            a = rng.choice(sorted(options))
            acts.append(a)
            r = env.step(a)
            if r.done:
                break
        plans.append(acts)
    env.close()
    return tasks, plans


def replay(batch, tasks, plans) -> tuple[int, float]:
    """Lock-step replay through an env batch (InProcessEnvs or EnvWorkerPool); (steps, seconds)."""
    t0 = time.perf_counter()
    firsts = batch.reset(list(enumerate(tasks)))
    bad = [r for r in firsts if isinstance(r, BaseException)]
    if bad:
        raise RuntimeError(f"reset failed: {bad[0]!r}")
    n, turn = 0, 0
    while True:
        items = [(i, p[turn]) for i, p in enumerate(plans) if turn < len(p)]
        if not items:
            break
        res = batch.submit(items).results()
        bad = [r for r in res if isinstance(r, BaseException)]
        if bad:
            raise RuntimeError(f"step failed: {bad[0]!r}")
        n += len(items)
        turn += 1
    return n, time.perf_counter() - t0


def bench_env(name: str, args) -> dict:
    from cope.envs.runtime.batch import InProcessEnvs
    from cope.envs.runtime.pool import EnvWorkerPool

    factory, env_cfg = env_factory(name, args.cache_dir, args.override)
    tasks, plans = record(factory, args.episodes, args.steps, args.seed)
    variants = {}
    if name in RAW:
        raw = RAW[name](env_cfg, tasks)  # a callable replaying plans, (steps, seconds)
        variants["raw"] = lambda: raw(plans)
    local = InProcessEnvs(factory)
    local.ensure(len(tasks))
    replay(local, tasks, plans)  # warm-up: engines started, games compiled/cached
    variants["adapter"] = lambda: replay(local, tasks, plans)
    pools = {}
    for w in args.workers:
        pools[w] = EnvWorkerPool(factory, w, step_timeout_s=300, reset_timeout_s=600)
        pools[w].ensure(len(tasks))
        replay(pools[w], tasks, plans)
        variants[f"pool {w}"] = (lambda p: (lambda: replay(p, tasks, plans)))(pools[w])
    times: dict[str, list[float]] = {k: [] for k in variants}
    steps = {}
    try:
        for _ in range(args.rounds):
            for k, fn in variants.items():
                n, sec = fn()
                steps[k] = n
                times[k].append(n / sec)
    finally:
        local.close()
        for p in pools.values():
            p.close()
    med = {k: statistics.median(v) for k, v in times.items()}
    out = {"steps_per_round": steps, "steps_per_s": med, "all": times}
    if "raw" in med:
        out["adapter_over_raw"] = med["adapter"] / med["raw"]
    if len(args.workers) >= 2:
        a, b = sorted(args.workers)[:2]
        out[f"pool{b}_over_pool{a}"] = med[f"pool {b}"] / med[f"pool {a}"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--envs", nargs="+", default=["maze", "textworld", "scienceworld", "alfworld", "webshop", "terminal"])
    ap.add_argument("--episodes", type=int, default=4)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--cache-dir", default=os.environ.get("COPE_CACHE", str(Path.home() / ".cache/cope-trainer")))
    ap.add_argument("--override", nargs="*", default=[], help="extra Hydra overrides for every env")
    ap.add_argument("--out", default=None, help="folder for env_speed.json / env_speed.md")
    args = ap.parse_args()

    results, lines = {}, []
    head = f"{'env':<14}{'raw':>10}{'adapter':>10}" + "".join(f"{'pool ' + str(w):>10}" for w in args.workers)
    head += f"{'adapter/raw':>13}{'pool ratio':>12}"
    lines += [f"env steps/s, median of {args.rounds} interleaved rounds, {args.episodes} episodes x <= {args.steps} steps "
              f"({platform.processor() or platform.machine()}, {os.cpu_count()} cores)", head]
    print("\n".join(lines), flush=True)
    for name in args.envs:
        try:
            r = bench_env(name, args)
        except ImportError as e:
            lines.append(f"{name:<14}skipped: {e}")
            print(lines[-1], flush=True)
            continue
        except Exception as e:  # noqa: BLE001 - one broken env must not hide the others' numbers
            lines.append(f"{name:<14}failed: {e!r}"[:300])
            print(lines[-1], flush=True)
            continue
        results[name] = r
        m = r["steps_per_s"]
        cell = lambda k, m=m: f"{m[k]:>10.1f}" if k in m else f"{'-':>10}"  # noqa: E731
        ratio = next((v for k, v in r.items() if k.startswith("pool") and k.endswith(tuple("0123456789"))), None)
        lines.append(f"{name:<14}{cell('raw')}{cell('adapter')}" + "".join(cell(f"pool {w}") for w in args.workers)
                     + (f"{r['adapter_over_raw']:>13.2f}" if "adapter_over_raw" in r else f"{'-':>13}")
                     + (f"{ratio:>12.2f}" if ratio else f"{'-':>12}"))
        print(lines[-1], flush=True)
    lines.append("raw = " + "; ".join(f"{k}: {v}" for k, v in RAW_NOTES.items()))
    print(lines[-1])
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "env_speed.json").write_text(json.dumps({"args": vars(args), "results": results}, indent=1))
        (out / "env_speed.md").write_text("```\n" + "\n".join(lines) + "\n```\n")


if __name__ == "__main__":
    main()
