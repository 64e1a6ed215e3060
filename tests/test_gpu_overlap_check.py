"""bench/gpu_overlap_check.py on a bare GPU machine, checked on CPU: its plan (phases by name, an unknown one refused
naming the valid ones, the default plan's minutes with and without vLLM); the default plan without a vLLM interpreter
skips the vllm phases with the reason and runs the hf ones (their runs faked here: each a real train.py on a GPU),
reading each run's peak memory from its metrics; with hydra absent and nothing vendored everything is skipped with
the reason and the fix (exit 3); ``--vendor`` copies the pinned hydra-core, omegaconf and antlr4 so that an interpreter
without them composes the project's config, and the runs' ``sitecustomize`` makes this checkout's ``cope`` importable
with no install. (tests/test_overlap_bench.py checks the preflight's messages and the runs' configs.)"""
from __future__ import annotations

import csv
import json
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

from bench import gpu_overlap_check as gpu
from bench import overlap_speed

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "bench" / "gpu_overlap_check.py"


def _cli(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    """The script as the GPU image runs it: no editable install of cope, hydra and omegaconf absent
    (tests/test_gpu_check.py's interpreter)."""
    from test_gpu_check import BARE, _bare_env

    return subprocess.run([sys.executable, "-c", BARE, str(SCRIPT), *args], cwd=cwd, env=_bare_env(), capture_output=True,
                          text=True, timeout=120)


def test_plan_phases_and_estimates(tmp_path):
    proc = _cli(["--dry-run"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    default = [n for n, p in gpu.PHASES.items() if p.default]
    assert default == ["hf_lag0", "hf_lag1", "vllm_lag0", "vllm_lag1"]
    assert all(f"| {n} | 80GB |" in proc.stdout for n in default) and "branch_lag" not in proc.stdout  # any card
    branch = _cli(["--plan", "--engine", "branch"], tmp_path)  # branched rollouts: by name or --engine only
    runs = [line for line in branch.stdout.splitlines() if "python train.py" in line]
    assert branch.returncode == 0 and len(runs) == 2 and all("+collector=branching" in r for r in runs), branch.stderr[-2000:]
    assert "the vllm phases are skipped: 2.2 min estimated" in proc.stdout  # the lent machines' default plan
    assert gpu.SETUP.minutes + sum(p.minutes for n, p in gpu.PHASES.items() if n.startswith("hf")) <= 5.0
    hf = _cli(["--dry-run", "--engine", "hf"], tmp_path)
    assert "| hf_lag1 |" in hf.stdout and "| vllm_lag0 |" not in hf.stdout and "skipped" not in hf.stdout
    commands = _cli(["--plan", "--engine", "hf"], tmp_path)  # needs bench.overlap_speed, so cope, from the checkout
    assert commands.returncode == 0 and commands.stdout.count("python train.py") == 2, commands.stderr[-2000:]
    bad = _cli(["--phase", "hf_lag2"], tmp_path)
    assert bad.returncode == 2 and "invalid choice: 'hf_lag2'" in bad.stderr and all(f"'{n}'" in bad.stderr for n in gpu.PHASES)
    no_base = _cli(["--phase", "hf_lag1"], tmp_path)
    assert no_base.returncode == 2 and "must include its lag 0" in no_base.stderr


def _fake_gpu(monkeypatch):
    """CUDA reported present, an H100's name and memory; what main() changes in this process is restored after (its
    checkout finder on sys.meta_path, the runs' PYTHONPATH)."""
    monkeypatch.setattr(sys, "meta_path", list(sys.meta_path))
    monkeypatch.delenv("PYTHONPATH", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=0: "NVIDIA H100 80GB HBM3")
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda i=0: types.SimpleNamespace(name="NVIDIA H100 80GB HBM3", total_memory=81559 * 2**20))


def _fake_run(calls: list):
    """bench.overlap_speed.run_one, faked: a CSVLogger-like metrics.csv with 4 epochs of the keys the report and the
    peaks read (the peak grows with the lag), and rc 0."""

    def run_one(run: Path, overrides: list[str], threads: int, timeout: float) -> dict:
        calls.append(overrides)
        lag = int(overrides[-1].split("=")[1])
        (run / "csv").mkdir(parents=True, exist_ok=True)
        keys = [overlap_speed.WALL, "perf/rollout_seconds", "perf/epoch_seconds", "counters/episodes", *gpu.PEAK_KEYS, "epoch", "step"]
        with (run / "csv" / "metrics.csv").open("w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=keys)
            w.writeheader()
            for e in range(4):
                w.writerow({overlap_speed.WALL: 5.0 - lag, "perf/rollout_seconds": 3.0, "perf/epoch_seconds": 1.5,
                            "counters/episodes": 64 * (e + 1), gpu.PEAK_KEYS[0]: 2.0 + lag + e / 10, gpu.PEAK_KEYS[1]: 3.0 + lag,
                            "epoch": e, "step": 4 * e + 3})
        return {"dir": str(run), "rc": 0, "wall_s": 30.0, "cmd": overrides, "loadavg_1min": 0.0}

    return run_one


def test_default_plan_without_vllm_skips_its_phases_and_runs_hf_with_peaks(tmp_path, monkeypatch, capsys):
    _fake_gpu(monkeypatch)
    calls: list = []
    monkeypatch.setattr(overlap_speed, "run_one", _fake_run(calls))
    out = tmp_path / "out" / "gpu_overlap_check"
    rc = gpu.main(["--vllm-python", "/nonexistent/python", "--workdir", str(tmp_path / "w"), "--out", str(out)])
    assert rc == 0
    stdout = capsys.readouterr().out
    assert "skipping vllm_lag0, vllm_lag1: gpu_overlap_check: no vLLM interpreter at /nonexistent/python" in stdout
    assert [c[-1] for c in calls] == ["data.max_lag=0", "data.max_lag=1"]  # the hf runs, in order
    assert all("trainer=gpu" in c and gpu.PEAK_CALLBACK in c and "rollout=vllm" not in c for c in calls)
    summary = json.loads(out.with_suffix(".json").read_text())
    assert summary["phases"]["vllm_lag1"]["skipped"].startswith("gpu_overlap_check: no vLLM interpreter")
    assert summary["phases"]["hf_lag1"]["peaks_gib"]["max_peak_mem_gib"] == 3.3  # 2 + lag 1 + epoch 3's 0.3
    assert summary["phases"]["hf_lag0"]["peaks_gib"]["per_epoch"]["peak_reserved_gib"] == [3.0] * 4
    report = json.loads((out.parent / "gpu_overlap_check_hf.json").read_text())
    assert report["summary"]["1"]["ratio"] == pytest.approx(4.0 / 5.0) and set(report["peaks_gib"]) == {"0", "1"}
    hook = (tmp_path / "w" / "site" / "sitecustomize.py").read_text()  # the runs' PYTHONPATH starts with it
    assert str(REPO) in hook and "install_checkout_finder" in hook


def test_without_hydra_and_nothing_vendored_everything_is_skipped_with_the_fix(tmp_path, monkeypatch, capsys):
    import importlib.util

    _fake_gpu(monkeypatch)
    monkeypatch.setattr(gpu, "VENDOR_DIR", tmp_path / "none")
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "hydra" else real(name, *a))
    monkeypatch.setattr(overlap_speed, "run_one", lambda *a, **k: pytest.fail("a run started"))
    assert gpu.main(["--engine", "hf", "--workdir", str(tmp_path / "w")]) == 3
    cap = capsys.readouterr()
    assert "skipping hf_lag0, hf_lag1: gpu_overlap_check: hydra is not importable" in cap.out
    assert "bench/gpu_overlap_check.py --vendor" in cap.out and "nothing could run" in cap.err


# an interpreter as a bare GPU machine has it: hydra, omegaconf and antlr4 not in site-packages, no editable install
BARE = """
import importlib.machinery as m, sys
SITE = [p for p in sys.path if p.endswith("site-packages")]
class Hide(m.PathFinder):
    @classmethod
    def find_spec(cls, name, path=None, target=None):
        if name.partition(".")[0] in ("hydra", "omegaconf", "antlr4") and path is None:
            path = [p for p in sys.path if p not in SITE]
        return super().find_spec(name, path, target)
sys.meta_path[:] = [Hide if f is m.PathFinder else f for f in sys.meta_path if "editable" not in getattr(f, "__module__", "")]
"""
PROBE = BARE + """
import importlib.util
print(importlib.util.find_spec("hydra") is None)
"""
COMPOSE = BARE + """
import importlib.metadata as md, json
import hydra, omegaconf, antlr4, cope
from hydra import compose, initialize_config_dir
from bench import gpu_overlap_check as gpu
with initialize_config_dir(config_dir=str(gpu.REPO / "conf"), version_base="1.3"):
    cfg = compose("config", overrides=gpu.plan(gpu.argparse.Namespace(engine="hf", lags=[1], epochs=4,
                  gpu_memory_utilization=0.3, vllm_python=None))[0]["overrides"])
import builtins
print(json.dumps({"chained": getattr(builtins, "chained_sitecustomize", False), "hydra": hydra.__file__,
                  "omegaconf": omegaconf.__file__, "antlr4": antlr4.__file__, "cope": cope.__file__,
                  "versions": [md.version(d) for d in gpu.VENDORED], "finder": type(sys.meta_path[0]).__name__,
                  "max_lag": cfg.data.max_lag, "hidden": cfg.model.hidden_size}))
"""


def test_vendored_packages_and_the_hook_serve_a_bare_interpreter(tmp_path):
    env = {"PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1", "HOME": str(tmp_path)}
    hidden = subprocess.run([sys.executable, "-c", PROBE], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    assert hidden.stdout.strip() == "True", hidden.stderr[-2000:]  # the emulation hides the venv's hydra
    versions = gpu.vendor(tmp_path / "site")
    assert versions == {"hydra-core": "1.3.8", "omegaconf": "2.3.1", "antlr4-python3-runtime": "4.9.3"}  # pyproject's pins
    assert not list((tmp_path / "site").rglob("*.pyc")) and (tmp_path / "site" / "hydra_core-1.3.8.dist-info").is_dir()
    hook = gpu.write_hook(tmp_path / "hook")
    (tmp_path / "other").mkdir()  # a sitecustomize the hook shadows: it still runs, after the hook
    (tmp_path / "other" / "sitecustomize.py").write_text("import builtins\nbuiltins.chained_sitecustomize = True\n")
    env["PYTHONPATH"] = f"{hook}:{tmp_path / 'other'}:{tmp_path / 'site'}"
    proc = subprocess.run([sys.executable, "-c", COMPOSE], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert all(got[k].startswith(str(tmp_path / "site")) for k in ("hydra", "omegaconf", "antlr4")), got
    assert got["cope"] == str(REPO / "src" / "cope" / "__init__.py") and got["finder"] == "CheckoutFinder"
    assert got["versions"] == ["1.3.8", "2.3.1", "4.9.3"] and got["max_lag"] == 1 and got["hidden"] == 896 and got["chained"]
