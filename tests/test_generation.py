"""`cope.rollout.hf_actor`: the cross-turn KV-cached actor matches plain full-context greedy decoding,
also while rows drop out; `sample_next` keeps only the nucleus and is argmax at temperature 0."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from tiny_fixtures import maze_tasks, tiny_chat, tiny_policy, tiny_tokenizer

from cope.envs.maze import MazeEnv
from cope.rollout.hf_actor import CachedSamplingActor, cache_kwarg, sample_next
from cope.rollout.loop import run_episodes

MAX_ACTION = 6
MAX_CONTEXT = 1024


@pytest.fixture(scope="module")
def model():
    """A tiny policy whose greedy output depends on the context (so a broken cache shows).

    The default tiny init (std 0.02, tied embeddings) mostly repeats the last input token whatever
    the history; a wide init, an untied head, a stop row scaled up (so some actions stop early and
    others hit the cap) and a non-zero adapter make the choice depend on the whole context."""
    pol = tiny_policy(seed=0, initializer_range=0.5, tie_word_embeddings=False)
    m = pol.model.eval()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        m.get_output_embeddings().weight[tiny_chat().stop_id] *= 2.0
        for n, p in m.named_parameters():
            if "lora_B" in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    return m


class FullContextGreedy:
    """Reference: one plain forward over the whole unpadded context per new token, no cache, no batch."""

    def __init__(self, model, stop_id: int, max_new_tokens: int):
        self.model, self.stop_id, self.max_new_tokens = model, stop_id, max_new_tokens

    @torch.no_grad()
    def __call__(self, contexts, admissible=None, keys=None):
        out = []
        for ctx in contexts:
            ids, new = list(ctx), []
            for _ in range(self.max_new_tokens):
                logits = self.model(input_ids=torch.tensor([ids])).logits[0, -1]  # (V,)
                t = int(logits.argmax())
                new.append(t)
                ids.append(t)
                if t == self.stop_id:
                    break
            out.append(new)
        return out


def _run(actor, max_steps: list[int]):
    tok, chat = tiny_tokenizer(), tiny_chat()
    envs = [MazeEnv(sizes=[6], max_steps=k) for k in max_steps]
    eps, _ = run_episodes(envs, maze_tasks(len(envs)), list(range(len(envs))), actor, tok, chat, MAX_CONTEXT, MAX_ACTION)
    return eps


@pytest.mark.long
@pytest.mark.parametrize("max_steps", [[6, 6, 6], [8, 3, 5, 4]], ids=["lockstep", "rows-drop-out"])
def test_cached_greedy_equals_full_context_reference(model, max_steps):
    tok, chat = tiny_tokenizer(), tiny_chat()
    cached = _run(CachedSamplingActor(model, tok.pad_token_id, chat.stop_id, MAX_ACTION, temperature=0.0), max_steps)
    ref = _run(FullContextGreedy(model, chat.stop_id, MAX_ACTION), max_steps)
    assert [e.num_steps for e in cached] == max_steps  # rows leave the batch after 3, 4, 5 and 8 turns
    for c, r in zip(cached, ref):
        assert c.tokens == r.tokens
        assert c.roles == r.roles
    # The comparison has teeth: actions vary, some stop early, some hit the cap.
    actions = [tuple(c.tokens[s.action_start:s.action_end]) for c in cached for s in c.steps]
    assert len(set(actions)) > len(actions) // 2
    closed = [s.closed for c in cached for s in c.steps]
    assert any(closed) and not all(closed)


def test_broken_cache_would_be_caught(model):
    """Sanity of the reference test: decoding without the history gives different actions."""
    tok, chat = tiny_tokenizer(), tiny_chat()

    class Forgetful(CachedSamplingActor):
        def __call__(self, contexts, admissible=None, keys=None):
            self.reset()  # drop the cache, keep only the last 8 tokens of each context
            return super().__call__([c[-8:] for c in contexts], admissible, keys)

    ref = _run(FullContextGreedy(model, chat.stop_id, MAX_ACTION), [4, 4])
    bad = _run(Forgetful(model, tok.pad_token_id, chat.stop_id, MAX_ACTION, temperature=0.0), [4, 4])
    assert any(b.tokens != r.tokens for b, r in zip(bad, ref))


def test_shrinking_context_is_rejected(model):
    tok, chat = tiny_tokenizer(), tiny_chat()
    actor = CachedSamplingActor(model, tok.pad_token_id, chat.stop_id, 2, temperature=0.0)
    ctx = [1, 290, 201, 30, 31, 2, 201, 1, 295, 201]
    first = actor([ctx], keys=[0])
    with pytest.raises(ValueError, match="shrank"):
        actor([ctx[:3]], keys=[0])
    assert len(first[0]) <= 2


class PastKeyValuesLM(torch.nn.Module):
    """The model as transformers releases before the ``cache`` rename call it (5.17 on GPU images):
    forward takes ``past_key_values=`` and returns ``.past_key_values``."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None, use_cache=None,
                logits_to_keep=0):
        out = self.inner(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, cache=past_key_values,
                         use_cache=use_cache, logits_to_keep=logits_to_keep)
        return SimpleNamespace(logits=out.logits, past_key_values=out.cache)


