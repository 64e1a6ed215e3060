"""The chat scaffold comes from the model's own chat template (`cope.chat.ChatFormat.from_template`), and
token-in/token-out still holds: a maze transcript's ids equal the tokenized template rendering of the same
messages (``tokenizer(apply_chat_template(messages))``), before every action and for the whole episode.

Templates: the tiny model's ChatML; a Qwen2.5-style one (the public Qwen2.5-Instruct template string in
tests/fixtures/, on the tiny tokenizer, which has the same ChatML special tokens; Qwen's template injects a
default system prompt when there is none, we always give one); and SmolLM2-135M-Instruct's own (the
converted GGUF tokenizer; marked long: the conversion takes ~30 s once per session)."""
from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from tiny_fixtures import Scripted, maze_tasks, tiny_base, tiny_tokenizer

from cope.chat import ChatFormat
from cope.envs.maze import MazeEnv
from cope.rollout.hf_actor import CachedSamplingActor
from cope.rollout.loop import run_episodes

QWEN_TEMPLATE = (Path(__file__).parent / "fixtures" / "qwen2.5_chat_template.jinja").read_text()
MAX_CONTEXT, MAX_ACTION = 2048, 12
# Per episode: strict moves, prose (malformed), a wall bump, an action cut at the token cap (no stop id).
SCRIPTS = [["north", "east", "Let me think about it", "south", "west", "north"],
           ["go south", "The goal is 3 south, 1 east", "west", "east", "CAPPED", "north"],
           ["east", "east", "east", "east", "north", "south"]]


class RecordingMaze(MazeEnv):
    """The maze, keeping the text of every turn it produced (user messages of the conversation)."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.turns: list[str] = []

    @staticmethod
    def _text(r) -> str:
        return r.observation + ("\n" if r.observation and r.harness else "") + r.harness

    def reset(self, task):
        r = super().reset(task)
        self.turns = [self._text(r)]
        return r

    def step(self, action):
        r = super().step(action)
        self.turns.append(self._text(r))
        return r


def _ids(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"]


def _episodes(tok, chat: ChatFormat, parsing: str = "strict"):
    envs = [RecordingMaze(sizes=[6], max_steps=6, action_parsing=parsing) for _ in SCRIPTS]
    stop = chat.stop_id
    scripts = {k: [(_ids(tok, "north north north north north north") * 3)[:MAX_ACTION] if a == "CAPPED"
                   else [*_ids(tok, a), stop] for a in s] for k, s in enumerate(SCRIPTS)}
    eps, _ = run_episodes(envs, maze_tasks(len(envs)), list(range(len(envs))), Scripted(scripts), tok, chat,
                          MAX_CONTEXT, MAX_ACTION)
    return eps, envs


def _messages(env: RecordingMaze, ep, tok) -> list[dict]:
    msgs = [{"role": "system", "content": env.instructions}, {"role": "user", "content": env.turns[0]}]
    for s, feedback in zip(ep.steps, env.turns[1:]):
        closed = s.closed
        ids = ep.tokens[s.action_start:s.action_end - (1 if closed else 0)]
        msgs.append({"role": "assistant", "content": tok.decode(ids)})
        if s.obs_start >= 0:
            msgs.append({"role": "user", "content": feedback})
    return msgs


def _template_ids(tok, msgs, generation_prompt: bool) -> list[int]:
    text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=generation_prompt)
    ids = _ids(tok, text)
    direct = tok.apply_chat_template(msgs, tokenize=True, add_generation_prompt=generation_prompt)
    direct = direct["input_ids"] if hasattr(direct, "keys") else direct
    assert list(direct) == ids  # the template's own tokenization agrees (no BOS added on top)
    return ids


def check_transcripts_match_template(tok, chat: ChatFormat, parsing: str = "strict") -> None:
    eps, envs = _episodes(tok, chat, parsing)
    checked = 0
    for ep, env in zip(eps, envs):
        assert not ep.aborted and ep.num_steps >= 3
        msgs = _messages(env, ep, tok)
        for k, s in enumerate(ep.steps):  # the context the policy saw before action k
            upto = msgs[: 2 + 2 * k]
            assert _template_ids(tok, upto, True) == ep.tokens[: s.action_start], (k, upto[-1])
            checked += 1
        # the whole episode: the template closes the last turn with end + newline, the transcript with end
        full = _template_ids(tok, msgs, False)
        assert full == ep.tokens + list(chat.newline)
    assert checked >= 12
    assert any(not s.closed for e in eps for s in e.steps) and any(not s.valid for e in eps for s in e.steps)


def test_tiny_template_gives_the_chatml_pieces():
    tok = tiny_tokenizer()
    fmt = ChatFormat.from_template(tok, eos_ids=ChatFormat.chatml(tok).stop_id)
    assert fmt == ChatFormat.chatml(tok) and fmt.stop_ids == (fmt.stop_id,)


def test_tiny_template_transcripts():
    tok = tiny_tokenizer()
    check_transcripts_match_template(tok, ChatFormat.from_template(tok))


def _qwen_tokenizer():
    tok = copy.deepcopy(tiny_tokenizer())
    tok.chat_template = QWEN_TEMPLATE
    return tok


def test_qwen_template_pieces_and_stop_ids():
    tok = _qwen_tokenizer()
    im_end, endoftext = tok.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])
    fmt = ChatFormat.from_template(tok, eos_ids=[im_end, endoftext])  # Qwen2.5's generation_config.eos_token_id
    assert fmt.stop_id == im_end and fmt.stop_ids == (im_end, endoftext)
    assert fmt.system_open == tuple(_ids(tok, "<|im_start|>system\n"))
    assert fmt.turn_end + fmt.newline + fmt.assistant_open == tuple(_ids(tok, "<|im_end|>\n<|im_start|>assistant\n"))
    # without a system message Qwen injects its default one; we always give one
    default = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    assert "You are Qwen" in default


@pytest.mark.parametrize("parsing", ["strict", "project"])
def test_qwen_template_transcripts(parsing):
    tok = _qwen_tokenizer()
    im_end, endoftext = tok.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])
    check_transcripts_match_template(tok, ChatFormat.from_template(tok, eos_ids=[im_end, endoftext]), parsing)


def test_second_stop_id_closes_the_turn():
    """An action ended by another eos id (Qwen's <|endoftext|>) is closed: no <|im_end|> is added after it."""
    tok = _qwen_tokenizer()
    im_end, endoftext = tok.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])
    chat = ChatFormat.from_template(tok, eos_ids=[im_end, endoftext])
    actor = Scripted({0: [[*_ids(tok, "north"), endoftext]], 1: [[*_ids(tok, "north"), im_end]]})
    eps, _ = run_episodes([MazeEnv(sizes=[6], max_steps=3) for _ in range(2)], maze_tasks(2), [0, 1], actor, tok, chat,
                          MAX_CONTEXT, MAX_ACTION)
    for ep, end in zip(eps, (endoftext, im_end)):
        s = ep.steps[0]
        assert s.closed and ep.tokens[s.action_end - 1] == end and s.action_text == "north"
        assert ep.tokens[s.action_end: s.action_end + len(chat.newline)] == list(chat.newline)  # no extra turn end


