"""Rollout speed of the two engines side by side: ``hf`` (transformers in this process) vs ``vllm`` (a server).

Same policy weights, same tasks, same sampling settings; the engines run round-robin (hf, vllm, hf, ...)
over ``--rounds`` with a fresh sampling seed per round, after one untimed warm-up each. Per engine it
prints the median generated tokens per second of generation time, episodes per second of rollout wall
time, and the ratio vllm/hf; then the adapter sync time of the vLLM engine (``save_pretrained`` plus an
in-place ``/v1/load_lora_adapter``) over ``--syncs`` changed adapters, and the server's start time.

Fair on CPU only with the same cores on both sides: ``OMP_NUM_THREADS`` for hf, ``--threads`` (the
server's ``VLLM_CPU_OMP_THREADS_BIND``) for vllm; the defaults give both the machine's first two cores.

Usage: ``OMP_NUM_THREADS=2 python -m bench.rollout_engines [--env maze webshop] [--episodes 32] [--rounds 3]
[--overrides model.num_layers=2] [--dtype float32]``; needs ``make vllm-venv`` (or ``--python``).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from dataclasses import replace
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def perturb_adapter(policy, seed: int, scale: float = 0.02) -> None:
    """An epoch's worth of change in every LoRA B matrix (what a sync ships)."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in policy.model.named_parameters():
            if "lora_B" in name:
                p.add_(torch.randn(p.shape, generator=gen) * scale)


