"""The prompted forecast sample (cope.algos.cope.prompted), built token-in/token-out from real maze transcripts,
is the conversation the authors render through the chat template: ``decode(tokens[:anchor] + chunk)`` equals
``apply_chat_template`` of the same messages (system, the turns up to obs_t, the plan-ahead user turn, then the
assistant's actions joined by newlines, or one assistant turn per action with "Next action?" between them), and
the loss is exactly on the listed actions and the end of their turn (list) or of each turn (turns).

Templates: the tiny model's ChatML, the Qwen2.5 template of tests/fixtures/ on the tiny tokenizer (with Qwen's
second stop id <|endoftext|> closing one action), and SmolLM2-135M-Instruct's own (marked long: the GGUF
conversion takes ~30 s once per session)."""
from __future__ import annotations

import copy
import itertools
from pathlib import Path

import pytest
from prompted_fixtures import LIST_TEXT, TURNS_TEXT
from tiny_fixtures import Scripted, maze_tasks, tiny_tokenizer

from cope.algos.cope.prompted import PlanPrompt, build_prompted
from cope.chat import ChatFormat
from cope.envs.maze import MazeEnv
from cope.rollout.loop import run_episodes

QWEN_TEMPLATE = (Path(__file__).parents[1] / "fixtures" / "qwen2.5_chat_template.jinja").read_text()
K, MAX_ACTION = 3, 12
# Per episode: strict moves, prose (malformed, or projected under `project`), wall bumps, an action cut at the
# token cap (CAPPED: no stop id), an action closed by the second stop id (EOS:, when the format has one).
SCRIPTS = [["north", "east", "Let me think about it", "south", "west", "north"],
           ["go south", "The goal is 3 south, 1 east", "west", "EOS:east", "CAPPED", "north"],
           ["east", "east", "east", "east", "north", "south"]]


class RecordingMaze(MazeEnv):
    """The maze, keeping the text of every user turn it produced (observation and harness text)."""

    def reset(self, task):
        r = super().reset(task)
        self.turns = [self._text(r)]
        return r

    def step(self, action):
        r = super().step(action)
        self.turns.append(self._text(r))
        return r

    @staticmethod
    def _text(r) -> str:
        return r.observation + ("\n" if r.observation and r.harness else "") + r.harness