def test_actor_speaks_the_older_cache_keyword(model):
    """The same greedy actions through a model whose forward names its KV cache ``past_key_values``."""
    tok, chat = tiny_tokenizer(), tiny_chat()
    old = PastKeyValuesLM(model)
    assert cache_kwarg(model) == "cache" and cache_kwarg(old) == "past_key_values"
    ctxs = [[1, 290, 201, 30, 31, 2, 201, 1, 295, 201], [1, 290, 201, 2, 201, 1, 295, 201, 30]]
    new_ids = CachedSamplingActor(model, tok.pad_token_id, chat.stop_id, MAX_ACTION, temperature=0.0)(ctxs)
    old_ids = CachedSamplingActor(old, tok.pad_token_id, chat.stop_id, MAX_ACTION, temperature=0.0)(ctxs)
    assert old_ids == new_ids and all(len(a) > 0 for a in new_ids)


# probs 0.15, 0.50, 0.05, 0.30 (unsorted on purpose, so the scatter back to vocab order is exercised)
PROBS = torch.tensor([0.15, 0.50, 0.05, 0.30])


@pytest.mark.parametrize(
    "top_p, nucleus",
    [
        (0.4, {1}),  # 0.50 alone reaches 0.4
        (0.7, {1, 3}),  # 0.50 + 0.30 = 0.80 >= 0.7
        (0.9, {1, 3, 0}),  # 0.80 < 0.9, + 0.15 = 0.95
        (1.0, {0, 1, 2, 3}),
    ],
)
def test_top_p_keeps_only_the_nucleus(top_p, nucleus):
    logits = PROBS.log().repeat(2, 1)  # (2, V): two rows share one draw call
    g = torch.Generator().manual_seed(0)
    draws = torch.stack([sample_next(logits, 1.0, top_p, g) for _ in range(1500)])  # (1500, 2)
    seen = set(draws.flatten().tolist())
    assert seen == nucleus
    # inside the nucleus the renormalized probabilities are kept
    kept = PROBS[sorted(nucleus)].sum()
    for t in nucleus:
        freq = (draws == t).float().mean().item()
        assert freq == pytest.approx((PROBS[t] / kept).item(), abs=0.05)


def test_temperature_zero_is_argmax():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(16, 50, generator=g)
    state = g.get_state()
    for top_p in (1.0, 0.3):
        assert torch.equal(sample_next(logits, 0.0, top_p, g), logits.argmax(-1))
    assert torch.equal(g.get_state(), state)  # greedy draws no random numbers
    # a near-zero temperature is (almost surely) argmax too
    assert torch.equal(sample_next(logits, 1e-4, 1.0, g), logits.argmax(-1))


@pytest.mark.parametrize("temperature", [0.0, 0.7, 1.0])
def test_logprobs_come_with_the_same_draw(temperature):
    """``logprobs=True`` draws the same tokens from the same generator state, with each token's log-prob under the
    tempered whole-vocabulary softmax (the one the trainer scores); nucleus log-probs are refused."""
    logits = torch.randn(8, 5000, generator=torch.Generator().manual_seed(1)) * 4  # (B, V): some tiny probabilities
    tok = sample_next(logits, temperature, 1.0, torch.Generator().manual_seed(3))
    tok2, lp = sample_next(logits, temperature, 1.0, torch.Generator().manual_seed(3), logprobs=True)
    assert torch.equal(tok, tok2)
    want = torch.log_softmax(logits.double() / (temperature or 1.0), -1).gather(-1, tok[:, None]).squeeze(-1)
    assert torch.allclose(lp.double(), want, atol=1e-5) and bool(torch.isfinite(lp).all())
    with pytest.raises(ValueError, match="top_p = 1"):
        sample_next(logits, 0.7, 0.9, logprobs=True)


def test_sampling_is_reproducible_with_a_seed(model):
    tok, chat = tiny_tokenizer(), tiny_chat()
    ctx = [[1, 290, 201, 30, 31, 2, 201, 1, 295, 201], [1, 290, 201, 40, 2, 201, 1, 295, 201]]
    a = CachedSamplingActor(model, tok.pad_token_id, chat.stop_id, MAX_ACTION, temperature=1.0, seed=3)
    b = CachedSamplingActor(model, tok.pad_token_id, chat.stop_id, MAX_ACTION, temperature=1.0, seed=3)
    assert a(ctx) == b(ctx)
