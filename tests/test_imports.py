"""Every module of the package imports, with the core dependencies only; the envs import without torch.

Modules are found by walking the source folders that pyproject.toml maps onto the package
(src/cope -> cope, callbacks/ -> cope.callbacks, envs/ -> cope.envs), so a new file is covered without
editing this test."""
from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
ROOTS = {"cope": REPO / "src" / "cope", "cope.callbacks": REPO / "callbacks", "cope.envs": REPO / "envs"}


def _modules() -> list[str]:
    names = set()
    for pkg, root in ROOTS.items():
        for f in root.rglob("*.py"):
            rel = f.relative_to(root).with_suffix("")
            if "__pycache__" in rel.parts:
                continue
            parts = [p for p in rel.parts if p != "__init__"]
            names.add(".".join([pkg, *parts]))
    return sorted(names)


MODULES = _modules()


def _run(code: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=180)


def test_walk_found_the_package():
    for must in ("cope", "cope.run.train", "cope.algos.cope.loss", "cope.algos.empg.callback", "cope.envs.maze"):
        assert must in MODULES, MODULES


@pytest.mark.parametrize("name", MODULES)
def test_module_imports(name):
    mod = importlib.import_module(name)
    assert mod.__file__ and Path(mod.__file__).resolve().is_relative_to(REPO), (name, mod.__file__)


@pytest.mark.long
def test_core_deps_only():
    """All modules import in a fresh interpreter where the optional extras (wandb, bitsandbytes) are blocked."""
    code = f"""
import importlib, json, sys, traceback
from cope.extras import EXTRAS
for m in EXTRAS:
    sys.modules[m] = None  # `import m` raises ImportError
bad = {{}}
for name in {MODULES!r}:
    try:
        importlib.import_module(name)
    except Exception:
        bad[name] = traceback.format_exc(limit=3)
print(json.dumps({{"bad": bad, "extras": sorted(EXTRAS)}}))
"""
    proc = _run(code)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["extras"], "cope.extras.EXTRAS is empty"
    assert not out["bad"], "\n".join(f"{k}:\n{v}" for k, v in out["bad"].items())


def test_envs_import_without_torch():
    """Every module under envs/ (env families, the env runtime) imports with torch blocked: the
    AppWorld venv and the env workers have no torch."""
    envs = [m for m in MODULES if m == "cope.envs" or m.startswith("cope.envs.")]
    assert "cope.envs.runtime.pool" in envs and "cope.envs.webshop.env" in envs, envs
    code = f"""
import importlib, sys
sys.modules["torch"] = None  # any `import torch` now raises ImportError
for name in {envs!r}:
    importlib.import_module(name)
from cope.envs.maze import MazeEnv
env = MazeEnv(sizes=[6], max_steps=4)
print(env.name, env.num_tasks("train") > 0, "torch" in sys.modules and sys.modules["torch"] is not None)
"""
    proc = _run(code)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split() == ["maze", "True", "False"], proc.stdout


def test_pyproject_lists_every_package():
    """setuptools installs only the packages pyproject.toml names: each folder with an ``__init__.py``
    under a mapped root (an env family, the env runtime) must be listed, or ``pip install`` drops it."""
    tomllib = pytest.importorskip("tomllib")
    setup = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    found = {".".join([pkg, *init.parent.relative_to(root).parts])
             for pkg, root in ROOTS.items() for init in root.rglob("__init__.py") if "__pycache__" not in init.parts}
    assert found <= set(setup["packages"]), sorted(found - set(setup["packages"]))
    assert {setup["package-dir"][k] for k in ROOTS} == {str(r.relative_to(REPO)) for r in ROOTS.values()}
