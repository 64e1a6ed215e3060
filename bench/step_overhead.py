"""Seconds per optimizer step of GRPO, CoPE's continuation reading (packed / plain), ECHO and both on identical rollouts.

What it measures: the cost of one full training step (forward, ``cope.train.objectives.combine``, backward,
gradient clipping as the trainer config does it, AdamW step, zero_grad) for each algorithm, on
minibatches built from ONE stored batch of on-policy episodes. Rollout collection and the scoring
pass are outside the timer; so is the host-to-device copy (the batches are moved once up front).
The variants differ only in what the algorithm adds to the batch and the loss:

* GRPO: ``collate`` + PolicyGradient (the baseline; ratios are relative to it).
* CoPE (packed): ``algo=cope_continuation``, + forecast chunks of the successful episodes appended in the same
  rows (each row a prefix tree: the chunks are branches of the transcript).
* CoPE (plain): + one extra row per forecast chunk (the reference layout).
* ECHO: + ObservationLoss on the same rows (no extra tokens).
* CoPE+ECHO: packed CoPE (continuation) and ECHO together.

(The authors' CoPE, ``algo=cope``, trains its forecast samples in steps of their own after the policy steps; its
cost per epoch is not measured here yet.)

Each variant starts from the same LoRA weights (a copy taken before anything runs) and owns its
optimizer and its weights afterwards (its weights are swapped in before each of its steps, outside
the timer). Variants are interleaved round-robin (A B C D E A B C ...) so that drift (thermal, other
processes) hits them alike; ``--warmup`` rounds are discarded.

How to read it: ``x / GRPO`` is the per-step cost of the extra targets at this batch shape. CoPE's
overhead grows with the number of successful episodes (only they give forecast chunks), so the
number of forecast chunks is printed next to the ratio. Memory is the peak over the step start:
on CUDA from ``torch.cuda.max_memory_allocated``; on CPU a sampled RSS delta (every 5 ms, after
``malloc_trim`` so that freed heap is not silently reused), which is approximate.

Usage: ``python -m bench.step_overhead [--model-overrides debug=fast] [--episodes 32] [--steps 10]``.
"""
from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import math
import os
import platform
import random
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import replace
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
VARIANTS = {  # name: (algo config, forecast layout)
    "GRPO": ("grpo", None),
    "CoPE (packed)": ("cope_continuation", "packed"),
    "CoPE (plain)": ("cope_continuation", "plain"),
    "ECHO": ("echo", None),
    "CoPE+ECHO": ("cope_continuation_echo", "packed"),
}


class RssPeak:
    """Peak process RSS since ``reset()``, sampled by a daemon thread every ``interval`` seconds."""

    def __init__(self, interval: float = 0.005):
        import psutil

        self._proc, self.interval = psutil.Process(), interval
        self.base = self.peak = self._proc.memory_info().rss
        threading.Thread(target=self._loop, daemon=True).start()

    def _loop(self) -> None:
        while True:
            self.peak = max(self.peak, self._proc.memory_info().rss)
            time.sleep(self.interval)

    def reset(self) -> None:
        self.base = self.peak = self._proc.memory_info().rss

    def delta(self) -> int:
        self.peak = max(self.peak, self._proc.memory_info().rss)
        return self.peak - self.base


def _malloc_trim() -> None:
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: the RSS delta is then even rougher
        pass