def bench_env(env: str, args) -> dict:
    from hydra import compose, initialize_config_dir
    from hydra.utils import instantiate

    from cope.envs.base import Task
    from cope.rollout.engine import EnvRuntime, HFEngine, Sampling
    from cope.rollout.vllm.engine import VLLMEngine
    from cope.run.train import instantiate_plain

    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3", job_name="bench"):
        cfg = compose(config_name="config", overrides=[f"env={env}", "paths.output_dir=/tmp/cope-bench",
                                                       f"paths.cache_dir={args.cache_dir}", *args.overrides])
    factory = instantiate(cfg.env)
    policy = instantiate_plain(cfg.model)(env_factory=factory)  # as train.py builds it (plain containers: LoraConfig serializes)
    max_context = int(cfg.data.max_context)
    sampling = Sampling(temperature=1.0, top_p=1.0, max_action_tokens=args.max_action_tokens)
    probe = factory()
    tasks = [Task(probe.name, "train", i // args.group) for i in range(args.episodes)]
    probe.close()
    groups = [i // args.group for i in range(args.episodes)]
    hf = HFEngine(factory, EnvRuntime(), max_context)
    vl = VLLMEngine(factory, EnvRuntime(), max_context, python=args.python, dtype=args.dtype, threads=args.threads,
                    kv_cache_gb=args.kv_cache_gb, server_args=args.server_args, workdir=tempfile.mkdtemp(prefix="cope-bench-vllm-"))
    hf.connect(policy)
    t0 = time.perf_counter()
    vl.connect(policy)
    connect_s = time.perf_counter() - t0
    engines = {"hf": hf, "vllm": vl}
    rows: dict[str, dict[str, list[float]]] = {k: {"tok_s": [], "eps_s": [], "tokens": [], "wall": []} for k in engines}
    try:
        for eng in engines.values():  # warm-up: first-request compilation, caches
            eng.sync(0)
            eng.rollout(tasks, groups, replace(sampling, seed=0))
        for r in range(1, args.rounds + 1):
            for name, eng in engines.items():
                t0 = time.perf_counter()
                eps, st = eng.rollout(tasks, groups, replace(sampling, seed=r))
                wall = time.perf_counter() - t0
                rows[name]["tok_s"].append(st.generated_tokens / max(st.gen_seconds, 1e-9))
                rows[name]["eps_s"].append(len(eps) / wall)
                rows[name]["tokens"].append(st.generated_tokens)
                rows[name]["wall"].append(wall)
        syncs = []
        for v in range(1, args.syncs + 1):
            perturb_adapter(policy, v)
            n = len(vl.sync_seconds)
            vl.sync(v)
            syncs.extend(vl.sync_seconds[n:])
    finally:
        hf.close()
        vl.shutdown()
    med = {k: {m: statistics.median(v[m]) for m in v} for k, v in rows.items()}
    label = f"{env} ({args.label})" if args.label else env
    return {"env": label, "episodes": args.episodes, "rounds": args.rounds, "max_action_tokens": args.max_action_tokens,
            "model": str(policy.source), "dtype": vl.server.dtype, "omp_threads": os.environ.get("OMP_NUM_THREADS"),
            "server_threads": args.threads, "server_args": args.server_args,
            "server_start_s": vl.stats()["server_start_seconds"], "connect_s": connect_s,
            "median": med, "ratio_tokens_per_s": med["vllm"]["tok_s"] / med["hf"]["tok_s"],
            "ratio_episodes_per_s": med["vllm"]["eps_s"] / med["hf"]["eps_s"],
            "adapter_sync_s_median": statistics.median(syncs), "adapter_sync_s_max": max(syncs), "rows": rows}


def render(results: list[dict]) -> str:
    lines = [f"# Rollout engines: hf (in-process) vs vllm (server), {os.cpu_count()} cores", "",
             "| env | engine | tokens/s (gen) | episodes/s (wall) | tokens/round | vllm/hf tokens/s | vllm/hf episodes/s |",
             "|---|---|---|---|---|---|---|"]
    for r in results:
        for name in ("hf", "vllm"):
            m = r["median"][name]
            ratio = (f"{r['ratio_tokens_per_s']:.2f}x", f"{r['ratio_episodes_per_s']:.2f}x") if name == "vllm" else ("", "")
            lines.append(f"| {r['env']} | {name} | {m['tok_s']:.0f} | {m['eps_s']:.2f} | {m['tokens']:.0f} | {ratio[0]} | {ratio[1]} |")
    lines += ["", "| env | adapter sync median (s) | max (s) | server start (s) | connect incl. checks (s) | model | dtype |",
              "|---|---|---|---|---|---|---|"]
    for r in results:
        lines.append(f"| {r['env']} | {r['adapter_sync_s_median']:.3f} | {r['adapter_sync_s_max']:.3f} | "
                     f"{r['server_start_s']:.1f} | {r['connect_s']:.1f} | {Path(r['model']).name} | {r['dtype']} |")
    r0 = results[0]
    lines += ["", f"{r0['episodes']} episodes per round (groups of the same task), medians of {r0['rounds']} interleaved rounds, "
              f"max_action_tokens={r0['max_action_tokens']}, OMP_NUM_THREADS={r0['omp_threads']}, server cores {r0['server_threads']}."]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--env", nargs="+", default=["maze"])
    ap.add_argument("--episodes", type=int, default=32)
    ap.add_argument("--group", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--syncs", type=int, default=5)
    ap.add_argument("--max-action-tokens", type=int, default=16)
    ap.add_argument("--overrides", nargs="*", default=[])
    ap.add_argument("--label", default=None, help="shown after the env name, e.g. the model of --overrides model=...")
    ap.add_argument("--python", default=None, help="vLLM interpreter (default: .venv-vllm/bin/python)")
    ap.add_argument("--dtype", default=None, help="server dtype (default: the trainer's)")
    ap.add_argument("--threads", default="0-1", help="server cores (VLLM_CPU_OMP_THREADS_BIND)")
    ap.add_argument("--kv-cache-gb", type=float, default=2.0)
    ap.add_argument("--server-args", type=str.split, default=[], help="more vLLM server flags in one string: \"--block-size 16\"")
    ap.add_argument("--cache-dir", default=os.environ.get("COPE_CACHE", str(Path.home() / ".cache/cope-trainer")))
    ap.add_argument("--out", default=str(REPO / "bench/results/rollout_engines/rollout_engines.md"))
    args = ap.parse_args()
    results = []
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    for env in args.env:
        results.append(bench_env(env, args))
        print(render(results[-1:]), flush=True)  # each env as soon as it is measured
        out.write_text(render(results))  # and saved: a stopped run keeps the envs it finished
        out.with_suffix(".json").write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
