"""The example env of docs/envs/bring_your_own.md runs as the page says: native tool calls through the Qwen-style
template (token-exact against the template), and the text format on the tiny model."""
from __future__ import annotations

import re
from pathlib import Path

from tiny_fixtures import Scripted, tiny_tokenizer
from tool_templates import action_ids, call, family_tokenizer

from cope.chat import ChatFormat
from cope.chat.conformance import check_transcript, episode_messages
from cope.envs.base import Env, Task
from cope.rollout.loop import run_episodes

PAGE = Path(__file__).resolve().parents[1] / "docs" / "envs" / "bring_your_own.md"


def _notebook():
    code = re.search(r"```python\n(.*?)```", PAGE.read_text(), re.DOTALL).group(1)
    assert len(code.splitlines()) <= 60
    scope: dict = {}
    exec(compile(code, str(PAGE), "exec"), scope)  # noqa: S102 - our own documentation
    return scope["NotebookEnv"]


def test_docs_example_env_native_and_text():
    NotebookEnv = _notebook()
    env = NotebookEnv()
    assert isinstance(env, Env)
    tok = family_tokenizer("chatml-hermes")
    chat = ChatFormat.from_template(tok)
    task = Task("notebook", "train", 7)  # the password is on page 3
    script = [call("read", page=1), call("read", page=3), call("read", page=9), call("answer", password="pw7")]
    eps, stats = run_episodes([env], [task], [0], Scripted({0: [action_ids(tok, chat, a) for a in script]}), tok, chat,
                              4096, 200)
    ep = eps[0]
    assert ep.success and [s.valid for s in ep.steps] == [True, True, False, True] and stats.tool_call_errors == 1
    msgs = episode_messages(ep, tok, chat)
    assert msgs["messages"][5]["content"] == "Page 3: the password is pw7"
    assert check_transcript(tok, chat, ep, msgs["messages"], msgs["tools"]) == []
    text_env, tiny = NotebookEnv(action_format="text"), tiny_tokenizer()
    tchat = ChatFormat.from_template(tiny)
    ids = [[*tiny.encode(a, add_special_tokens=False), tchat.stop_id] for a in ("read 3", "answer pw7")]
    eps, _ = run_episodes([text_env], [task], [0], Scripted({0: ids}), tiny, tchat, 4096, 50)
    assert eps[0].success and "read <page>" in text_env.instructions
