"""`cope.train.module`: the scoring pass (old and reference log-probs), the first forward of an update
(ratio exactly 1, KL exactly 0 with the zero-initialized adapter), log-prob alignment, and
zero-weight objectives being skipped."""
from __future__ import annotations

import dataclasses
import functools

import pytest
import torch
from tiny_fixtures import maze_factory, maze_tasks, tiny_policy

from cope.algos.grpo import KLPenalty, PolicyGradient
from cope.batch import collate
from cope.rollout.hf_actor import CachedSamplingActor
from cope.rollout.loop import run_episodes
from cope.train.logprobs import token_logprobs
from cope.train.module import AgentRLModule
from cope.train.objectives import combine

ADVANTAGES = [1.0, -1.0, 0.5, -0.5]


@pytest.fixture(scope="module")
def policy():
    return tiny_policy(seed=0)


@pytest.fixture(scope="module")
def episodes(policy):
    chat = policy.chat
    actor = CachedSamplingActor(policy.model.eval(), policy.pad_id, chat.stop_id, max_new_tokens=5, temperature=1.0, seed=0)
    envs = [maze_factory() for _ in range(4)]
    eps, _ = run_episodes(envs, maze_tasks(2) * 2, [0, 1, 0, 1], actor, policy.tokenizer, chat, max_context=512,
                          max_action_tokens=5)
    for e, a in zip(eps, ADVANTAGES):
        e.advantage = a
    assert len({len(e.tokens) for e in eps}) > 1  # ragged: the batch has right padding
    return eps


def _logits(module, mb):
    """Full (N, T, V) logits of a plain batch: the reference the chunked log-probs must equal."""
    return module.model(input_ids=mb["input_ids"], attention_mask=mb["attention_mask"], position_ids=mb["position_ids"],
                        use_cache=False).logits


def _module(policy, kl_weight: float) -> AgentRLModule:
    return AgentRLModule(policy, [PolicyGradient(), KLPenalty(weight=kl_weight)],
                         optimizer=functools.partial(torch.optim.AdamW, lr=1e-3))


@pytest.mark.long
def test_first_update_has_ratio_one_and_zero_kl_then_kl_grows(policy, episodes):
    module = _module(policy, 0.1)
    assert module.needs_ref
    mb = collate(episodes, policy.pad_id)
    module.train()
    module.score_minibatches([mb])
    assert module.model.training  # the scoring pass runs in eval mode and restores the mode
    for k in ("old_logprobs", "old_entropy", "ref_logprobs"):
        assert mb[k].shape == mb["input_ids"].shape and mb[k].dtype == torch.float32
    # The adapter starts as the identity (peft zero-inits lora_B): reference == policy, bit for bit.
    assert torch.equal(mb["ref_logprobs"], mb["old_logprobs"])

    # Scores line up with plain unpadded forwards: position t holds log p(ids[t] | ids[:t]).
    with torch.no_grad():
        for i, e in enumerate(episodes):
            logp = policy.model(input_ids=torch.tensor([e.tokens])).logits[0].log_softmax(-1)  # (L, V)
            want = logp[:-1].gather(-1, torch.tensor(e.tokens[1:])[:, None]).squeeze(-1)  # (L-1,)
            torch.testing.assert_close(mb["old_logprobs"][i, 1:len(e.tokens)], want, atol=1e-5, rtol=1e-5)
            assert mb["old_logprobs"][i, 0] == 0

    module.train()
    out = module(mb)
    assert out.ref_logprobs is mb["ref_logprobs"]
    assert torch.equal(out.logprobs.detach(), mb["old_logprobs"])
    total, m = combine(module.objectives, out, mb, step=0)
    assert m["policy/ratio_mean"] == 1.0
    assert m["policy/clip_frac"] == 0.0
    assert m["policy/kl"] == 0.0 and m["loss/kl"] == 0.0
    # at ratio 1 the surrogate (seq-mean-token-mean, the default) is minus the mean over episodes of each
    # episode's mean advantage over its action tokens
    mask = mb["action_mask"]
    rows = mask.any(-1)
    per_row = (mb["advantages"] * mask).sum(-1)[rows] / mask.sum(-1)[rows]
    torch.testing.assert_close(m["loss/pg"], -per_row.mean())
    assert set(m) >= {"loss/pg", "loss/pg_weighted", "loss/kl", "loss/kl_weighted", "loss/total", "policy/entropy"}

    opt = module.configure_optimizers()
    assert {id(p) for g in opt.param_groups for p in g["params"]} == {id(p) for p in policy.trainable_parameters()}
    opt.zero_grad()
    total.backward()
    opt.step()

    out2 = module(mb)
    _, m2 = combine(module.objectives, out2, mb, step=1)
    assert m2["policy/kl"] > 0.0
    assert m2["policy/ratio_mean"] != 1.0
    # the reference is still the untouched base: the adapter-disabled forward reproduces the old scores
    with torch.no_grad(), policy.model.disable_adapter():
        ref_again = module.logprobs(mb, entropy=False).logprobs
        ref_full = token_logprobs(_logits(module, mb), mb["input_ids"], with_entropy=False)[0]  # the full log-softmax
    assert torch.equal(ref_again, mb["ref_logprobs"])
    real = mb["attention_mask"].bool()
    torch.testing.assert_close(ref_full[real], mb["ref_logprobs"][real], atol=1e-5, rtol=1e-5)


