"""Shared test setup: an isolated, offline environment and helpers to compose configs and run training.

* Session-wide (autouse): ``COPE_CACHE`` points at a session temp folder (the tiny model is built
  once per session and never under the user's home) and the HF/W&B stack is offline.
* ``compose(overrides, tmp_path)``: the run config exactly as ``train.py`` composes it, with
  ``debug=fast`` and ``paths.output_dir=<tmp_path>`` (``${hydra:runtime.output_dir}`` only resolves
  under ``@hydra.main``).
* ``run_train(overrides, tmp_path)``: ``cope.run.train.train`` on that config; returns its result dict.
* ``train_script(args, tmp_path)``: the real entry point ``python train.py ...`` in a subprocess.
* ``read_metrics(path)``: a CSVLogger ``metrics.csv`` as ``{key: [values...]}``; ``metric_rows(path)`` (a plain
  function) as its rows.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
CONF_DIR = REPO / "conf"
TRAIN_PY = REPO / "train.py"
_TESTS = Path(__file__).resolve().parent

# Test folders have no __init__.py and must not be named like a package (e.g. tests/cope/):
# with pytest's prepend import mode such a folder would shadow the real `cope` package.
import cope  # noqa: E402

assert cope.__file__ and Path(cope.__file__).resolve().parent == REPO / "src" / "cope", cope.__path__

from metric_docs import undocumented_metrics  # noqa: E402  (tests/metric_docs.py: the docs' metric families)

OFFLINE_ENV = {
    "WANDB_MODE": "disabled",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
}


@pytest.fixture(scope="session", autouse=True)
def cope_cache(tmp_path_factory) -> Path:
    """``COPE_CACHE`` (tiny model cache) in a session temp folder, plus offline HF/W&B settings."""
    cache = tmp_path_factory.mktemp("cope_cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("COPE_CACHE", str(cache))
        for k, v in OFFLINE_ENV.items():
            mp.setenv(k, v)
        yield cache


def compose_config(overrides: list[str], tmp_path: Path):
    """The composed run config (``debug=fast`` first, then ``overrides``) writing into ``tmp_path``."""
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3", job_name="test"):
        return compose(config_name="config", overrides=["debug=fast", f"paths.output_dir={tmp_path}", *overrides])


def train_in_process(overrides: list[str], tmp_path: Path) -> dict[str, float]:
    """Compose and run ``cope.run.train.train``; returns the result dict (final metrics and counters)."""
    from cope.run.train import train

    return train(compose_config(overrides, tmp_path))


def run_train_script(args: list[str], tmp_path: Path, timeout: float = 240, env: dict | None = None,
                     script: Path = TRAIN_PY) -> subprocess.CompletedProcess:
    """``python train.py <args>`` (or another entry point, e.g. ``eval.py``) with cwd ``tmp_path`` (nothing lands in
    the repo) and one thread.

    Pass ``hydra.run.dir=...`` in ``args`` for runs that get past composition."""
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "HYDRA_FULL_ERROR": "0", **(env or {})}
    return subprocess.run([sys.executable, str(script), *args], cwd=tmp_path, env=full_env, capture_output=True,
                          text=True, timeout=timeout)


@pytest.fixture(scope="session")
def compose(cope_cache):
    return compose_config


@pytest.fixture(scope="session")
def run_train(cope_cache):
    return train_in_process


@pytest.fixture(scope="session")
def train_script(cope_cache):
    return run_train_script


def read_metrics_csv(path: Path) -> dict[str, list[float]]:
    """metrics.csv as columns: each key's non-empty values in file (logging) order. Every logged family must have its
    row in docs/metrics.md (a metric users cannot look up fails the test that reads it)."""
    import csv

    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    keys = {k for r in rows for k in r}
    missing = undocumented_metrics(keys)
    assert not missing, f"{path}: logged metrics whose family docs/metrics.md does not describe: {missing}"
    return {k: [float(r[k]) for r in rows if r.get(k) not in (None, "")] for k in sorted(keys)}


def metric_rows(path: Path) -> list[dict[str, str]]:
    """metrics.csv as rows in file order, each with its non-empty values, wall-clock (``perf/*``) columns aside: what
    two runs of the same seed must agree on row for row."""
    import csv

    with open(path, newline="") as f:
        return [{k: v for k, v in r.items() if v not in ("", None) and not k.startswith("perf/")} for r in csv.DictReader(f)]


@pytest.fixture(scope="session")
def read_metrics():
    return read_metrics_csv
