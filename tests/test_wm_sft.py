"""WM-SFT (cope.algos.rwml.wm_sft, wm_loss): the world-model samples as extra rows of a rollout minibatch, their loss
against a hand computation on one sample, micro-batches against one forward, the callback's wiring, and
``algo=wm_sft`` end to end."""
from __future__ import annotations

import dataclasses
import functools
import math
from types import SimpleNamespace

import pytest
import torch
from test_rwml import scripted_episodes
from tiny_fixtures import tiny_policy

from cope.algos.grpo import PolicyGradient
from cope.algos.rwml.prompt import DEFAULT_INSTRUCTION, WorldModelPrompt
from cope.algos.rwml.wm_loss import WM_MASK, WorldModelNLL, observation_nll
from cope.algos.rwml.wm_sft import WorldModelSFT, append_samples, build_samples
from cope.batch import collate, row_lengths
from cope.episode import Role
from cope.train.module import AgentRLModule


@pytest.fixture(scope="module")
def scripted():
    (ep,), _, tok, chat = scripted_episodes()
    return ep, tok, chat


def _module(policy, objectives, budget=None, temperature=1.0):
    module = AgentRLModule(policy, objectives, optimizer=functools.partial(torch.optim.SGD, lr=0.1),
                           max_tokens_per_microbatch=budget, temperature=temperature)
    module.manual_backward = lambda loss: loss.backward()  # no trainer here: the plain autograd call
    return module


def test_samples_are_extra_rows_with_their_targets(scripted):
    ep, tok, chat = scripted
    samples, metrics = build_samples([ep], chat, WorldModelPrompt(tok))
    assert metrics["wm/samples"] == len(samples) == 4  # the four observed steps; the malformed one has no observation
    assert tok.decode([t for t, m in zip(samples[1].tokens, samples[1].target) if m]).startswith("Wall.")
    mb = collate([ep], 0)
    out = append_samples(mb, [ep], samples, 0)
    N, T = mb["input_ids"].shape
    assert out["input_ids"].shape[0] == N + 4 and out["aux_row"].tolist() == [False] + [True] * 4
    assert torch.equal(out["input_ids"][:N, :T], mb["input_ids"]) and not out[WM_MASK][:N].any()
    for m, s in enumerate(samples):
        row = N + m
        seq = ep.tokens[: s.anchor] + s.tokens
        assert out["input_ids"][row, : len(seq)].tolist() == seq and int(out["attention_mask"][row].sum()) == len(seq)
        assert out[WM_MASK][row].nonzero().flatten().tolist() == [s.anchor + i for i, t in enumerate(s.target) if t]
        assert (out["roles"][row] == Role.PAD).all() and not out["action_mask"][row].any()
        assert int(out["episode_index"][row]) == -1 and not out["advantages"][row].any()
        text = tok.decode(s.tokens)
        assert text.startswith(DEFAULT_INSTRUCTION + "<|im_end|>\n<|im_start|>assistant\n") and text.endswith("<|im_end|>")
    last = build_samples([ep], chat, WorldModelPrompt(tok), max_per_episode=2, max_context=len(samples[-1]) - 1)
    assert [s.step for s in last[0]] == [samples[2].step] and last[1]["wm/dropped_long"] == 1  # the last 2, one too long


def test_the_loss_equals_a_hand_computation_on_one_sample(scripted):
    ep, tok, chat = scripted
    policy = tiny_policy()
    samples, _ = build_samples([ep], chat, WorldModelPrompt(tok))
    s = samples[1]
    batch = append_samples(collate([ep], 0), [ep], [s], 0)
    module = _module(policy, [WorldModelNLL(weight=1.0)], temperature=0.7)  # targets are scored untempered
    with torch.no_grad():
        loss, metrics = WorldModelNLL()(module.forward(batch), batch)
        seq = ep.tokens[: s.anchor] + s.tokens
        logp = torch.log_softmax(policy.model(input_ids=torch.tensor([seq])).logits[0].float(), dim=-1)  # (L, V)
    targets = [s.anchor + i for i, t in enumerate(s.target) if t]
    hand = -sum(float(logp[p - 1, seq[p]]) for p in targets) / len(targets)
    assert loss.item() == pytest.approx(hand, rel=1e-5) and metrics["wm/tokens"] == len(targets)
    assert tok.decode([seq[p] for p in targets]) == tok.decode(s.tokens[-len(targets):-1]) + "<|im_end|>"
    assert tok.decode([seq[p] for p in targets]).startswith("Wall. Goal:") and math.isfinite(hand)
    zero, m = observation_nll(torch.randn(2, 3, requires_grad=True), torch.zeros(2, 3, dtype=torch.bool))
    assert zero.item() == 0.0 and zero.requires_grad and m["wm/tokens"] == 0


def test_micro_batches_equal_one_forward(scripted):
    ep, tok, chat = scripted
    policy = tiny_policy()
    eps = [ep, ep]
    for e, a in zip(eps, [0.0, 0.0]):
        e.advantage = a
    mb = append_samples(collate(eps, 0), eps, build_samples(eps, chat, WorldModelPrompt(tok))[0], 0)
    objectives = lambda: [PolicyGradient(), WorldModelNLL(weight=0.5)]  # noqa: E731
    full = _module(policy, objectives())
    full.score_minibatches([mb])

    def step(module):
        module.zero_grad(set_to_none=True)
        _, total, _ = module._backward(mb)
        return total, {n: p.grad.clone() for n, p in module.named_parameters() if p.requires_grad}

    total_a, g_a = step(full)
    assert total_a.abs() > 0
    micro = _module(policy, objectives(), int(row_lengths(mb).max()))
    assert len(micro.micro_batches(mb)) > 1
    total_b, g_b = step(micro)
    torch.testing.assert_close(total_b, total_a, atol=1e-6, rtol=1e-5)
    for n in g_a:
        torch.testing.assert_close(g_b[n], g_a[n], atol=1e-6, rtol=1e-4, msg=n)


