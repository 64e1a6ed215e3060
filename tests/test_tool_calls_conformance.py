"""Conformance of native tool-call transcripts: for multi-turn conversations with several calls and results, the ids
the rollout builds equal the ids of the chat template rendering the same messages (before every action and for the
whole episode), and every sampled call reads back as the call it was. Template families (tests/tool_templates.py):
ChatML with Qwen-style ``<tool_call>`` (our template and the public Qwen2.5 one in tests/fixtures/), Llama 3.1 JSON
calls with the ``ipython`` role, Mistral ``[TOOL_CALLS]``/``[TOOL_RESULTS]``; SmolLM2's own template and the tiny
model's have no tool support (text format, and a clear error for native tools). Real tokenizers run the same check
where they are in the local HF cache. The check can fail: a dropped separator, a re-serialized or re-tokenized call,
a Mistral tool list moved by a later user message."""
from __future__ import annotations

import copy
import dataclasses
from pathlib import Path

import pytest
from tiny_fixtures import Scripted, tiny_tokenizer
from tool_templates import FAMILIES, ToolEnv, action_ids, call, expected_messages, family_tokenizer, run_tool_episodes

from cope.chat import ChatFormat
from cope.chat.conformance import check_transcript, episode_messages
from cope.chat.segments import Segment, encode_segments
from cope.envs.base import Task
from cope.episode import Role
from cope.rollout.loop import run_episodes

QWEN_PUBLIC = (Path(__file__).parent / "fixtures" / "qwen2.5_chat_template.jinja").read_text()
# several calls and results, a message to the user between them, and the refusals: malformed markup, unknown tool,
# arguments failing the schema
GOOD = [call("add", a=2, b=3), call("lookup", key="alpha"), call("finish", answer=12)]
CHATTY = [call("add", a=2, b=4), "Let me look that up.", call("lookup", key="alpha"), call("finish", answer=13)]
REFUSED = [call("multiply", a=2, b=5), call("add", a="two", b=5), call("lookup", key="gamma"), call("add", a=2, b=5),
           call("finish", answer=14)]
BROKEN = {"chatml-hermes": '<tool_call>\n{"name": "add", "arguments": {"a": 2,}\n</tool_call>',
          "llama3.1": '{"name": "add", "parameters": {"a": 2,}', "mistral": '[TOOL_CALLS][{"name": "add", "argum'}


def _chat(tok):
    return ChatFormat.from_template(tok, eos_ids=None)


def _qwen_public():
    tok = copy.deepcopy(family_tokenizer("chatml-hermes"))
    tok.chat_template = QWEN_PUBLIC
    return tok


TOKENIZERS = {**{f: (lambda f=f: family_tokenizer(f)) for f in FAMILIES}, "qwen2.5-public": _qwen_public}


def _scripts(family: str) -> list[list]:
    scripts = [GOOD, REFUSED]
    if family != "mistral":  # a user turn after the first moves Mistral's tool list (test_mistral_tool_list_moves)
        scripts += [CHATTY, [BROKEN.get(family, BROKEN["chatml-hermes"]), *GOOD]]
    return scripts


def check_family(tok, family: str, **env_kwargs) -> None:
    chat = _chat(tok)
    assert chat.tools is not None, chat.tools_note
    scripts = _scripts(family)
    eps, envs, stats = run_tool_episodes(tok, chat, scripts, **env_kwargs)
    for ep, env, script in zip(eps, envs, scripts):
        assert not ep.aborted and ep.num_steps == len(script), (ep.end_reason, ep.num_steps)
        msgs, tools = expected_messages(env, script)
        assert check_transcript(tok, chat, ep, msgs, tools) == []
        assert episode_messages(ep, tok, chat) == {"messages": msgs, "tools": tools}  # the export reads it back
        for s, act in zip(ep.steps, script):  # each sampled call reads back as the call it was
            raw = tok.decode(ep.tokens[s.action_start: s.action_start + s.content_len], skip_special_tokens=False)
            reading = chat.tools.read(raw, env.TOOLS)
            assert (reading.call == act) if not isinstance(act, str) else reading.kind in ("message", "malformed")
    assert eps[0].success and all(s.valid for s in eps[0].steps)
    assert [s.valid for s in eps[1].steps] == [False, False, False, True, True] and stats.tool_call_errors >= 3
    # tool results are observations (ECHO's targets), the refusals harness text
    roles = set(eps[0].roles[eps[0].steps[0].obs_start: eps[0].steps[0].obs_end])
    assert int(Role.OBSERVATION) in roles and int(Role.ACTION) not in roles


@pytest.mark.parametrize("name", sorted(TOKENIZERS))
def test_native_transcripts_match_the_template(name):
    family = "chatml-hermes" if name == "qwen2.5-public" else name
    check_family(TOKENIZERS[name](), family)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_results_ending_in_a_newline_stay_exact(family):
    """``5\\n`` + ``\\n</tool_response>``: the split rule glues the newlines; the turn is tokenized across the cut."""
    check_family(family_tokenizer(family), family, trailing_newline=True)