def test_token_logprobs_alignment_hand_check():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 5, 7, generator=g)  # (N, T, V)
    ids = torch.randint(0, 7, (2, 5), generator=g)  # (N, T)
    lp, ent = token_logprobs(logits, ids)
    assert lp.shape == ent.shape == (2, 5)
    assert (lp[:, 0] == 0).all() and (ent[:, 0] == 0).all()
    for i in range(2):
        for t in range(1, 5):
            logp = torch.log_softmax(logits[i, t - 1], -1)  # the prediction made at t-1
            torch.testing.assert_close(lp[i, t], logp[ids[i, t]])
            torch.testing.assert_close(ent[i, t], -(logp.exp() * logp).sum())
    # gradient flows to the logits through log-probs, not through the (detached) entropy
    x = logits.clone().requires_grad_(True)
    lp, ent = token_logprobs(x, ids)
    assert lp.requires_grad and not ent.requires_grad


def test_zero_weight_objective_is_skipped(policy, episodes):
    module = _module(policy, 0.0)
    assert not module.needs_ref
    mb = collate(episodes, policy.pad_id)
    module.score_minibatches([mb])
    assert "ref_logprobs" not in mb  # no reference forward for an objective that is off
    module.manual_backward = lambda loss: loss.backward()  # no Trainer: the plain autograd call
    policy.model.zero_grad(set_to_none=True)
    _, _, result = module._backward(mb)  # what training_step logs
    assert "loss/kl" not in result and "loss/kl_weighted" not in result and "policy/kl" not in result
    assert "loss/pg" in result and any(p.grad is not None for p in policy.trainable_parameters())
    policy.model.zero_grad(set_to_none=True)

    # a scheduled weight that reaches 0 switches the term off from that step on
    kl = KLPenalty(weight=0.1, schedule="linear", final_weight=0.0, schedule_steps=10)
    out = dataclasses.replace(module(mb), ref_logprobs=mb["old_logprobs"])
    _, on = combine([PolicyGradient(), kl], out, mb, step=5)
    _, off = combine([PolicyGradient(), kl], out, mb, step=10)
    assert on["weight/kl"] == pytest.approx(0.05) and "loss/kl" in on
    assert "loss/kl" not in off and "weight/kl" not in off


def test_kl_ramping_up_from_zero_gets_its_reference(policy, episodes):
    """A KL weight scheduled 0 -> 0.1 is off at step 0 but on later in the same epoch: the scoring
    pass (once per epoch) must already compute the reference log-probs."""
    kl = KLPenalty(weight=0.0, schedule="linear", final_weight=0.1, schedule_steps=10)
    module = AgentRLModule(policy, [PolicyGradient(), kl], optimizer=functools.partial(torch.optim.AdamW, lr=1e-3))
    assert module.needs_ref
    mb = collate(episodes, policy.pad_id)
    module.score_minibatches([mb])
    assert "ref_logprobs" in mb
    out = module(mb)
    _, m0 = combine(module.objectives, out, mb, step=0)
    _, m5 = combine(module.objectives, out, mb, step=5)
    assert "loss/kl" not in m0 and m5["weight/kl"] == pytest.approx(0.05) and "loss/kl" in m5


def test_module_rejects_bad_objective_lists(policy):
    opt = functools.partial(torch.optim.AdamW, lr=1e-3)
    with pytest.raises(ValueError, match="empty"):
        AgentRLModule(policy, [], optimizer=opt)
    with pytest.raises(ValueError, match="duplicate"):
        AgentRLModule(policy, [PolicyGradient(), PolicyGradient()], optimizer=opt)


def test_scores_follow_the_sampling_temperature(policy, episodes, compose, tmp_path):
    """Rollouts sampled at temperature T are scored under softmax(logits / T) at action tokens (the PPO
    ratio then refers to the policy that sampled them); every other position keeps the raw distribution.
    The module's temperature is the data's sampling temperature by config."""
    assert compose(["data.sampling.temperature=0.6"], tmp_path).module.temperature == 0.6
    mb = collate(episodes, policy.pad_id)
    module = AgentRLModule(policy, [PolicyGradient()], optimizer=functools.partial(torch.optim.AdamW, lr=1e-3),
                           temperature=0.6)
    module.score_minibatches([mb])
    with torch.no_grad():
        logits = _logits(module, mb)[:, :-1].float()  # (N, T-1, V)
    ids, act, real = mb["input_ids"][:, 1:], mb["action_mask"][:, 1:], mb["attention_mask"][:, 1:].bool()
    hot = (logits / 0.6).log_softmax(-1).gather(-1, ids[..., None]).squeeze(-1)
    raw = logits.log_softmax(-1).gather(-1, ids[..., None]).squeeze(-1)
    got = mb["old_logprobs"][:, 1:]
    assert act.any() and (real & ~act).any()
    torch.testing.assert_close(got[act], hot[act], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got[real & ~act], raw[real & ~act], atol=1e-5, rtol=1e-5)
    ent = -((logits / 0.6).log_softmax(-1).exp() * (logits / 0.6).log_softmax(-1)).sum(-1)
    torch.testing.assert_close(mb["old_entropy"][:, 1:][act], ent[act], atol=1e-5, rtol=1e-5)
    assert (mb["old_entropy"][:, 1:][~act] == 0).all()  # entropy only where a consumer reads it
    out = module(mb)  # the first forward of the update: ratio exactly 1 at T != 1 too
    _, m = combine(module.objectives, out, mb, step=0)
    assert m["policy/ratio_mean"] == 1.0
