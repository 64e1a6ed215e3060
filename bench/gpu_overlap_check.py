"""GPU check: overlapped rollouts (``data.max_lag=1``) against synchronous ones on one GPU, with each run's peak memory;
the in-process engine (``rollout=hf``) and, where a vLLM interpreter exists, a vLLM server on the same GPU. Phase by
phase (docs/gpu.md: the commands in order, the card each needs).

Phases (:data:`PHASES`; ``--phase`` picks some, ``--list``, ``--dry-run``; ``--engine`` and ``--lags`` narrow the
default plan): ``hf_lag0``, ``hf_lag1``, ``vllm_lag0``, ``vllm_lag1`` (the default plan), ``branch_lag0``,
``branch_lag1`` (by name only). Each is one real ``python train.py`` of ``bench.overlap_speed``'s comparison with
``trainer=gpu`` (bf16 mixed precision):

* ``hf_*``: the in-process engine, generation and training in the trainer's process on the GPU (lag 1: the next
  epoch's rollouts in a thread while the optimizer steps run; a sampler copy of the adapter per held version).
* ``branch_*``: the in-process engine with branched rollouts (``+collector=branching``, each group of 8 leaves a
  tree of 2 roots, trained as tries: ``data.share_prefix=true``, the tree attention on CUDA); lag 1: the trees grow
  in the collector thread on the held version's sampler copy.
* ``vllm_*``: ``rollout=vllm`` with a managed vLLM server on **the same GPU** (``data.engine.gpu_memory_utilization``
  0.3 leaves the rest to training; on a node with two GPUs attach a server on the other with ``data.engine.url``,
  docs/vllm.md), ``data.engine.max_loras=2`` (a lagged collection's adapter and the newest one served at once),
  ``--enforce-eager`` (no CUDA-graph capture: the server starts in seconds, not minutes).

The run (:data:`SIZES`): the maze, 64 episodes (8 tasks x 8) of up to 20 turns an epoch, 4 optimizer steps an epoch,
``--epochs`` (4) epochs per run, the tiny model built at Qwen2.5-0.5B's widths (hidden 896, 24 layers, 14 heads: head
size 64, as the real model; its vocabulary stays the tiny tokenizer's): a small run of a real shape, built on the
machine (no download, nothing carried but what a bare machine lacks, below). Its warm start is cut to one step of 2
walks: it runs on the CPU at build time, and the tiny preset's 20 steps of 16 walks at this width take minutes and
over 20 GB of host memory there (measured here: one step of 16 was killed at 23 GB); the check times rollouts and
steps, not the policy's quality. The build is cached: the second run reuses the first's.

Reported per engine (``bench.overlap_speed.summarize``): median epoch wall seconds after the first epoch, the ratio to
lag 0, median rollout, wait, train and env seconds, the lag metrics, episodes per second, and the projection
"sync = R + T, lagged = max(R, T) + s" from lag 0's R and T (a model). Per run: its peak GPU memory, read from the
callback :data:`PEAK_CALLBACK` adds (``torch.cuda.max_memory_allocated`` and ``max_memory_reserved`` in the trainer's
process, per epoch; a vLLM server's memory is its own process's, outside them). Writes ``$OUT/gpu_overlap_check.json``
(every phase: ran, skipped and why, its return code, wall seconds, peaks) and per engine
``gpu_overlap_check_<engine>.json`` / ``.md`` (or under ``--out``).

**What a bare GPU machine lacks** (its image has torch, transformers, peft, lightning, PyYAML; the project's other
pinned wheels are absent), and how each is handled, each said in one line before any run:

* hydra-core 1.3.8, omegaconf 2.3.1 (pyproject.toml's pins) and antlr4-python3-runtime 4.9.3 (omegaconf's): what
  ``train.py`` imports beyond the image (a run's imports were listed against the image's package list: nothing else of
  the project's; the other absent modules it touched, boto3, redis, bitsandbytes and the like, are optional imports
  of libraries that skip them). Vendored: ``--vendor`` (here, once) copies the three pure-Python distributions as
  installed in this venv (their pins checked) into ``.whl/site`` (git-ignored, as the device notes' ``.whl/``);
  carried, the check puts that folder on ``sys.path`` and on the runs' ``PYTHONPATH`` when hydra is not importable.
  Without it the hf phases are skipped with that reason (exit 3 when nothing ran).
* the ``cope`` package (no editable install): the runs get a ``sitecustomize`` (written under ``--workdir``) that
  installs ``bench/gpu_plan.py``'s checkout finder (pyproject's package-dir) in every process they start, then runs
  the ``sitecustomize`` it shadows, if any.
* vLLM (its CUDA wheels are far larger than the 64 MiB a device call carries): the vllm phases are skipped with the
  reason; with ``--phase`` naming only them, exit 3. Elsewhere build one (``make vllm-venv VLLM_PKG=vllm==0.32.0``)
  or pass ``--vllm-python``.

Exit status: 0 done, 1 a run failed (its log's tail is printed), 2 no CUDA, 3 nothing could run (each reason said),
4 the GPU is smaller than a phase's card. ``--plan`` prints the runs' commands and exits (no GPU needed).
"""
from __future__ import annotations