@pytest.mark.parametrize("share_prefix", [False, True])
def test_packed_samples_train_what_plain_rows_train(scripted, share_prefix):
    """``wm_sft.layout=packed`` (each sample a segment after its transcript) against one row per sample, at
    temperature 0.7 with the policy gradient on and micro-batches: the same loss and gradient, the targets scored
    untempered in both; packed forwards each transcript once (fewer tokens). With ``data.share_prefix`` the packed
    rows then join their group's trie (``pack_groups``), and still train the same."""
    from cope.train.packing.group_prefix import pack_groups

    ep, tok, chat = scripted
    policy = tiny_policy()
    eps = [dataclasses.replace(ep, advantage=a) for a in (1.0, -0.5)]  # one group: the same transcript twice
    samples = build_samples(eps, chat, WorldModelPrompt(tok))[0]
    plain = append_samples(collate(eps, 0), eps, samples, 0, "plain")
    packed = append_samples(collate(eps, 0), eps, samples, 0, "packed")
    assert "packed" in packed and packed["input_ids"].shape[0] == 2 and int(plain["aux_row"].sum()) == len(samples)
    assert int(packed["attention_mask"].sum()) < int(plain["attention_mask"].sum())  # the prefixes once
    assert int(packed[WM_MASK].sum()) == int(plain[WM_MASK].sum()) == sum(sum(s.target) for s in samples)
    assert (packed["roles"][packed[WM_MASK]] == Role.PAD).all()  # untempered, no transcript objective reads them
    if share_prefix:
        plain, packed = pack_groups(plain, eps), pack_groups(packed, eps)

    def step(batch, budget):
        module = _module(policy, [PolicyGradient(), WorldModelNLL(weight=0.5)], budget, temperature=0.7)
        module.score_minibatches([batch])
        module.zero_grad(set_to_none=True)
        _, total, metrics = module._backward(batch)
        return total, metrics, {n: p.grad.clone() for n, p in module.named_parameters() if p.requires_grad}

    total_a, m_a, g_a = step(plain, None)
    total_b, m_b, g_b = step(packed, int(row_lengths(packed).max()))
    assert total_a.abs() > 0 and float(m_a["loss/wm"]) > 0
    torch.testing.assert_close(total_b, total_a, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(m_b["loss/wm"], m_a["loss/wm"], atol=1e-6, rtol=1e-5)
    for n in g_a:
        torch.testing.assert_close(g_b[n], g_a[n], atol=1e-6, rtol=1e-4, msg=n)
    with pytest.raises(ValueError, match=r"wm_sft \(packed\) needs the 2D attention mask .* one sample layout only"):
        append_samples(packed if share_prefix else append_samples(collate(eps, 0), eps, samples, 0, "packed"),
                       eps, samples, 0, "packed")


def test_the_callback_needs_the_wm_objective():
    dm = SimpleNamespace(add_collate_transform=lambda fn: None)
    module = SimpleNamespace(objectives=[PolicyGradient()], policy=None)
    with pytest.raises(ValueError, match=r"algo\.objectives has no `wm` entry"):
        WorldModelSFT().setup(SimpleNamespace(datamodule=dm), module, "fit")
    with pytest.raises(ValueError, match=r"wm_sft\.max_per_episode"):
        WorldModelSFT(max_per_episode=0)
    with pytest.raises(ValueError, match=r"wm_sft\.layout must be one of \('packed', 'plain'\)"):
        WorldModelSFT(layout="rows")


# a maze a 150-step warm start sometimes walks validly: observations to predict in every epoch
LEARNS = ["model.warm_start_steps=150", "env.sizes=[5]", "env.min_distance=1", "validate_before_fit=false",
          "trainer.check_val_every_n_epoch=100", "callbacks.stop_token.every_n_epochs=0"]


@pytest.mark.long
@pytest.mark.parametrize("lag", [0, 1])
def test_algo_wm_sft_trains(run_train, read_metrics, tmp_path, lag):
    """Also with overlapped rollouts (data.max_lag=1): the samples are cut from the lagged epoch's episodes."""
    from safetensors.torch import load_file

    run_train(["algo=wm_sft", *LEARNS, f"data.max_lag={lag}"], tmp_path)
    cols = read_metrics(tmp_path / "csv" / "metrics.csv")
    assert max(cols.get("rollout/lag_max", [0])) == lag  # logged by lagged collection only
    assert len(cols["loss/wm"]) == 2 and all(v > 0 for v in cols["loss/wm"]) and all(v > 0 for v in cols["wm/samples"])
    assert cols["loss/wm_weighted"] == pytest.approx([0.01 * v for v in cols["loss/wm"]])
    lora_b = [v for k, v in load_file(str(tmp_path / "csv" / "adapter" / "adapter_model.safetensors")).items() if "lora_B" in k]
    assert any(v.abs().sum() > 0 for v in lora_b)
