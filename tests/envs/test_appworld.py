"""Tests for the AppWorld adapter (`cope.envs.appworld`).

What runs here: the code clean-up, argument checks, and the error paths without AppWorld (in this
venv) and without its data (through the AppWorld venv, ``.venv-appworld``, when it exists). Episodes
need the AppWorld data (a separate download) and skip without it; no task is faked.
"""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

from cope.envs.appworld import AppWorldEnv, RemoteAppWorldEnv, strip_code
from cope.envs.base import Env, Task

pytestmark = pytest.mark.long  # real env engines: seconds to a minute per test (make test-fast leaves them out)

REPO = Path(__file__).resolve().parents[2]
VENV_PYTHON = REPO / ".venv-appworld" / "bin" / "python"
ROOT = os.environ.get("APPWORLD_ROOT", "")
HAS_VENV = VENV_PYTHON.exists()
HAS_DATA = HAS_VENV and bool(ROOT) and (Path(ROOT) / "data" / "tasks").is_dir()
needs_venv = pytest.mark.skipif(not HAS_VENV, reason="needs the AppWorld venv .venv-appworld (docs/envs/appworld.md)")
needs_data = pytest.mark.skipif(not HAS_DATA, reason="needs AppWorld data (APPWORLD_ROOT)")


@pytest.mark.parametrize(("text", "code"), [
    ("print(1)", "print(1)"),
    ("```python\nfor x in [1, 2]:\n    print(x)\n```", "for x in [1, 2]:\n    print(x)"),
    ("```\nx = 1\n```", "x = 1"),
    ("\n\n    if True:\n        print(2)\n", "if True:\n    print(2)"),
    ("  \n", ""),
    ("```python\n```", ""),
])
def test_strip_code_keeps_indentation(text, code):
    assert strip_code(text) == code


@pytest.mark.parametrize(("kwargs", "arg"), [
    ({"train_dataset": "val"}, "train_dataset"), ({"test_dataset": "test"}, "test_dataset"),
    ({"reward_mode": "dense"}, "reward_mode"), ({"max_steps": 0}, "max_steps"),
    ({"max_observation_chars": 0}, "max_observation_chars"), ({"timeout_seconds": 0}, "timeout_seconds"),
    ({"experiment_name": ""}, "experiment_name"),
])
def test_bad_constructor_args(kwargs, arg):
    with pytest.raises(ValueError, match=arg):
        AppWorldEnv(**kwargs)
    with pytest.raises(ValueError, match=arg):  # checked before any child process starts
        RemoteAppWorldEnv(python=sys.executable, **kwargs)


def test_construction_is_light_and_instances_get_their_own_outputs(tmp_path):
    a, b = AppWorldEnv(root=str(tmp_path)), AppWorldEnv(root=str(tmp_path))
    assert isinstance(a, Env) and a.root == str(tmp_path) and a.max_steps == 40
    assert a.experiment != b.experiment and a.experiment.startswith("cope/")
    assert "apis.supervisor.complete_task" in a.instructions
    a.close()
    a.close()  # safe twice, also before any reset
    with pytest.raises(RuntimeError, match="before reset"):
        a.step("print(1)")


@pytest.mark.skipif(importlib.util.find_spec("appworld") is not None, reason="appworld is importable in this venv")
def test_missing_package_says_how_to_build_the_venv(tmp_path):
    with pytest.raises(ImportError) as info:
        AppWorldEnv(root=str(tmp_path)).num_tasks("train")
    text = str(info.value)
    assert "python3 -m venv .venv-appworld" in text and "pip install appworld==0.1.3.post1" in text
    assert "appworld install" in text and "--no-deps -e ." in text


def test_imports_without_torch_or_appworld():
    code = ("import sys; sys.modules['torch'] = None; sys.modules['appworld'] = None\n"
            "import cope.envs.appworld as m; m.AppWorldEnv(); print('ok')")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"


def test_missing_interpreter_says_how_to_build_the_venv(tmp_path):
    with pytest.raises(FileNotFoundError, match="python3 -m venv .venv-appworld"):
        RemoteAppWorldEnv(python=str(tmp_path / "no-venv" / "bin" / "python"))


@needs_venv
def test_remote_without_data_says_how_to_get_it(tmp_path):
    with pytest.raises(RuntimeError) as info:
        RemoteAppWorldEnv(root=str(tmp_path))
    text = str(info.value)
    assert "AppWorld data not found" in text and str(tmp_path) in text
    assert "appworld download data" in text and "APPWORLD_ROOT" in text


def test_remote_config_composes(compose, tmp_path):
    cfg = compose(["env=appworld"], tmp_path)
    assert cfg.env._target_ == "cope.envs.appworld.RemoteAppWorldEnv" and cfg.env.max_steps == 8  # debug=fast


# -- with the data --------------------------------------------------------------------------------
@needs_data
def test_episode_runs_and_is_evaluated():
    env = RemoteAppWorldEnv(root=ROOT, max_steps=3)
    try:
        assert env.num_tasks("train") > 0 and env.num_tasks("test") > 0
        reset = env.reset(Task("appworld", "train", 0))
        assert reset.observation.startswith("Task: ") and "Supervisor: " in reset.observation
        ok = env.step("print(apis.api_docs.show_app_descriptions())")
        assert ok.valid and not ok.done and "spotify" in ok.observation
        bad = env.step("print(undefined_name)")
        assert not bad.valid and bad.observation.startswith("Execution failed")
        end = env.step("apis.supervisor.complete_task()")
        assert end.done and end.info["completed"] and end.info["num_tests"] >= 1
        assert 0.0 <= end.score <= 1.0 and end.reward == (1.0 if end.success else 0.0)
    finally:
        env.close()


@needs_data
def test_train_one_epoch(run_train, tmp_path):
    result = run_train(["env=appworld", f"env.root={ROOT}", "model.max_context=2048", "data.max_context=2048",
                        "model.tokenizer_episodes=4", "model.warm_start_walks=4", "model.warm_start_steps=2",
                        "data.tasks_per_epoch=1", "data.group_size=2", "data.minibatch_size=2", "data.val_tasks=1",
                        "data.val_batch_size=1", "trainer.max_epochs=1", "env.max_steps=3",
                        "validate_before_fit=false"], tmp_path)
    assert result["counters/episodes"] == 2
