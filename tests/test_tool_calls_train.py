"""Native tool calls through the real entry point: the tiny model given a tool template (`model.chat_template=
chatml-hermes`, ChatML with Qwen2.5's tool format) trains the terminal env in `env.action_format=native` under
debug=fast, and a transcript built with that run's own tokenizer renders back through that template to the same ids
(the terminal task's reference solution as native calls). Without the template the run is refused before any work."""
from __future__ import annotations

import pytest
from tiny_fixtures import Scripted
from tool_templates import action_ids

from cope.chat.calls import ToolCall
from cope.chat.conformance import check_transcript, episode_messages
from cope.envs.base import Task
from cope.rollout.loop import run_episodes

NATIVE = ["env=terminal", "env.action_format=native", "model.chat_template=chatml-hermes"]


def _sandbox():
    from cope.envs.terminal.sandbox import unavailable_reason

    if unavailable_reason("bwrap"):
        pytest.skip(f"no bubblewrap sandbox: {unavailable_reason('bwrap')}")


@pytest.mark.long
def test_native_tool_calls_train_and_render_back_to_the_same_ids(run_train, compose, read_metrics, tmp_path):
    _sandbox()
    result = run_train([*NATIVE, "trainer.max_epochs=2"], tmp_path)
    assert result["counters/episodes"] == 2 * 2 * 4
    cols = read_metrics(tmp_path / "csv" / "metrics.csv")
    assert cols.get("loss/pg") and "env/tool_call_errors" in cols, sorted(cols)
    assert (tmp_path / "csv" / "trajectories_messages.jsonl").stat().st_size > 0

    from hydra.utils import instantiate

    from cope.envs.terminal.env import TerminalEnv

    cfg = compose(NATIVE, tmp_path)
    policy = instantiate(cfg.model)(env_factory=instantiate(cfg.env))  # the run's tiny model (cached), its template
    tok, chat = policy.tokenizer, policy.chat
    assert chat.tools is not None
    ref = TerminalEnv(action_format="native", max_steps=12)
    ref.reset(Task("terminal", "train", 0))
    steps = [ToolCall("bash", {"command": c}) for c in ref.reference_solution()[:-1]] + [ToolCall("submit", {})]
    ref.close()
    eps, stats = run_episodes([TerminalEnv(action_format="native", max_steps=12)], [Task("terminal", "train", 0)], [0],
                              Scripted({0: [action_ids(tok, chat, a) for a in steps]}), tok, chat, 8192, 400)
    assert eps[0].success and stats.tool_call_errors == 0, [s.action_text for s in eps[0].steps]
    msgs = episode_messages(eps[0], tok, chat)
    assert msgs["tools"] and check_transcript(tok, chat, eps[0], msgs["messages"], msgs["tools"]) == []


def test_native_tool_calls_without_a_tool_template_are_refused_before_any_work(compose, tmp_path):
    from cope.run.config_check import check_config
    from cope.run.config_keys import ConfigError

    with pytest.raises(ConfigError, match="env.action_format = native"):
        check_config(compose(NATIVE[:2], tmp_path))
    check_config(compose(NATIVE, tmp_path))  # the shipped tool template passes
    with pytest.raises(ValueError, match="model.chat_template = 'nope'"):
        from cope.chat.templates import chat_template

        chat_template("nope")


@pytest.mark.long
def test_tau2_native_tool_calls_train(run_train, read_metrics, tmp_path):
    """tau2 (its canned user) with native tool calls: the tool results are the observations ECHO would train."""
    pytest.importorskip("tau2")
    result = run_train(["env=tau2", "env.action_format=native", "model.chat_template=chatml-hermes", "algo=echo",
                        "trainer.max_epochs=2"], tmp_path)
    assert result["counters/episodes"] == 2 * 2 * 4
    cols = read_metrics(tmp_path / "csv" / "metrics.csv")
    assert cols.get("loss/pg") and cols.get("loss/echo") and all(v > 0 for v in cols["loss/echo"]), sorted(cols)
