"""Trajectories as OpenAI chat messages: ``trajectories_messages.jsonl`` (the TrajectoryTable callback) holds each picked
episode with its tool calls and tool results, the tools of its system turn, and the template renders those messages
back to the episode's own ids; ``python -m cope.callbacks.trajectory_table`` prints an SFT set of it; a resumed run
drops the lines of the epochs it runs again."""
from __future__ import annotations

import json
from types import SimpleNamespace

from tiny_fixtures import tiny_tokenizer
from tool_templates import GOOD_SCRIPT, call, family_tokenizer, run_tool_episodes

from cope.callbacks.trajectory_table import MESSAGES_FILE, TrajectoryTable, main
from cope.chat import ChatFormat
from cope.chat.conformance import check_transcript


def _trainer(tmp_path, episodes, epoch=0):
    dm = SimpleNamespace(train_record=SimpleNamespace(episodes=episodes))
    return SimpleNamespace(current_epoch=epoch, global_step=0, is_global_zero=True, log_dir=str(tmp_path),
                           default_root_dir=str(tmp_path), loggers=[], datamodule=dm)


def _episodes():
    tok = family_tokenizer("chatml-hermes")
    chat = ChatFormat.from_template(tok)
    failing = [call("add", a=2, b=4), "I am not sure.", call("finish", answer=1)]
    eps, _, _ = run_tool_episodes(tok, chat, [GOOD_SCRIPT, failing])
    return tok, chat, eps


def test_messages_file_round_trips_through_the_template(tmp_path, capsys):
    tok, chat, eps = _episodes()
    policy = SimpleNamespace(tokenizer=tok, chat=chat)
    TrajectoryTable(num_episodes=2).on_train_epoch_end(_trainer(tmp_path, eps), SimpleNamespace(policy=policy))
    records = [json.loads(ln) for ln in (tmp_path / MESSAGES_FILE).read_text().splitlines()]
    assert [(r["episode"], r["success"]) for r in records] == [(0, True), (1, False)]
    win = records[0]
    assert [m["role"] for m in win["messages"]] == ["system", "user", "assistant", "tool", "assistant", "tool",
                                                    "assistant", "tool"]
    assert win["messages"][2]["tool_calls"][0]["function"]["name"] == "add"
    assert {t["function"]["name"] for t in win["tools"]} == {"add", "lookup", "finish"}
    assert [m["role"] for m in records[1]["messages"]][4:6] == ["assistant", "user"]  # a message gets a user turn
    for r, ep in zip(records, eps):  # what the file says renders to the ids the episode trained on
        assert check_transcript(tok, chat, ep, r["messages"], r.get("tools")) == []
    main([str(tmp_path / MESSAGES_FILE), "--successes"])
    (line,) = capsys.readouterr().out.splitlines()
    assert json.loads(line) == {"messages": win["messages"], "tools": win["tools"]}


def test_text_episodes_and_resume(tmp_path):
    from tiny_fixtures import Scripted
    from tool_templates import ToolEnv

    from cope.envs.base import Task
    from cope.rollout.loop import run_episodes

    tok = tiny_tokenizer()
    chat = ChatFormat.from_template(tok)
    actor = Scripted({0: [[*tok.encode(a, add_special_tokens=False), chat.stop_id] for a in ("add 2 3", "finish 12")]})
    eps, _ = run_episodes([ToolEnv("text")], [Task("tools", "train", 3)], [0], actor, tok, chat, 4096, 50)
    cb, policy = TrajectoryTable(), SimpleNamespace(policy=SimpleNamespace(tokenizer=tok, chat=chat))
    for epoch in (0, 1):
        cb.on_train_epoch_end(_trainer(tmp_path, eps, epoch), policy)
    (rec, _) = [json.loads(ln) for ln in (tmp_path / MESSAGES_FILE).read_text().splitlines()]
    assert "tools" not in rec and rec["messages"][2] == {"role": "assistant", "content": "add 2 3"}
    assert rec["messages"][3] == {"role": "user", "content": "5"}
    cb.on_train_start(_trainer(tmp_path, eps, epoch=1), policy)  # resumed at epoch 1: its lines are written again
    assert len((tmp_path / MESSAGES_FILE).read_text().splitlines()) == 1
    assert not TrajectoryTable(messages=False).messages