import argparse
import csv
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # `python3 bench/gpu_overlap_check.py` from a bare checkout: bench.* importable
    sys.path.insert(0, str(REPO))
from bench.gpu_plan import PhaseSpec, add_plan_args, check_card, install_checkout_finder, plan_only, selected  # noqa: E402

# Qwen2.5-0.5B's widths on the tiny model (vocabulary and tokenizer the tiny one's), the maze at its defaults; a
# one-step warm start (see the module docstring)
SIZES = ("model.hidden_size=896", "model.num_layers=24", "model.num_heads=14", "model.warm_start_steps=1",
         "model.warm_start_batch=2", "data.tasks_per_epoch=8", "data.group_size=8", "data.minibatch_size=16", "data.val_tasks=8")
GPU = ("trainer=gpu",)
PEAK_KEYS = ("bench/peak_mem_gib", "bench/peak_reserved_gib")
PEAK_CALLBACK = "+callbacks.peak_memory._target_=bench.gpu_overlap_check.PeakMemory"
VENDORED = ("hydra-core", "omegaconf", "antlr4-python3-runtime")  # what train.py imports that the GPU image lacks
VENDOR_DIR = REPO / ".whl" / "site"

# Minutes, estimated (no GPU has run this yet). A run: ~20 s to start (imports, hydra, the config check), the tiny
# model's build on the first run only (tokenizer on 200 walks, one warm-start step of 2 walks on the CPU: ~33 s on 2
# shared cores here, ~15 s on the machine's 16), then 4 epochs: 64 maze episodes of <= 20 turns, each turn a
# batch-64 prefill + <= 8 decode steps of the 0.24B model (~20 ms a step eager: ~4 s an epoch), 4 optimizer steps on
# 64 x <= 1k tokens (~1 s): ~6 s an epoch. Peak memory: 0.24B fp32 weights (1 GB), KV cache and activations of a
# few GB: any card. vLLM: a server start (import, load, memory profiling; --enforce-eager) of ~60-90 s per run.
PHASES = {p.name: p for p in (
    PhaseSpec("hf_lag0", "rollout=hf, data.max_lag=0: collect, then train (the baseline)", "80GB", 1.2,
              "~20 s start + ~20 s tiny-model build (first run) + 4 epochs x ~6 s"),
    PhaseSpec("hf_lag1", "rollout=hf, data.max_lag=1: the next epoch's rollouts overlap the optimizer steps", "80GB", 0.9,
              "~20 s start (build cached) + 4 epochs x <= 6 s"),
    PhaseSpec("vllm_lag0", "rollout=vllm, a server on the same GPU (0.3 of its memory), max_lag=0", "80GB", 2.0,
              "hf_lag0 + ~75 s server start; skipped without a vLLM interpreter"),
    PhaseSpec("vllm_lag1", "rollout=vllm, max_lag=1, max_loras=2", "80GB", 2.0,
              "hf_lag1 + ~75 s server start; skipped without a vLLM interpreter"),
    PhaseSpec("branch_lag0", "rollout=hf, +collector=branching, data.share_prefix=true, max_lag=0", "80GB", 1.0,
              "hf_lag0's run with 0.62x its env steps and tokens (2 roots of 8 leaves), build cached", default=False),
    PhaseSpec("branch_lag1", "as branch_lag0 with max_lag=1: the trees grow in the collector thread", "80GB", 0.9,
              "as hf_lag1", default=False),
)}
SETUP = PhaseSpec("setup", "preflight: CUDA, hydra (vendored if carried), vLLM interpreter", "80GB", 0.1, "seconds")


def phase_run(name: str) -> tuple[str, int]:
    """(engine, lag) of a phase name such as ``hf_lag1``."""
    engine, lag = name.split("_lag")
    return engine, int(lag)


