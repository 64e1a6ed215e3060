"""`cope.algos.cope.temporal_ensemble`: the closed-form full-vocabulary KL against a dense q, top-M at selected
positions against a full softmax, member selection by real step index, and the merge of members by token id."""
from __future__ import annotations

import pytest
import torch
from forecast_fixtures import CHAT, make_episode
from tiny_fixtures import tiny_base, wrap_lora

from cope.algos.cope.chunks import ForecastChunk, build_chunks
from cope.algos.cope.temporal_ensemble import (
    MemberTokens,
    action_spans,
    ensemble_targets,
    forecast_batch,
    member_positions,
    te_kl,
    topm_at_positions,
)

V, M = 50, 8


def _qf(P, g, dtype):
    """Random truncated member mixtures: the top-M of a random distribution over V (mass < 1), some rows padded."""
    full = torch.rand(P, V, generator=g, dtype=dtype) ** 4
    full = full / full.sum(-1, keepdim=True)
    probs, ids = full.topk(M, dim=-1)  # (P, M)
    ids[1, 5:], probs[1, 5:] = -1, 0.0  # a short list
    ids[2], probs[2] = -1, 0.0  # no entry at all
    return ids, probs


def _dense_kl(rows, ids, probs, eta, logp0):
    """KL(pi || q) with q built over the whole vocabulary."""
    logpi = rows.log_softmax(-1)
    qf = torch.zeros_like(logpi).scatter_add(-1, ids.clamp(min=0), torch.where(ids >= 0, probs, 0.0))
    Z = (1 - eta) + eta * qf.sum(-1, keepdim=True)
    q = ((1 - eta) * logp0.exp() + eta * qf) / Z
    return (logpi.exp() * (logpi - q.log())).sum(-1).mean()


@pytest.mark.parametrize("dtype,atol", [(torch.float64, 1e-5), (torch.float32, 1e-4)])
@pytest.mark.parametrize("eta", [0.0, 0.25, 0.5, 0.9])
@pytest.mark.parametrize("own_p0", [True, False])
def test_te_kl_matches_dense_q(dtype, atol, eta, own_p0):
    g = torch.Generator().manual_seed(0)
    P = 6
    ids, probs = _qf(P, g, dtype)
    base = torch.randn(P, V, generator=g, dtype=dtype) * 3
    other = (torch.randn(P, V, generator=g, dtype=dtype) * 3).log_softmax(-1)
    rows = base.clone().requires_grad_(True)
    logp0 = None if own_p0 else other
    kl, metrics = te_kl(rows, ids, probs, eta, p0_logprobs=logp0)
    (grad,) = torch.autograd.grad(kl, rows)
    ref_rows = base.clone().requires_grad_(True)
    ref = _dense_kl(ref_rows, ids, probs, eta, ref_rows.log_softmax(-1).detach() if own_p0 else other)
    (ref_grad,) = torch.autograd.grad(ref, ref_rows)
    torch.testing.assert_close(kl.detach(), ref.detach(), atol=atol, rtol=0)
    torch.testing.assert_close(grad, ref_grad, atol=atol, rtol=0)
    mass = torch.where(ids >= 0, probs, 0.0).sum(-1)
    share = (eta * mass / ((1 - eta) + eta * mass)).mean()
    assert metrics["te/positions"] == P and metrics["te/eta"] == eta
    assert float(metrics["te/member_share"]) == pytest.approx(float(share), abs=1e-6)
    assert float(metrics["te/kl"]) == pytest.approx(kl.item(), abs=1e-6)


def test_te_kl_no_members_is_zero_and_empty_is_attached():
    rows = torch.randn(3, V, dtype=torch.float64, requires_grad=True)
    kl, _ = te_kl(rows, torch.full((3, M), -1), torch.zeros(3, M, dtype=torch.float64), 0.5)
    (grad,) = torch.autograd.grad(kl, rows)
    assert abs(kl.item()) < 1e-12 and grad.abs().max() < 1e-12  # q = p0 = pi.detach(): a pure trust region
    empty = torch.randn(0, V, requires_grad=True)
    kl, metrics = te_kl(empty, torch.zeros(0, M, dtype=torch.long), torch.zeros(0, M), 0.5)
    assert kl.item() == 0.0 and kl.requires_grad and metrics["te/positions"] == 0.0
    kl.backward()
    with pytest.raises(ValueError):
        te_kl(rows, torch.full((3, M), -1), torch.zeros(3, M), 1.0)


