"""Every env refuses an action that is not encodable text (an unpaired surrogate) as an invalid action.

A byte-level tokenizer can decode sampled ids to lone surrogates (``"\\ud800"``); no engine can take them
(UTF-8 encoding raises: ScienceWorld's py4j raised ``Py4JError`` and aborted the episode; the terminal ran
``north\\udcff`` as the bytes ``north\\xff``). The rule lives in :func:`cope.envs.actions.unencodable`; each
env below is the real one, built the cheap way its own test module builds it, and is skipped only when its
package (or data) is missing.
"""
from __future__ import annotations

import importlib.util
import os
import shutil
from pathlib import Path

import pytest
from alfworld_fixtures import alfworld_data  # noqa: F401 - autouse: keeps $ALFWORLD_DATA in a temp folder

from cope.envs.actions import unencodable
from cope.envs.base import Task

pytestmark = pytest.mark.long  # real env engines (a JVM, a game interpreter, a sandbox): seconds each

BAD = ("\ud800", "north\udcff")


def _has(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def _maze(_):
    from cope.envs.maze import MazeEnv

    return MazeEnv(action_parsing="project")  # projection would otherwise read "north" out of "north\udcff"


def _webshop(_):
    from cope.envs.webshop.env import WebShopEnv

    return WebShopEnv()


def _tau2(_):
    spec = importlib.util.find_spec("tau2")
    if spec is None or not (Path(spec.origin).parent / "registry.py").exists():
        pytest.skip("needs tau2-bench: pip install 'cope-trainer[tau2]'")
    from cope.envs.tau2.env import Tau2Env

    return Tau2Env()  # the mock domain with the canned user: offline


def _terminal(_):
    from cope.envs.terminal.env import TerminalEnv
    from cope.envs.terminal.sandbox import unavailable_reason

    reason = "bwrap not installed (Debian package: bubblewrap)" if shutil.which("bwrap") is None else unavailable_reason()
    if reason is not None:
        pytest.skip(f"no sandbox here: {reason}")
    return TerminalEnv(timeout_s=3)


def _alfworld(tmp):
    if not _has("alfworld"):
        pytest.skip("needs the alfworld extra (alfworld==0.4.2)")
    from cope.envs.alfworld.env import AlfWorldEnv

    return AlfWorldEnv(source="generated", task_types=["pick_and_place_simple"], cache_dir=str(tmp))


def _scienceworld(_):
    if not _has("scienceworld") or shutil.which("java") is None:
        pytest.skip("needs the scienceworld package and Java (java on PATH)")
    from cope.envs.scienceworld.env import ScienceWorldEnv

    return ScienceWorldEnv()


def _textworld(tmp):
    if not _has("textworld"):
        pytest.skip("needs the textworld package: pip install 'cope-trainer[textworld]'")
    from cope.envs.textworld.env import TextWorldEnv

    return TextWorldEnv(challenge="tw-simple", cache_dir=str(tmp))


def _appworld(_):
    root = os.environ.get("APPWORLD_ROOT", "")
    if not _has("appworld") or not root or not (Path(root) / "data" / "tasks").is_dir():
        pytest.skip("needs the appworld package and its data (APPWORLD_ROOT; docs/envs/appworld.md)")
    from cope.envs.appworld import AppWorldEnv

    return AppWorldEnv(root=root)


BUILDERS = {"maze": _maze, "webshop": _webshop, "tau2": _tau2, "terminal": _terminal, "alfworld": _alfworld,
            "scienceworld": _scienceworld, "textworld": _textworld, "appworld": _appworld}


def test_the_rule():
    assert unencodable("go north") is None and unencodable("prendre la clé 🔑") is None
    assert "U+D800" in unencodable("\ud800") and "at character 5" in unencodable("north\udcff")
    assert "U+DFFF" in unencodable("ok\udfff")


@pytest.mark.parametrize("name", BUILDERS)
def test_unencodable_action_is_invalid(name, tmp_path):
    env = BUILDERS[name](tmp_path)
    try:
        env.reset(Task(env.name, "train", 0))
        for action in BAD:
            out = env.step(action)  # before: Py4JError (scienceworld), a run command (terminal), "valid" (tau2)
            assert not out.valid and not out.done and not out.success and out.reward == 0.0
            assert out.observation == "" and out.harness == unencodable(action)
            assert out.info["timeout"] is False
        assert env._steps == len(BAD)  # they count against the budget like any action
        env.step("look")  # the episode goes on
    finally:
        env.close()


class _NoWorld:
    """Stands in for AppWorld's world where its data is missing: any code reaching it fails the test."""

    def execute(self, code: str) -> str:
        raise AssertionError(f"the action reached AppWorld's shell: {code!r}")

    def task_completed(self) -> bool:
        return False


def test_appworld_refuses_before_its_shell(tmp_path):
    from cope.envs.appworld import AppWorldEnv

    env = AppWorldEnv(root=str(tmp_path))  # light: no appworld import, no data read
    env._episode_started()
    env._world = _NoWorld()
    for action in BAD:
        out = env.step(action)
        assert not out.valid and not out.done and out.observation == "" and out.harness == unencodable(action)
