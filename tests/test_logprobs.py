"""`cope.train.logprobs`: chunked log-probs from hidden states equal the full-logits log-softmax, in value and
gradient, with the sampling temperature on action tokens only and entropy where asked."""
from __future__ import annotations

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import Qwen2Config, Qwen2ForCausalLM

from cope.train.logprobs import causal_lm_logprobs, linear_head

V = 97


def _model(tied: bool = True, head_trainable: bool = False):
    torch.manual_seed(0)
    cfg = Qwen2Config(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                      vocab_size=V, tie_word_embeddings=tied)
    base = Qwen2ForCausalLM(cfg)
    for p in base.parameters():
        p.requires_grad_(False)
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", lora_dropout=0.0))
    for n, p in model.named_parameters():  # move the adapter off zero so gradients reach every path
        if "lora_B" in n:
            torch.nn.init.normal_(p, std=0.05)
    if head_trainable:
        model.get_base_model().lm_head.weight.requires_grad_(True)
    return model


def _batch(N=3, T=11):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, V, (N, T), generator=g)
    mask = torch.ones(N, T, dtype=torch.long)
    mask[1, 8:] = 0
    mask[2, 5:] = 0
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    act = torch.rand(N, T, generator=g) < 0.4
    act &= mask.bool()
    return ids, mask, pos, act


def _reference(model, ids, mask, pos, act, temperature):
    logits = model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=False).logits.float()  # (N, T, V)
    tau = torch.where(act[:, 1:], temperature, 1.0)[..., None]  # (N, T-1, 1)
    logp = (logits[:, :-1] / tau).log_softmax(-1)
    lp = logp.gather(-1, ids[:, 1:, None]).squeeze(-1)
    ent = -(logp.exp() * logp).sum(-1) * act[:, 1:]
    zero = lp.new_zeros(ids.shape[0], 1)
    return torch.cat([zero, lp], 1), torch.cat([zero, ent.detach()], 1)


def _grads(model, lp, weights):
    model.zero_grad(set_to_none=True)
    (lp * weights).sum().backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("chunk_elems", [2**25, 3 * V])  # one chunk; 3 tokens per chunk
@pytest.mark.parametrize("tied", [True, False])
def test_equals_full_log_softmax_in_value_and_gradient(temperature, chunk_elems, tied):
    model = _model(tied=tied)
    assert linear_head(model) is not None  # the fused path is the one under test
    ids, mask, pos, act = _batch()
    weights = torch.randn(ids.shape, generator=torch.Generator().manual_seed(2))
    want_lp, want_ent = _reference(model, ids, mask, pos, act, temperature)
    want_g = _grads(model, want_lp, weights)
    lp, ent = causal_lm_logprobs(model, ids, mask, pos, tempered=act, temperature=temperature, entropy_mask=act,
                                 chunk_elems=chunk_elems)
    assert lp.shape == ent.shape == ids.shape and lp.dtype == torch.float32
    torch.testing.assert_close(lp, want_lp.detach(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ent, want_ent, atol=1e-5, rtol=1e-5)
    assert not ent.requires_grad and (ent[~act] == 0).all()
    got_g = _grads(model, lp, weights)
    assert set(got_g) == set(want_g)
    for n in want_g:
        torch.testing.assert_close(got_g[n], want_g[n], atol=1e-5, rtol=1e-4, msg=n)


def test_temperature_applies_to_action_tokens_only():
    model = _model()
    ids, mask, pos, act = _batch()
    with torch.no_grad():
        raw, _ = causal_lm_logprobs(model, ids, mask, pos, tempered=act, temperature=1.0)
        hot, _ = causal_lm_logprobs(model, ids, mask, pos, tempered=act, temperature=0.5)
        greedy, _ = causal_lm_logprobs(model, ids, mask, pos, tempered=act, temperature=0.0)  # scored at 1
    assert torch.equal(raw[~act], hot[~act]) and not torch.allclose(raw[act], hot[act])
    assert torch.equal(greedy, raw)


@pytest.mark.parametrize("case", ["trained_tied", "trained_untied", "post_processed"])
def test_trained_head_in_value_and_gradient(case):
    """Full fine-tuning trains the output head: the chunked path gives its gradient (and the body's) too. An
    architecture that scales its logits is scored from its own logits instead (the fallback; here the scale is declared
    only, so it must equal the plain log-softmax), the head's gradient included."""
    model = _model(tied=case != "trained_untied", head_trainable=True)
    if case == "post_processed":
        model.get_base_model().config.logit_scale = 2.0
    assert (linear_head(model) is None) == (case == "post_processed")
    ids, mask, pos, act = _batch()
    weights = torch.randn(ids.shape, generator=torch.Generator().manual_seed(3))
    want_lp, want_ent = _reference(model, ids, mask, pos, act, 0.8)
    want_g = _grads(model, want_lp, weights)
    lp, ent = causal_lm_logprobs(model, ids, mask, pos, tempered=act, temperature=0.8, entropy_mask=act, chunk_elems=4 * V)
    torch.testing.assert_close(lp, want_lp.detach(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ent, want_ent, atol=1e-5, rtol=1e-5)
    got_g = _grads(model, lp, weights)
    assert any("lm_head" in n or "embed_tokens" in n for n in got_g)
    for n in want_g:  # the head's own gradient included
        torch.testing.assert_close(got_g[n], want_g[n], atol=1e-5, rtol=1e-4, msg=n)


def test_four_d_mask_is_passed_through():
    """A packed layout's additive (N, 1, T, T) mask reaches the body as the full model would get it."""
    model = _model()
    ids, mask, pos, act = _batch()
    T = ids.shape[1]
    causal = torch.tril(torch.ones(T, T, dtype=torch.bool))
    keep = causal[None] & mask.bool()[:, None, :]
    keep |= torch.eye(T, dtype=torch.bool)[None]
    m4 = torch.zeros(ids.shape[0], 1, T, T).masked_fill(~keep[:, None], torch.finfo(torch.float32).min)
    with torch.no_grad():
        want, _ = _reference(model, ids, m4, pos, act, 1.0)
        got, _ = causal_lm_logprobs(model, ids, m4, pos)
    real = mask.bool()
    torch.testing.assert_close(got[real], want[real], atol=1e-5, rtol=1e-5)
