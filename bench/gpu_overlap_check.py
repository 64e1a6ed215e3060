"""GPU check: overlapped rollouts (``data.max_lag=1``) against synchronous ones, the vLLM server and training on one GPU.

What it runs: ``bench.overlap_speed``'s runs on a CUDA machine, lag 0 then lag 1 (``--lags``), each a real
``python train.py`` with ``trainer=gpu`` (bf16 mixed precision), ``rollout=vllm`` with a managed vLLM server on the
**same GPU** as the trainer (the lent machine has one H200: ``data.engine.gpu_memory_utilization`` 0.3 leaves the rest
to training; on a node with two GPUs, attach a server on the other one with ``data.engine.url``, docs/vllm.md),
``data.engine.max_loras=2`` (a lagged collection's adapter and the newest one served at once),
``--enforce-eager`` (no CUDA-graph capture: the server starts in seconds, not minutes).

The run (:data:`SIZES`): the maze, 64 episodes (8 tasks x 8) of up to 20 turns an epoch, 4 optimizer steps an epoch,
``--epochs`` (4) epochs per lag, the tiny model built at Qwen2.5-0.5B's widths (hidden 896, 24 layers, 14 heads:
head size 64, as the real model; its vocabulary stays the tiny tokenizer's; warm start shortened to 20 steps, on
the CPU): a small run of a real shape, built on the machine (no download, nothing carried).

Reports per lag (``bench.overlap_speed.summarize``): median epoch wall seconds after the first epoch, the ratio to
lag 0, median rollout, wait, train and env seconds, the lag metrics, episodes per second, and the projection
"sync = R + T, lagged = max(R, T) + s" from lag 0's R and T (a model). Writes ``$OUT/gpu_overlap_check.json`` and
``.md`` (or ``--out``). Exit status: 0 done, 1 a run failed (its log's tail is printed), 2 no CUDA, 3 something the
runs need is missing (hydra, the ``cope`` package, a vLLM interpreter): each said in one line, before any run.

Needs, beyond the GPU image (torch, transformers, peft, lightning): hydra-core and omegaconf (small wheels, carried),
the ``cope`` package importable (``pip install --no-deps --no-build-isolation -e .``) and a CUDA build of vLLM in
its own venv (``make vllm-venv VLLM_PKG=vllm==0.32.0``, or ``--vllm-python``). The lent H200 image has no vLLM, and
vLLM's CUDA wheels are far larger than what a device call carries (64 MiB), so there the check stops at its
preflight saying so; ``--engine hf`` runs the same comparison with the in-process engine (a sampler copy of the
adapter per version; generation and training then share the GPU). Commands: bench/README.md, "GPU checks".

``--plan`` prints the runs' commands and exits (no GPU needed).
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# Qwen2.5-0.5B's widths on the tiny model (vocabulary and tokenizer the tiny one's), the maze at its defaults
SIZES = ("model.hidden_size=896", "model.num_layers=24", "model.num_heads=14", "model.warm_start_steps=20",
         "data.tasks_per_epoch=8", "data.group_size=8", "data.minibatch_size=16", "data.val_tasks=8")
GPU = ("trainer=gpu",)


def engine_overrides(engine: str, gpu_memory_utilization: float, vllm_python: str | None) -> list[str]:
    """The engine's overrides on the GPU (the same for every lag)."""
    if engine == "vllm":
        out = ["rollout=vllm", "data.engine.max_loras=2", f"data.engine.gpu_memory_utilization={gpu_memory_utilization}",
               "data.engine.server_args=[--enforce-eager]"]
        return out + ([f"data.engine.python={vllm_python}"] if vllm_python else [])
    if engine == "hf":
        return []
    raise ValueError(f"--engine: vllm or hf, got {engine!r}")


def plan(args) -> list[dict]:
    """Each run: its lag and the full train.py overrides (bench.overlap_speed's common ones, the GPU's, the sizes, the
    engine's, the lag)."""
    from bench.overlap_speed import COMMON

    shared = [*COMMON, *GPU, *SIZES, f"trainer.max_epochs={args.epochs}",
              *engine_overrides(args.engine, args.gpu_memory_utilization, args.vllm_python)]
    return [{"lag": lag, "overrides": [*shared, f"data.max_lag={lag}"]} for lag in args.lags]