def _ids(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"]


def _script(tok, chat: ChatFormat, action: str) -> list[int]:
    if action == "CAPPED":
        return (_ids(tok, "north north north north north north") * 3)[:MAX_ACTION]
    if action.startswith("EOS:"):
        return [*_ids(tok, action[4:]), chat.stop_ids[-1]]
    return [*_ids(tok, action), chat.stop_id]


def _episodes(tok, chat: ChatFormat, parsing: str):
    envs = [RecordingMaze(sizes=[6], max_steps=6, action_parsing=parsing) for _ in SCRIPTS]
    scripts = {i: [_script(tok, chat, a) for a in s] for i, s in enumerate(SCRIPTS)}
    eps, _ = run_episodes(envs, maze_tasks(len(envs)), list(range(len(envs))), Scripted(scripts), tok, chat, 2048,
                          MAX_ACTION)
    return eps, envs


def _bare(ep, chat: ChatFormat, j: int) -> list[int]:
    """The ids the policy sampled for a_j, without a sampled stop id."""
    s = ep.steps[j]
    ids = ep.tokens[s.action_start : s.action_end]
    return ids[:-1] if s.closed else ids


def _listed(ep, t: int, invalid: str) -> list[int]:
    """The steps the sample at t lists, from the definitions (no empty actions in these scripts)."""
    ok = [s.strict for s in ep.steps]
    if invalid == "skip":
        return [j for j in range(t, ep.num_steps) if ok[j]][:K]
    window = range(t, min(t + K, ep.num_steps))
    return list(itertools.takewhile(lambda j: ok[j], window)) if invalid == "cut" else list(window)


def check_samples_match_template(tok, chat: ChatFormat, parsing: str = "strict") -> list:
    eps, envs = _episodes(tok, chat, parsing)
    nl = tok.decode(list(chat.newline))
    checked = {}
    for layout, invalid in [("list", "skip"), ("list", "mask"), ("list", "cut"), ("turns", "skip"), ("turns", "mask")]:
        chunks, _ = build_prompted(eps, chat, PlanPrompt(tok, layout), K=K, invalid=invalid, gate="all")
        prompt = LIST_TEXT if layout == "list" else TURNS_TEXT
        by_key = {(c.episode, c.step): c for c in chunks}
        for e, (ep, env) in enumerate(zip(eps, envs)):
            assert not ep.aborted and ep.num_steps >= 4
            msgs = [{"role": "system", "content": env.instructions}, {"role": "user", "content": env.turns[0]}]
            for j in range(ep.num_steps):
                msgs += [{"role": "assistant", "content": tok.decode(_bare(ep, chat, j))},
                         {"role": "user", "content": env.turns[j + 1]}]
            # The transcript keeps a sampled second stop id (Qwen's <|endoftext|>) where the template writes the
            # turn end; that is the rollout's history, as it was sampled. Compare it as the template's turn end;
            # the sample's own turns (c.tokens) are compared as they are.
            history = list(ep.tokens)
            for s in ep.steps:
                if s.closed:
                    history[s.action_end - 1] = chat.stop_id
            for t in range(ep.num_steps):
                listed = _listed(ep, t, invalid)
                sup = [j for j in listed if ep.steps[j].strict]
                c = by_key.get((e, t))
                assert (c is not None) == bool(sup), (layout, invalid, e, t)
                if c is None:
                    continue
                texts = [tok.decode(_bare(ep, chat, j)) for j in listed]
                conv = [*msgs[: 2 + 2 * t], {"role": "user", "content": prompt.format(len(listed))}]
                if layout == "list":
                    conv.append({"role": "assistant", "content": "\n".join(texts)})
                    ends = [*[list(chat.newline)] * (len(listed) - 1), list(chat.turn_end)]
                else:
                    for n, text in enumerate(texts):
                        conv += [{"role": "user", "content": "Next action?"}] * (n > 0)
                        conv.append({"role": "assistant", "content": text})
                    ends = [list(chat.turn_end)] * len(listed)
                seq = history[: c.anchor] + c.tokens
                rendered = tok.apply_chat_template(conv, tokenize=False)
                assert tok.decode(seq) + nl == rendered, (layout, invalid, e, t)
                assert _ids(tok, rendered) == seq + list(chat.newline)  # the same ids, not only the same text
                # the loss: the supervised actions, each with the token that ends it
                want = [i for j, close in zip(listed, ends) if ep.steps[j].strict for i in _bare(ep, chat, j) + close]
                assert [i for i, m in zip(c.tokens, c.target) if m] == want
                assert c.tokens[-1:] == list(chat.turn_end) and c.target[-1] == (listed[-1] in sup)
                assert c.num_actions == len(sup) and max(c.action_index) == listed[-1]
                checked[layout, invalid] = checked.get((layout, invalid), 0) + 1
        assert len(by_key) == len(chunks)
    assert min(checked.values()) >= 5 and len(checked) == 5, checked
    assert any(not s.closed for ep in eps for s in ep.steps) and any(not s.strict for ep in eps for s in ep.steps)
    return eps


@pytest.mark.parametrize("parsing", ["strict", "project"])
def test_tiny_chatml(parsing):
    tok = tiny_tokenizer()
    check_samples_match_template(tok, ChatFormat.from_template(tok), parsing)


@pytest.mark.parametrize("parsing", ["strict", "project"])
def test_qwen_template(parsing):
    tok = copy.deepcopy(tiny_tokenizer())
    tok.chat_template = QWEN_TEMPLATE
    im_end, endoftext = tok.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])
    chat = ChatFormat.from_template(tok, eos_ids=[im_end, endoftext])  # Qwen2.5's generation_config.eos_token_id
    assert chat.stop_ids == (im_end, endoftext)
    eps = check_samples_match_template(tok, chat, parsing)
    assert any(ep.tokens[s.action_end - 1] == endoftext for ep in eps for s in ep.steps)


@pytest.mark.long
def test_smollm2_template():
    from smollm2_fixtures import smollm2_folder
    from transformers import AutoTokenizer, GenerationConfig

    folder = smollm2_folder()
    tok = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    eos = GenerationConfig.from_pretrained(str(folder), local_files_only=True).eos_token_id
    chat = ChatFormat.from_template(tok, eos_ids=eos)
    assert "You are a helpful AI assistant named SmolLM" in tok.chat_template  # its own template, not ours
    check_samples_match_template(tok, chat, "project")
