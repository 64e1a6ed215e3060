"""`cope.train.logprobs.causal_lm_predictions`: chunked, untempered teacher-forced log-probs and argmax
predictions equal a full-vocabulary log-softmax and argmax, on the fused frozen-head path and the fallback."""
from __future__ import annotations

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import Qwen2Config, Qwen2ForCausalLM

from cope.train.logprobs import causal_lm_predictions, linear_head

V = 97


def _model(tied: bool = True, head_trainable: bool = False, zero_head: bool = False):
    torch.manual_seed(0)
    cfg = Qwen2Config(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                      vocab_size=V, tie_word_embeddings=tied)
    base = Qwen2ForCausalLM(cfg).eval()
    if zero_head:  # every logit equal: the argmax is a tie over the whole vocabulary
        torch.nn.init.zeros_(base.lm_head.weight)
    for p in base.parameters():
        p.requires_grad_(False)
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", lora_dropout=0.0))
    for n, p in model.named_parameters():  # a non-zero adapter, so the scored model is the adapted one
        if "lora_B" in n:
            torch.nn.init.normal_(p, std=0.05)
    if head_trainable:
        model.get_base_model().lm_head.weight.requires_grad_(True)
    return model.eval()


def _batch(N=3, T=11):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, V, (N, T), generator=g)
    mask = torch.ones(N, T, dtype=torch.long)
    mask[1, 8:] = 0
    mask[2, 5:] = 0
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    return ids, mask, pos


@pytest.mark.parametrize("chunk_elems", [2**25, 3 * V, 1])  # one chunk; 3 positions per chunk; one each
@pytest.mark.parametrize("head", ["frozen", "trainable", "zero"])
def test_equals_full_softmax(chunk_elems, head):
    model = _model(tied=head != "zero", head_trainable=head == "trainable", zero_head=head == "zero")
    assert linear_head(model) is not None
    ids, mask, pos = _batch()
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=False).logits.float()  # (N, T, V)
    ref_lp = logits[:, :-1].log_softmax(-1).gather(-1, ids[:, 1:, None]).squeeze(-1)  # (N, T-1)
    ref_pred = logits[:, :-1].argmax(-1)  # (N, T-1)
    lp, pred = causal_lm_predictions(model, ids, mask, pos, chunk_elems=chunk_elems)
    assert lp.shape == pred.shape == ids.shape and lp.dtype == torch.float32 and pred.dtype == torch.long
    assert (lp[:, 0] == 0).all() and (pred[:, 0] == -1).all()
    torch.testing.assert_close(lp[:, 1:], ref_lp, atol=1e-5, rtol=0)
    assert torch.equal(pred[:, 1:], ref_pred)
    if head == "zero":
        assert (pred[:, 1:] == 0).all()  # a tie resolves to the first id, as the full argmax does


def test_no_graph():
    """Evaluation scores: no autograd graph is kept, although the adapter's parameters require grad."""
    model = _model()
    assert any(p.requires_grad for p in model.parameters())
    lp, _ = causal_lm_predictions(model, *_batch())
    assert not lp.requires_grad and lp.grad_fn is None