def preflight(args) -> tuple[int, str] | None:
    """(exit status, message) for the first thing missing, None when the runs can start. Checked in this order, each
    in seconds: CUDA, hydra and omegaconf, the ``cope`` package, the vLLM interpreter (``--engine vllm``)."""
    import torch

    if not torch.cuda.is_available():
        return 2, ("gpu_overlap_check: no CUDA device (torch.cuda.is_available() is False). This check needs an NVIDIA GPU; "
                   "`python -m bench.overlap_speed` measures the same on CPU, `--plan` prints the runs.")
    editable = "this checkout (pip install --no-deps --no-build-isolation -e .)"
    for mod, how in (("hydra", "hydra-core"), ("omegaconf", "omegaconf"), ("cope", editable)):
        if importlib.util.find_spec(mod) is None:
            return 3, f"gpu_overlap_check: {mod} is not importable; install {how} before the check"
    if args.engine == "vllm":
        from cope.rollout.vllm.server import default_python

        python = args.vllm_python or default_python()
        if not Path(python).exists():
            return 3, (f"gpu_overlap_check: no vLLM interpreter at {python}; build a CUDA vLLM venv "
                       "(make vllm-venv VLLM_PKG=vllm==0.32.0) or pass --vllm-python. The lent H200 image has no vLLM; "
                       "--engine hf runs the comparison with the in-process engine")
        try:
            probe = subprocess.run([python, "-c", "import vllm"], capture_output=True, text=True, timeout=300)
            bad = probe.returncode != 0 and (probe.stderr.strip().splitlines() or ["(no output)"])[-1]
        except subprocess.TimeoutExpired:
            bad = "`import vllm` took over 300 s"
        if bad:
            return 3, f"gpu_overlap_check: {python} cannot import vllm: {bad}"
    return None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engine", choices=("vllm", "hf"), default="vllm")
    ap.add_argument("--lags", type=int, nargs="+", default=[0, 1])
    ap.add_argument("--epochs", type=int, default=4)
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.3, help="the vLLM server's share of the GPU")
    ap.add_argument("--vllm-python", default=None, help="vLLM interpreter (default $COPE_VLLM_PYTHON or .venv-vllm)")
    ap.add_argument("--max-seconds", type=float, default=540, help="all runs together; each gets an equal share of what is left")
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/cope-gpu-overlap"))
    ap.add_argument("--out", type=Path, default=None, help="results stem (default $OUT/gpu_overlap_check)")
    ap.add_argument("--plan", action="store_true", help="print the runs' commands and exit (no GPU needed)")
    args = ap.parse_args(argv)
    if 0 not in args.lags or min(args.lags) < 0 or args.epochs < max(args.lags) + 2:
        ap.error("--lags must include 0 and be >= 0; --epochs at least max(lags) + 2")
    if not 0 < args.gpu_memory_utilization < 1:
        ap.error("--gpu-memory-utilization must be in (0, 1): the trainer shares the GPU")
    sys.path.insert(0, str(REPO))  # `bench` as a package when run as a file
    if args.plan:
        for r in plan(args):
            print(f"lag {r['lag']}: python train.py " + " ".join(r["overrides"]))
        return 0
    problem = preflight(args)  # before anything imports cope
    if problem is not None:
        print(problem[1], file=sys.stderr)
        return problem[0]
    runs = plan(args)

    import torch

    from bench.overlap_speed import epoch_table, report, run_one, write

    t0, tables, done = time.perf_counter(), {}, []
    threads = int(os.environ.get("OMP_NUM_THREADS", "8"))
    for i, r in enumerate(runs):
        left = args.max_seconds - (time.perf_counter() - t0)
        run = run_one(args.workdir / f"lag{r['lag']}", r["overrides"], threads=threads, timeout=max(left / (len(runs) - i), 1.0))
        done.append({**run, "lag": r["lag"]})
        print(f"lag {r['lag']}: rc {run['rc']}, {run['wall_s']} s", flush=True)
        if run["rc"] != 0:
            print((Path(run["dir"]) / "bench.log").read_text()[-4000:], file=sys.stderr)
            return 1
        tables[r["lag"]] = [epoch_table(Path(run["dir"]) / "csv" / "metrics.csv")]
    device = torch.cuda.get_device_name(0)
    settings = {"device": device, "caveat": f"One {device}: the {args.engine} engine and training on the same GPU.",
                "epochs": args.epochs, "rounds": 1, "threads": threads, "order": args.lags, "overrides": runs[0]["overrides"][:-1]}
    write(report(args.engine, tables, done, settings), args.out or Path(os.environ.get("OUT", str(args.workdir))) / "gpu_overlap_check")
    return 0


if __name__ == "__main__":
    sys.exit(main())