def _batch(vocab):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, vocab, (3, 12), generator=g)
    mask = torch.ones(3, 12, dtype=torch.long)
    mask[1, 9:] = 0
    mask[2, 6:] = 0
    return ids, mask, (mask.cumsum(-1) - 1).clamp(min=0)


@pytest.mark.parametrize("head_trainable", [False, True])
def test_topm_at_positions_equals_full_softmax(head_trainable):
    model = wrap_lora(tiny_base(seed=0)).eval()
    if head_trainable:  # the fallback: the model's own logits
        model.get_base_model().lm_head.weight.requires_grad_(True)
    ids, mask, pos = _batch(model.config.vocab_size)
    rows, positions = torch.tensor([0, 0, 1, 2, 1, 0]), torch.tensor([1, 11, 8, 5, 3, 6])
    vocab = model.config.vocab_size
    top_ids, top_probs = topm_at_positions(model, ids, mask, pos, rows, positions, M=16, chunk_elems=2 * vocab)
    with torch.no_grad():
        full = model(input_ids=ids, attention_mask=mask, position_ids=pos).logits.float().softmax(-1)  # (N, T, V)
    ref = full[rows, positions - 1]  # (L, V)
    ref_probs, _ = ref.topk(16, dim=-1)
    assert top_ids.shape == (6, 16) and top_probs.dtype == torch.float32
    torch.testing.assert_close(top_probs, ref_probs, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(ref.gather(-1, top_ids), top_probs, atol=1e-6, rtol=1e-5)
    e_ids, e_probs = topm_at_positions(model, ids, mask, pos, rows[:0], positions[:0], M=16)
    assert e_ids.shape[0] == 0 and e_probs.shape[0] == 0
    with pytest.raises(ValueError):
        topm_at_positions(model, ids, mask, pos, rows[:1], torch.tensor([0]))


def _chunk(step, action_index, target=None, anchor=10, episode=0):
    target = target if target is not None else [j >= 0 for j in action_index]
    toks = [200 + j if j >= 0 else 1 for j in action_index]  # every token of a_j is 200 + j
    return ForecastChunk(episode, step, anchor, toks, target, action_index, len({j for j in action_index if j >= 0}))


def test_members_by_real_step_index():
    chunks = [
        _chunk(2, [3, 3, -1, 4, 4, 4]),  # step 2's own action skipped: its first slot is a k = 1 member of step 3
        _chunk(3, [3, 3, -1, 4, 4, 4], anchor=20),  # slot 0 is step 3 itself (k = 0): never a member
        _chunk(1, [1, -1, 2, 2, -1, 3, 3], target=[True, False, False, False, False, True, True], anchor=5),  # a_2 masked
    ]
    m = member_positions(chunks)
    got = sorted(zip(m.chunk.tolist(), m.position.tolist(), m.step.tolist(), m.offset.tolist(), m.length.tolist()))
    assert got == [
        (0, 10, 3, 0, 2), (0, 11, 3, 1, 2), (0, 13, 4, 0, 3), (0, 14, 4, 1, 3), (0, 15, 4, 2, 3),
        (1, 23, 4, 0, 3), (1, 24, 4, 1, 3), (1, 25, 4, 2, 3),
        (2, 10, 3, 0, 2), (2, 11, 3, 1, 2),
    ]
    assert (m.episode == 0).all() and len(m) == 10
    assert len(member_positions([_chunk(0, [0, 0])])) == 0  # a chunk of its own action only has no member

    # a_4 is 2 tokens long in the transcript: both 3-token members of step 4 are dropped and counted
    spans = {(0, 3): (30, 32), (0, 4): (40, 42)}
    L = len(m)
    ids = torch.arange(L)[:, None].repeat(1, 2)
    probs = torch.full((L, 2), 0.25)
    targets, metrics = ensemble_targets(m, ids, probs, spans, M=4)
    assert metrics["te/length_mismatch"] == 2.0 and metrics["te/actions"] == 1.0
    assert metrics["te/tokens"] == 2.0 and metrics["te/members_per_action"] == 2.0
    assert targets.position.tolist() == [30, 31] and targets.step.tolist() == [3, 3] and targets.members.tolist() == [2, 2]
    assert metrics["te/token_mismatch"] == 0.0

    # the transcript ends a_3 with another id (a prompted chunk's newline vs the stop id): that token is dropped
    transcript = [0] * 50
    transcript[30:32] = [203, 4]
    targets, metrics = ensemble_targets(m, ids, probs, spans, M=4, episode_tokens=[transcript])
    assert metrics["te/token_mismatch"] == 2.0 and metrics["te/length_mismatch"] == 2.0
    assert targets.position.tolist() == [30] and targets.members.tolist() == [2]


def test_merge_averages_by_token_id():
    members = MemberTokens(*torch.tensor([
        [0, 12, 0, 1, 0, 1, 60],  # chunk 0 and chunk 1: two members of (episode 0, t = 1, u = 0)
        [1, 9, 0, 1, 0, 1, 60],
        [2, 30, 3, 2, 0, 1, 61],  # a single member of (episode 3, t = 2, u = 0)
    ]).unbind(1))
    ids = torch.tensor([[5, 7, 9], [7, 5, 11], [4, 8, -1]])
    probs = torch.tensor([[0.5, 0.3, 0.1], [0.6, 0.2, 0.12], [0.7, 0.2, 0.0]])
    spans = {(0, 1): (17, 18), (3, 2): (40, 41)}
    t, metrics = ensemble_targets(members, ids, probs, spans, M=3)
    # (0.5 + 0.2) / 2 = 0.35 for 5, (0.3 + 0.6) / 2 = 0.45 for 7, 0.06 for 11, 0.05 for 9 (cut by M = 3)
    assert t.episode.tolist() == [0, 3] and t.position.tolist() == [17, 40] and t.members.tolist() == [2, 1]
    assert t.ids.tolist() == [[7, 5, 11], [4, 8, -1]]
    torch.testing.assert_close(t.probs, torch.tensor([[0.45, 0.35, 0.06], [0.7, 0.2, 0.0]]))
    assert metrics["te/members_per_action"] == 1.5 and metrics["te/length_mismatch"] == 0.0
    t4, _ = ensemble_targets(members, ids, probs, spans, M=4)
    assert t4.ids[0].tolist() == [7, 5, 11, 9]


def test_continuation_chunks_end_to_end():
    """Members of build_chunks' chunks sit on the transcript's own action tokens; K_t = min(t, K - 1)."""
    ep = make_episode(CHAT, 4, True, seed=3)
    chunks, _ = build_chunks([ep], CHAT, K=3)
    m = member_positions(chunks)
    ids, mask, pos = forecast_batch(chunks, [ep.tokens])
    spans = action_spans([ep])
    start = torch.tensor([spans[(0, t)][0] for t in m.step.tolist()])
    assert ids[m.chunk, m.position].tolist() == [ep.tokens[i] for i in (start + m.offset).tolist()]
    model = tiny_base(seed=0, vocab_size=64).eval()
    top_ids, top_probs = topm_at_positions(model, ids, mask, pos, m.chunk, m.position, M=8)
    targets, metrics = ensemble_targets(m, top_ids, top_probs, spans, M=8, episode_tokens=[ep.tokens])
    assert metrics["te/actions"] == 3.0 and metrics["te/members_per_action"] == pytest.approx(5 / 3)
    assert metrics["te/length_mismatch"] == 0.0 and metrics["te/token_mismatch"] == 0.0
    assert metrics["te/tokens"] == sum(s.action_end - s.action_start for s in ep.steps[1:])
    logits = model(input_ids=torch.tensor([ep.tokens])).logits[0, targets.position - 1]  # (P, V)
    kl, te = te_kl(logits.detach().requires_grad_(True), targets.ids, targets.probs, 0.5)
    assert torch.isfinite(kl) and kl.item() >= -1e-6 and te["te/positions"] == len(targets)