def test_sampler_stops_on_any_stop_id():
    tok = tiny_tokenizer()
    chat = ChatFormat.from_template(tok)
    model = tiny_base(seed=0, initializer_range=0.5, tie_word_embeddings=False)
    ctx = [[*chat.system_open, *_ids(tok, "Find the goal."), *chat.close_turn()]]
    free = CachedSamplingActor(model, tok.pad_token_id, chat.stop_id, 6, temperature=0.0)(ctx)[0]
    first = free[0]
    assert first != chat.stop_id and len(free) > 1, free  # greedy does not stop at once here
    stopped = CachedSamplingActor(model, tok.pad_token_id, (chat.stop_id, first), 6, temperature=0.0)(ctx)[0]
    assert stopped == [first]
    with torch.no_grad():
        again = CachedSamplingActor(model, tok.pad_token_id, [chat.stop_id], 6, temperature=0.0)(ctx)[0]
    assert again == free  # a one-element tuple is the single stop id


def test_untemplated_shapes_are_refused():
    tok = copy.deepcopy(tiny_tokenizer())
    tok.chat_template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    with pytest.raises(ValueError, match="special token"):
        ChatFormat.from_template(tok)


@pytest.mark.long
@pytest.mark.parametrize("parsing", ["strict", "project"])
def test_smollm2_template_transcripts(parsing):
    from smollm2_fixtures import smollm2_folder
    from transformers import AutoTokenizer, GenerationConfig

    folder = smollm2_folder()
    tok = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    eos = GenerationConfig.from_pretrained(str(folder), local_files_only=True).eos_token_id
    chat = ChatFormat.from_template(tok, eos_ids=eos)
    assert chat.stop_ids == (tok.convert_tokens_to_ids("<|im_end|>"),)
    assert "You are a helpful AI assistant named SmolLM" in tok.chat_template  # its own template, not ours
    check_transcripts_match_template(tok, chat, parsing)