def engine_overrides(engine: str, gpu_memory_utilization: float, vllm_python: str | None) -> list[str]:
    """The engine's overrides on the GPU (the same for every lag)."""
    if engine == "vllm":
        out = ["rollout=vllm", "data.engine.max_loras=2", f"data.engine.gpu_memory_utilization={gpu_memory_utilization}",
               "data.engine.server_args=[--enforce-eager]"]
        return out + ([f"data.engine.python={vllm_python}"] if vllm_python else [])
    if engine == "hf":
        return []
    if engine == "branch":
        return ["+collector=branching", "data.share_prefix=true"]
    raise ValueError(f"--engine: vllm, hf or branch, got {engine!r}")


def plan(args) -> list[dict]:
    """Each run of ``args.engine`` at ``args.lags``: its lag and the full train.py overrides (bench.overlap_speed's common
    ones, the GPU's, the sizes, the peak-memory callback, the engine's, the lag)."""
    from bench.overlap_speed import COMMON

    shared = [*COMMON, *GPU, *SIZES, PEAK_CALLBACK, f"trainer.max_epochs={args.epochs}",
              *engine_overrides(args.engine, args.gpu_memory_utilization, args.vllm_python)]
    return [{"lag": lag, "overrides": [*shared, f"data.max_lag={lag}"]} for lag in args.lags]


def preflight(args) -> tuple[int, str] | None:
    """(exit status, message) for the first thing ``args.engine``'s runs lack, None when they can start. Checked in
    this order, each in seconds: CUDA, hydra and omegaconf, the ``cope`` package, the vLLM interpreter (``vllm``)."""
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


# -- what a bare machine lacks: vendored packages, the checkout's packages in every run's process --------------------
def pins() -> dict[str, str]:
    """pyproject.toml's ``name==version`` dependencies."""
    import tomllib

    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    return {d.split("==")[0].strip().lower(): d.split("==")[1].strip() for d in deps if "==" in d}


def vendor(dest: Path | None = None) -> dict[str, str]:
    """Copies :data:`VENDORED` as installed in this interpreter into ``dest`` (each distribution's files inside
    site-packages, its .dist-info too; no bytecode, no scripts): pure Python, so the GPU image's Python takes them.
    Refuses a version other than pyproject.toml's pin. Returns {distribution: version}."""
    import importlib.metadata as md

    dest = dest or VENDOR_DIR
    want, out = pins(), {}
    shutil.rmtree(dest, ignore_errors=True)
    for name in VENDORED:
        dist = md.distribution(name)
        if name in want and dist.version != want[name]:
            raise SystemExit(f"gpu_overlap_check --vendor: {name} {dist.version} installed, pyproject.toml pins {want[name]}")
        for f in dist.files or ():
            if f.parts[0] == ".." or "__pycache__" in f.parts or f.suffix == ".pyc":
                continue
            target = dest / f
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(f.locate(), target)
        out[name] = dist.version
    return out


def use_vendored(dest: Path | None = None) -> str | None:
    """When hydra is not importable and ``dest`` (:data:`VENDOR_DIR`) holds it: ``dest`` first on this process's
    ``sys.path``, and returned (for the runs' ``PYTHONPATH``); else None."""
    dest = dest or VENDOR_DIR
    if importlib.util.find_spec("hydra") is not None or not (dest / "hydra" / "__init__.py").is_file():
        return None
    sys.path.insert(0, str(dest))
    importlib.invalidate_caches()
    return str(dest)


HOOK = '''"""Written by bench/gpu_overlap_check.py for the train.py runs it starts (and every process they start): this
checkout's packages (pyproject's package-dir) importable without an install, then the sitecustomize this one shadows."""
import importlib.machinery
import importlib.util
import os
import sys

if {repo!r} not in sys.path:
    sys.path.append({repo!r})
from bench.gpu_plan import install_checkout_finder  # noqa: E402

install_checkout_finder()
_here = os.path.dirname(os.path.abspath(__file__))
_spec = importlib.machinery.PathFinder.find_spec("sitecustomize", [p for p in sys.path if os.path.abspath(p or ".") != _here])
if _spec is not None and _spec.loader is not None:
    _spec.loader.exec_module(importlib.util.module_from_spec(_spec))
'''