def test_tokenizing_pieces_apart_would_drift():
    tok = family_tokenizer("chatml-hermes")
    text, after = "[exit code 0]", "\n</tool_response><|im_end|>"
    joint = tok(text + after, add_special_tokens=False)["input_ids"]
    apart = tok(text, add_special_tokens=False)["input_ids"] + tok(after, add_special_tokens=False)["input_ids"]
    assert joint != apart  # "]\n" is one pre-token
    ids, roles = encode_segments(tok, [Segment(text, Role.OBSERVATION, False), Segment(after, Role.PROMPT, True)])
    assert ids == joint and roles[0] == Role.OBSERVATION and roles[-1] == Role.PROMPT


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_the_check_fails_on_a_dropped_separator(family):
    tok = family_tokenizer(family)
    chat = _chat(tok)
    turns = chat.tools
    broken = dataclasses.replace(chat, tools=dataclasses.replace(turns, result_close=turns.result_close[1:]))
    eps, envs, _ = run_tool_episodes(tok, broken, [GOOD])
    msgs, tools = expected_messages(envs[0], GOOD)
    problems = check_transcript(tok, chat, eps[0], msgs, tools)
    assert problems and problems[0].startswith("before action 1")


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_the_check_fails_on_a_reserialized_or_retokenized_call(family):
    tok = family_tokenizer(family)
    chat = _chat(tok)
    text = chat.tools.call_text(GOOD[0])
    compact = text.replace(", ", ",").replace(": ", ":")
    for ids in ([*tok.encode(compact, add_special_tokens=False), chat.stop_id],  # same call, other JSON spacing
                [i for ch in text for i in tok.encode(ch, add_special_tokens=False)] + [chat.stop_id]):  # per character
        env = ToolEnv()
        actor = Scripted({0: [ids, *(action_ids(tok, chat, a) for a in GOOD[1:])]})
        eps, _ = run_episodes([env], [Task("tools", "train", 3)], [0], actor, tok, chat, 4096, 200)
        raw = tok.decode(ids[:-1], skip_special_tokens=False)
        assert chat.tools.read(raw, env.TOOLS).call == GOOD[0]  # it parses back to the same call ...
        msgs, tools = expected_messages(env, GOOD)
        assert check_transcript(tok, chat, eps[0], msgs, tools)  # ... but it is not the template's rendering


def test_mistral_tool_list_moves():
    """Mistral renders the tool list before the last user message: a user turn after the first cannot be
    prefix-preserving. The cut records it and the check shows it."""
    tok = family_tokenizer("mistral")
    chat = _chat(tok)
    assert chat.tools.tools_move and not _chat(family_tokenizer("llama3.1")).tools.tools_move
    eps, envs, _ = run_tool_episodes(tok, chat, [CHATTY])
    msgs, tools = expected_messages(envs[0], CHATTY)
    assert any("AVAILABLE_TOOLS" in p for p in check_transcript(tok, chat, eps[0], msgs, tools))


@pytest.mark.parametrize("name", ["tiny", "chatml-no-tools"])
def test_native_tools_without_tool_template_fail_naming_model_and_switch(name):
    tok = tiny_tokenizer() if name == "tiny" else copy.deepcopy(family_tokenizer("chatml-hermes"))
    if name != "tiny":
        tok.chat_template = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}" \
                            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    chat = _chat(tok)
    assert chat.tools is None and "renders no tools" in chat.tools_note
    with pytest.raises(ValueError, match="env.action_format=text") as e:
        run_episodes([ToolEnv()], [Task("tools", "train", 0)], [0], Scripted({0: [[chat.stop_id]]}), tok, chat, 4096, 20)
    assert str(tok.name_or_path) in str(e.value)


def _text_episode(tok, chat, script: list[str]):
    """One text-format episode of the tool env acting ``script``, and the messages a template would render for it."""
    env = ToolEnv(action_format="text")
    actor = Scripted({0: [[*tok.encode(a, add_special_tokens=False), chat.stop_id] for a in script]})
    eps, _ = run_episodes([env], [Task("tools", "train", 3)], [0], actor, tok, chat, 4096, 50)
    msgs = [{"role": "system", "content": env.instructions}, {"role": "user", "content": env.turns[0][0]}]
    for a, (obs, _h) in zip(script, env.turns[1:]):
        msgs += [{"role": "assistant", "content": a}, {"role": "user", "content": obs}]
    return eps, msgs


def test_text_format_transcripts_match_on_a_template_without_tools():
    """The tiny model keeps the text format: calls are plain assistant text, results user turns."""
    tok = tiny_tokenizer()
    chat = _chat(tok)
    eps, msgs = _text_episode(tok, chat, ["add 2 3", "lookup alpha", "Let me think.", "finish 12"])
    assert eps[0].success and check_transcript(tok, chat, eps[0], msgs) == []
    assert episode_messages(eps[0], tok, chat) == {"messages": msgs}


REAL = {"Qwen/Qwen2.5-0.5B-Instruct": "chatml-hermes", "meta-llama/Llama-3.1-8B-Instruct": "llama3.1"}


@pytest.mark.parametrize("model", sorted(REAL))
def test_real_tokenizer_from_the_local_cache(model):
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(model, local_files_only=True)
    except (OSError, ValueError) as e:
        pytest.skip(f"{model} is not in the local HF cache ({type(e).__name__}); the test runs where it is")
    check_family(tok, REAL[model])


@pytest.mark.long
def test_smollm2_has_no_tool_template():
    from smollm2_fixtures import smollm2_folder
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(smollm2_folder()), local_files_only=True)
    chat = _chat(tok)
    assert chat.tools is None
    with pytest.raises(ValueError, match="env.action_format=text"):
        run_episodes([ToolEnv()], [Task("tools", "train", 0)], [0], Scripted({0: [[chat.stop_id]]}), tok, chat, 4096, 20)
    eps, msgs = _text_episode(tok, chat, ["add 2 3", "lookup alpha", "finish 12"])
    assert check_transcript(tok, chat, eps[0], msgs) == []


def test_a_template_that_raises_on_tools_still_loads_for_text():
    tok = copy.deepcopy(family_tokenizer("chatml-hermes"))
    tok.chat_template = ("{% if tools %}{{ raise_exception('this model takes no tools') }}{% endif %}"
                         "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
                         "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    chat = _chat(tok)
    assert chat.tools is None and "this model takes no tools" in chat.tools_note
    assert chat.close_turn() == tok.encode("<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)