class StepMeter:
    """Seconds and peak memory of one step: CUDA's peak allocated over the step start, or the CPU's
    sampled RSS delta (after ``malloc_trim``). ``start()`` before the step, ``stop() -> (s, bytes)`` after."""

    def __init__(self, cuda: bool):
        self.cuda, self.rss = cuda, None if cuda else RssPeak()

    def start(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.base = torch.cuda.memory_allocated()
        else:
            _malloc_trim()
            self.rss.reset()
        self.t0 = time.perf_counter()

    def stop(self) -> tuple[float, int]:
        if self.cuda:
            torch.cuda.synchronize()
        dt = time.perf_counter() - self.t0
        return dt, (torch.cuda.max_memory_allocated() - self.base) if self.cuda else self.rss.delta()


def collect(dm, policy, n: int, min_success: int, max_batches: int, seed: int):
    """``n`` episodes from the current policy, with at least ``min_success`` successes if possible."""
    from cope.envs.base import Task
    from cope.train.advantages import group_advantages

    rng, succ, fail, G = random.Random(seed), [], [], dm.group_size
    for b in range(max_batches):
        tasks, groups = [], []
        for g in range(math.ceil(n / G)):
            tasks += [Task(dm.env_name, "train", rng.randrange(dm.num_train_tasks))] * G
            groups += [b * 100_000 + g] * G  # group ids stay distinct across batches
        eps, _ = dm.engine.rollout(tasks[:n], groups[:n], replace(dm.sampling, temperature=1.0, seed=rng.randrange(2**31)))
        succ += [e for e in eps if e.success]
        fail += [e for e in eps if not e.success]
        print(f"rollout batch {b}: {sum(e.success for e in eps)}/{len(eps)} succeeded", flush=True)
        if len(succ) >= min_success:
            break
    else:
        print(f"WARNING: only {len(succ)} successes after {max_batches} batches (< --min-success {min_success})")
    eps = succ[:n] + fail[: n - min(n, len(succ))]
    random.Random(seed).shuffle(eps)  # one fixed order, shared by every variant
    adv, _ = group_advantages(torch.tensor([e.reward for e in eps]), torch.tensor([e.group for e in eps]),
                              mode=dm.advantage_mode, valid=torch.tensor([not e.aborted for e in eps]))
    for e, a in zip(eps, adv.tolist()):
        e.advantage = a
    print(f"stored batch: {len(eps)} episodes, {sum(e.success for e in eps)} succeeded", flush=True)
    return eps


def minibatches(eps, size: int, layout: str | None, K: int, chat, pad_id: int) -> tuple[list[dict], int]:
    """collate + the variant's collate transform, per minibatch; returns (minibatches, forecast chunks)."""
    from cope.algos.cope.chunks import build_chunks
    from cope.algos.cope.packing import PACKINGS
    from cope.batch import collate

    out, n_chunks = [], 0
    for s in range(0, len(eps), size):
        idx = list(range(s, min(s + size, len(eps))))
        mb = collate([eps[i] for i in idx], pad_id, indices=idx)
        if layout is not None:
            chunks, m = build_chunks([eps[i] for i in idx], chat, K=K, indices=idx)
            n_chunks += int(m["forecast/targets"])
            mb = PACKINGS[layout](mb, eps, chunks, pad_id)
        out.append(mb)
    return out, n_chunks


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model-overrides", nargs="*", default=["model=tiny"], help="hydra overrides for model/env/data, e.g. debug=fast")
    p.add_argument("--episodes", type=int, default=32, help="episodes in the stored batch")
    p.add_argument("--min-success", type=int, default=4, help="sample more batches until this many episodes succeeded")
    p.add_argument("--max-batches", type=int, default=20, help="give up looking for successes after this many batches")
    p.add_argument("--minibatch-size", type=int, default=None, help="episodes per optimizer step; None = data.minibatch_size")
    p.add_argument("--K", type=int, default=3, help="CoPE actions per forecast chunk")
    p.add_argument("--steps", type=int, default=10, help="timed steps per variant")
    p.add_argument("--warmup", type=int, default=2, help="untimed rounds first")
    p.add_argument("--variants", nargs="*", default=list(VARIANTS), choices=list(VARIANTS))
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=REPO / "bench/results/step_overhead.md")
    args = p.parse_args(argv)
    if "GRPO" not in args.variants:
        p.error("--variants must include GRPO (the baseline of the ratios)")

    from hydra import compose, initialize_config_dir
    from hydra.utils import instantiate

    from cope.run.train import instantiate_plain
    from cope.train.module import AgentRLModule
    from cope.train.objectives import combine

    torch.manual_seed(args.seed)
    device = torch.device(args.device)
    tmp = tempfile.mkdtemp(prefix="step_overhead_")
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        cfgs = {a: compose("config", overrides=[*args.model_overrides, f"algo={a}", f"paths.output_dir={tmp}", f"seed={args.seed}"])
                for a in {VARIANTS[v][0] for v in args.variants}}
    cfg = cfgs["grpo"]
    env_factory = instantiate(cfg.env)
    dm = instantiate(cfg.data, env=env_factory, progress=False)
    policy = instantiate_plain(cfg.model)(env_factory=env_factory)  # as train.py builds it (plain containers: LoraConfig serializes)
    dm.connect(policy)
    policy.model.to(device)
    eps = collect(dm, policy, args.episodes, args.min_success, args.max_batches, args.seed)

    params = dict((n, q) for n, q in policy.model.named_parameters() if q.requires_grad)
    snapshot = lambda: {n: q.detach().clone() for n, q in params.items()}  # noqa: E731
    init = snapshot()

    def load(state: dict) -> None:
        with torch.no_grad():
            for n, q in params.items():
                q.copy_(state[n])

    clip = cfg.module.get("gradient_clip_val")
    bf16 = str(cfg.trainer.get("precision", "32-true")).startswith("bf16-mixed")  # as the trainer would run it
    amp = lambda: torch.autocast(device.type, dtype=torch.bfloat16) if bf16 else contextlib.nullcontext()  # noqa: E731
    size = args.minibatch_size or int(cfg.data.minibatch_size)
    runs = {}
    for name in args.variants:
        algo, layout = VARIANTS[name]
        objectives = [instantiate(node) for node in cfgs[algo].algo.objectives.values() if node is not None]
        module = AgentRLModule(policy, objectives, optimizer=instantiate(cfg.module.optimizer)).to(device)
        mbs, n_chunks = minibatches(eps, size, layout, args.K, policy.chat, dm.pad_id)
        load(init)
        module.score_minibatches(mbs)  # old log-probs from the shared initial weights
        runs[name] = dict(module=module, opt=module.optimizer_factory(list(params.values())), state=snapshot(),
                          mbs=[{k: v.to(device) for k, v in mb.items()} for mb in mbs], times=[], mem=[],
                          rows=sum(mb["input_ids"].shape[0] for mb in mbs), cols=max(mb["input_ids"].shape[1] for mb in mbs),
                          cells=sum(mb["input_ids"].numel() for mb in mbs), chunks=n_chunks,
                          real=sum(int(mb["attention_mask"].ne(0).sum()) for mb in mbs))

    meter = StepMeter(device.type == "cuda")
    policy.model.train()
    for r in range(args.warmup + args.steps):
        for v in runs.values():
            load(v["state"])
            batch = v["mbs"][r % len(v["mbs"])]
            meter.start()
            with amp():
                out = v["module"](batch)
                total, _ = combine(v["module"].objectives, out, batch, r)
            total.backward()
            if clip:
                torch.nn.utils.clip_grad_norm_(params.values(), float(clip))
            v["opt"].step()
            v["opt"].zero_grad(set_to_none=True)
            dt, mem = meter.stop()
            v["state"] = snapshot()
            if r >= args.warmup:
                v["times"].append(dt)
                v["mem"].append(mem)
        print(f"round {r + 1}/{args.warmup + args.steps}" + (" (warmup)" if r < args.warmup else ""), flush=True)

    base_t = statistics.mean(runs["GRPO"]["times"])
    mem_label = "peak allocated over step start, MiB (CUDA)" if meter.cuda else "peak RSS delta, MiB (CPU, approximate)"
    results = {}
    for name, v in runs.items():
        m = statistics.mean(v["times"])
        results[name] = dict(mean_s=m, std_s=statistics.stdev(v["times"]) if len(v["times"]) > 1 else 0.0, ratio=m / base_t,
                             rows=v["rows"], cols=v["cols"], cells=v["cells"], forecast_chunks=v["chunks"],
                             padding_per_real_token=(v["cells"] - v["real"]) / max(v["real"], 1),
                             peak_mem_mib=max(v["mem"]) / 2**20, times_s=v["times"])
    n_succ = sum(e.success for e in eps)
    head = (f"device {device} ({platform.processor() or platform.machine()}, torch {torch.__version__}, "
            f"{torch.get_num_threads()} threads{', bf16 autocast' if bf16 else ''}), "
            f"overrides {' '.join(args.model_overrides)}; {len(eps)} episodes "
            f"({n_succ} succeeded) in {math.ceil(len(eps) / size)} minibatch(es) of <= {size}; K={args.K}; "
            f"{args.steps} timed steps per variant after {args.warmup} warmup rounds, interleaved round-robin")
    lines = [head, "", "| variant | s/step (mean) | std | vs GRPO | sequences | columns | cells | padded cells per real token "
             f"| forecast chunks | {mem_label} |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for name, r_ in results.items():
        lines.append(f"| {name} | {r_['mean_s']:.4f} | {r_['std_s']:.4f} | {r_['ratio']:.2f} | {r_['rows']} | {r_['cols']} | "
                     f"{r_['cells']} | {r_['padding_per_real_token']:.2f} | {r_['forecast_chunks']} | {r_['peak_mem_mib']:.1f} |")
    ratio = lambda k: f"{results[k]['ratio']:.2f}" if k in results else "n/a"  # noqa: E731
    summary = f"CoPE packed / GRPO = {ratio('CoPE (packed)')}, CoPE plain / GRPO = {ratio('CoPE (plain)')}, ECHO / GRPO = {ratio('ECHO')}"
    if "CoPE+ECHO" in results:
        summary += f", CoPE+ECHO / GRPO = {ratio('CoPE+ECHO')}"
    if not any(r_["forecast_chunks"] for r_ in results.values()):
        lines += ["", "NOTE: no forecast chunks (no successful episode): the CoPE rows time GRPO plus an empty forecast loss."]
    text = "\n".join([*lines, "", summary, ""])
    print("\n" + text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    report = dict(device=str(device), torch=torch.__version__, argv=sys.argv[1:] if argv is None else argv, episodes=len(eps),
                  successes=n_succ, minibatch_size=size, K=args.K, steps=args.steps, warmup=args.warmup,
                  memory=mem_label, variants=results, summary=summary, threads=torch.get_num_threads(),
                  omp_num_threads=os.environ.get("OMP_NUM_THREADS"))
    args.out.with_suffix(".json").write_text(json.dumps(report, indent=1))
    print(f"wrote {args.out} and {args.out.with_suffix('.json')}")
    return report


if __name__ == "__main__":
    main()