def write_hook(folder: Path) -> Path:
    """``folder``/sitecustomize.py (:data:`HOOK`); returns ``folder``, for the runs' ``PYTHONPATH``."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "sitecustomize.py").write_text(HOOK.format(repo=str(REPO)))
    return folder


def peak_memory_callback():
    """The callback :data:`PEAK_CALLBACK` names: per training epoch, ``torch.cuda.max_memory_allocated`` and
    ``max_memory_reserved`` (GiB) since the epoch's start, in the trainer's process (lag 1: the next epoch's rollouts
    in their thread included). Nothing on CPU."""
    import torch
    from lightning.pytorch import Callback

    class PeakMemory(Callback):
        def on_train_epoch_start(self, trainer, pl_module) -> None:
            if torch.cuda.is_available():
                torch.cuda.reset_peak_memory_stats()

        def on_train_epoch_end(self, trainer, pl_module) -> None:
            if torch.cuda.is_available():
                for key, value in zip(PEAK_KEYS, (torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved())):
                    pl_module.log(key, value / 2**30, on_step=False, on_epoch=True, batch_size=1)

    return PeakMemory


def __getattr__(name: str):  # `bench.gpu_overlap_check.PeakMemory`, the config's _target_
    if name == "PeakMemory":
        return peak_memory_callback()
    raise AttributeError(name)


def peaks(metrics_csv: Path) -> dict:
    """The runs' per-epoch peaks (:data:`PEAK_KEYS`) from its ``csv/metrics.csv``, and their maxima."""
    out: dict = {k.split("/")[1]: [] for k in PEAK_KEYS}
    if Path(metrics_csv).exists():
        with Path(metrics_csv).open(newline="") as f:
            for row in csv.DictReader(f):
                for k in PEAK_KEYS:
                    if row.get(k) not in (None, ""):
                        out[k.split("/")[1]].append(round(float(row[k]), 3))
    return {**{f"max_{k}": max(v) if v else None for k, v in out.items()}, "per_epoch": out}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_plan_args(ap, PHASES)
    ap.add_argument("--engine", choices=("vllm", "hf", "branch"),
                    help="the phases of this engine only (branch: its phases, which the default plan leaves out)")
    ap.add_argument("--lags", type=int, nargs="+", help="the default plan's phases at these lags only (0 among them)")
    ap.add_argument("--epochs", type=int, default=4)
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.3, help="the vLLM server's share of the GPU")
    ap.add_argument("--vllm-python", default=None, help="vLLM interpreter (default $COPE_VLLM_PYTHON or .venv-vllm)")
    ap.add_argument("--max-seconds", type=float, default=540, help="all runs together; each gets an equal share of what is left")
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/cope-gpu-overlap"))
    ap.add_argument("--out", type=Path, default=None, help="results stem (default $OUT/gpu_overlap_check)")
    ap.add_argument("--plan", action="store_true", help="print the runs' commands and exit (no GPU needed)")
    ap.add_argument("--vendor", action="store_true", help=f"copy {', '.join(VENDORED)} from this venv into .whl/site and exit")
    args = ap.parse_args(argv)
    installed = importlib.util.find_spec("cope") is not None
    install_checkout_finder()  # this process: `cope` from the checkout (bench.overlap_speed imports it)
    if args.vendor:
        got = vendor()
        mib = sum(f.stat().st_size for f in VENDOR_DIR.rglob("*") if f.is_file()) / 2**20
        print(f"gpu_overlap_check: vendored {got} into {VENDOR_DIR} ({mib:.1f} MiB); carry `.whl` in the device call")
        return 0
    names = selected(args, PHASES)
    if args.phase is None:  # --engine / --lags narrow the default plan (--engine branch: its own phases)
        pool = [n for n in PHASES if phase_run(n)[0] == "branch"] if args.engine == "branch" else names
        names = [n for n in pool if (args.engine is None or phase_run(n)[0] == args.engine)
                 and (args.lags is None or phase_run(n)[1] in args.lags)]
    by_engine: dict[str, list[int]] = {}
    for n in names:
        by_engine.setdefault(phase_run(n)[0], []).append(phase_run(n)[1])
    if not names or any(0 not in lags for lags in by_engine.values()):
        ap.error("each engine's phases must include its lag 0 (the baseline the ratio needs): e.g. --phase hf_lag0 hf_lag1")
    if args.epochs < max(max(lags) for lags in by_engine.values()) + 2:
        ap.error("--epochs must be at least the largest lag + 2")
    if not 0 < args.gpu_memory_utilization < 1:
        ap.error("--gpu-memory-utilization must be in (0, 1): the trainer shares the GPU")
    shown = plan_only(args, "gpu_overlap_check", PHASES, SETUP, names)
    if any(phase_run(n)[0] == "vllm" for n in names) and not args.list:
        without = SETUP.minutes + sum(PHASES[n].minutes for n in names if phase_run(n)[0] != "vllm")
        print(f"without a vLLM interpreter (the lent machines have none) the vllm phases are skipped: {without:.1f} min estimated; "
              "with one, run the engines as two commands (--engine hf, --engine vllm) to keep each near 5 minutes", flush=True)
    if shown:
        return 0
    runs_by_engine = {e: plan(argparse.Namespace(**{**vars(args), "engine": e, "lags": sorted(lags)})) for e, lags in by_engine.items()}
    if args.plan:
        for e, runs in runs_by_engine.items():
            for r in runs:
                print(f"{e}_lag{r['lag']}: python train.py " + " ".join(r["overrides"]))
        return 0

    vendored = use_vendored()  # hydra and omegaconf from .whl/site where the machine has none
    status: dict = {}
    for engine in list(runs_by_engine):
        problem = preflight(argparse.Namespace(engine=engine, vllm_python=args.vllm_python))
        if problem is not None and problem[0] == 2:
            print(problem[1], file=sys.stderr)
            return 2
        if problem is not None:
            reason = problem[1] + ("; or vendor it: `python bench/gpu_overlap_check.py --vendor` where it is installed, then "
                                   "carry .whl" if "hydra" in problem[1] or "omegaconf" in problem[1] else "")
            skipped = ", ".join(f"{engine}_lag{r['lag']}" for r in runs_by_engine[engine])
            print(f"gpu_overlap_check: skipping {skipped}: {reason}", flush=True)
            for r in runs_by_engine.pop(engine):
                status[f"{engine}_lag{r['lag']}"] = {"skipped": reason}
    if not runs_by_engine:
        print("gpu_overlap_check: nothing could run (reasons above)", file=sys.stderr)
        return 3
    to_run = [f"{e}_lag{r['lag']}" for e, rs in runs_by_engine.items() for r in rs]
    if (refused := check_card("gpu_overlap_check", PHASES, to_run)) is not None:
        return refused

    import torch

    from bench.overlap_speed import epoch_table, report, run_one, write

    hook = write_hook(args.workdir / "site")
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(hook), vendored, os.environ.get("PYTHONPATH")]))
    out = args.out or Path(os.environ.get("OUT", str(args.workdir))) / "gpu_overlap_check"
    device = torch.cuda.get_device_name(0)
    summary = {"device": device, "device_gib": round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1),
               "phases": status, "vendored": vendored, "cope_installed": installed, "epochs": args.epochs}
    t0, failed, pending = time.perf_counter(), False, sum(len(rs) for rs in runs_by_engine.values())
    threads = int(os.environ.get("OMP_NUM_THREADS", "8"))
    for engine, runs in runs_by_engine.items():
        tables, done = {}, []
        for r in runs:
            name, left = f"{engine}_lag{r['lag']}", args.max_seconds - (time.perf_counter() - t0)
            run = run_one(args.workdir / name, r["overrides"], threads=threads, timeout=max(left / pending, 1.0))
            pending -= 1
            done.append({**run, "lag": r["lag"]})
            status[name] = {"rc": run["rc"], "wall_s": run["wall_s"], "dir": run["dir"],
                            "peaks_gib": peaks(Path(run["dir"]) / "csv" / "metrics.csv"), "estimate_min": PHASES[name].minutes}
            print(f"{name}: rc {run['rc']}, {run['wall_s']} s, peak {status[name]['peaks_gib']['max_peak_mem_gib']} GiB allocated "
                  f"({status[name]['peaks_gib']['max_peak_reserved_gib']} reserved)", flush=True)
            if run["rc"] != 0:
                failed = True
                print((Path(run["dir"]) / "bench.log").read_text()[-4000:], file=sys.stderr)
                break
            tables[r["lag"]] = [epoch_table(Path(run["dir"]) / "csv" / "metrics.csv")]
        if 0 in tables and len(tables) == len(runs):
            settings = {"device": device, "caveat": f"One {device}: the {engine} engine and training on the same GPU.",
                        "epochs": args.epochs, "rounds": 1, "threads": threads, "order": sorted(tables),
                        "overrides": runs[0]["overrides"][:-1]}
            result = report(engine, tables, done, settings)
            result["peaks_gib"] = {r["lag"]: status[f"{engine}_lag{r['lag']}"]["peaks_gib"] for r in runs}
            write(result, out.with_name(f"{out.name}_{engine}"))
        summary["phases"] = status
        out.parent.mkdir(parents=True, exist_ok=True)
        out.with_suffix(".json").write_text(json.dumps(summary, indent=1) + "\n")
    summary["total_s"] = round(time.perf_counter() - t0, 1)
    out.with_suffix(".json").write_text(json.dumps(summary, indent=1) + "\n")
    print(json.dumps(summary))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
