"""Hand-computed PPO clipped surrogate, k3 KL, and their Objective wrappers."""
import math

import pytest
import torch

from cope.algos.grpo import KLPenalty, PolicyGradient, clipped_pg_loss, kl_k3
from cope.train.objectives import ForwardOut, combine

# Tokens (ratio r, advantage A), clip 0.2 both sides, per-token loss -min(rA, clip(r)A):
#   a: r=1.5, A=+1 -> min(1.5, 1.2)   = 1.2  -> -1.2  clipped
#   b: r=0.5, A=+1 -> min(0.5, 0.8)   = 0.5  -> -0.5
#   c: r=0.5, A=-1 -> min(-0.5, -0.8) = -0.8 ->  0.8  clipped
#   d: r=1.5, A=-1 -> min(-1.5, -1.2) = -1.5 ->  1.5
#   e: r=1.1, A=+2 -> min(2.2, 2.4)   = 2.2  -> -2.2
# row 0 = [a, b, junk], row 1 = [c, d, e], row 2 = no action tokens (junk everywhere)
RATIOS = [[1.5, 0.5, 1.0], [0.5, 1.5, 1.1], [1.0, 1.0, 1.0]]
ADV = torch.tensor([[1.0, 1.0, 123.0], [-1.0, -1.0, 2.0], [7.0, 7.0, 7.0]])
MASK = torch.tensor([[True, True, False], [True, True, True], [False, False, False]])


def _inputs():
    old = torch.tensor([[-1.0, -2.0, -float("inf")], [-0.5, -1.5, -3.0], [-1.0, -1.0, -1.0]])
    lp = (old.nan_to_num(neginf=0.0) + torch.tensor(RATIOS).log())
    lp[0, 2] = 50.0  # junk off the mask: must not overflow or leak
    return lp.requires_grad_(True), old


def test_clipped_token_mean_hand_case():
    lp, old = _inputs()
    loss, m = clipped_pg_loss(lp, old, ADV, MASK, agg="token-mean")
    assert loss.item() == pytest.approx((-1.2 - 0.5 + 0.8 + 1.5 - 2.2) / 5)  # -0.32
    assert float(m["policy/clip_frac"]) == pytest.approx(2 / 5)
    assert float(m["policy/ratio_mean"]) == pytest.approx((1.5 + 0.5 + 0.5 + 1.5 + 1.1) / 5)  # 1.02
    # (r - 1) - ln r: 1.5 -> 0.0945349, 0.5 -> 0.1931472, 1.1 -> 0.0046898
    assert float(m["policy/approx_kl"]) == pytest.approx((2 * 0.0945349 + 2 * 0.1931472 + 0.0046898) / 5, abs=1e-6)
    for v in m.values():
        assert not (isinstance(v, torch.Tensor) and v.requires_grad)


def test_gradients_only_on_masked_unclipped_tokens():
    lp, old = _inputs()
    loss, _ = clipped_pg_loss(lp, old, ADV, MASK, agg="token-mean")
    loss.backward()
    g = lp.grad
    assert torch.isfinite(g).all()
    # d/dlp of -r*A/5 = -r*A/5 for unclipped tokens; clipped (a, c) and unmasked tokens get 0
    expected = torch.tensor([[0.0, -0.5 / 5, 0.0], [0.0, 1.5 / 5, -2.2 / 5], [0.0, 0.0, 0.0]])
    torch.testing.assert_close(g, expected)


def test_seq_aggregations():
    lp, old = _inputs()
    loss, _ = clipped_pg_loss(lp, old, ADV, MASK, agg="seq-mean-token-mean")
    # row 0: (-1.2 - 0.5)/2 = -0.85; row 1: (0.8 + 1.5 - 2.2)/3 = 0.1/3; row 2 has no tokens
    assert loss.item() == pytest.approx((-0.85 + 0.1 / 3) / 2)
    loss, _ = clipped_pg_loss(lp, old, ADV, MASK, agg="seq-mean-token-sum-norm", norm_len=4)
    # sum -1.6 / (2 sequences with tokens * 4)
    assert loss.item() == pytest.approx(-1.6 / 8)


def test_asymmetric_clip():
    # r=1.5, A=+1 with clip_high 0.6: not clipped -> -1.5; r=0.5, A=-1 with clip_low 0.1: -> 0.9
    lp = torch.tensor([[math.log(1.5), math.log(0.5)]])
    loss, m = clipped_pg_loss(lp, torch.zeros(1, 2), torch.tensor([[1.0, -1.0]]), torch.ones(1, 2, dtype=torch.bool),
                              clip_low=0.1, clip_high=0.6)
    assert loss.item() == pytest.approx((-1.5 + 0.9) / 2)
    assert float(m["policy/clip_frac"]) == pytest.approx(0.5)


def test_ratio_one_gives_minus_mean_advantage():
    lp = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, -0.7, -0.9]], requires_grad=True)
    adv = torch.tensor([[1.0, 2.0, 99.0], [-0.5, 3.0, 99.0]])
    mask = torch.tensor([[True, True, False], [True, True, False]])
    loss, m = clipped_pg_loss(lp, lp.detach().clone(), adv, mask)
    assert loss.item() == pytest.approx(-(1.0 + 2.0 - 0.5 + 3.0) / 4)
    assert float(m["policy/clip_frac"]) == 0.0
    assert float(m["policy/ratio_mean"]) == pytest.approx(1.0)
    assert float(m["policy/approx_kl"]) == pytest.approx(0.0)


def test_empty_mask_zero_loss_connected():
    lp = torch.randn(2, 3, requires_grad=True)
    mask = torch.zeros(2, 3, dtype=torch.bool)
    for agg in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"):
        loss, m = clipped_pg_loss(lp, torch.randn(2, 3), torch.randn(2, 3), mask, agg=agg)
        assert loss.item() == 0.0 and loss.requires_grad
        assert all(math.isfinite(float(v)) for v in m.values())
        loss.backward()
        assert torch.equal(lp.grad, torch.zeros(2, 3))
    kl, mk = kl_k3(lp, torch.randn(2, 3), mask)
    assert kl.item() == 0.0 and kl.requires_grad and float(mk["policy/kl"]) == 0.0


def test_unknown_agg():
    with pytest.raises(ValueError, match="token-mean"):
        clipped_pg_loss(torch.zeros(1, 1), torch.zeros(1, 1), torch.zeros(1, 1), torch.ones(1, 1, dtype=torch.bool), agg="sum")


def test_kl_k3_hand_values():
    lp = torch.tensor([[-1.0, -2.0, -3.0]], requires_grad=True)
    mask = torch.tensor([[True, True, False]])
    kl, m = kl_k3(lp, lp.detach().clone(), mask)
    assert kl.item() == pytest.approx(0.0)
    # ref - lp = +ln2: 2 - ln2 - 1 = 0.3068528;  ref - lp = -ln2: 0.5 + ln2 - 1 = 0.1931472; mean 0.25
    ref = lp.detach() + torch.tensor([[math.log(2.0), -math.log(2.0), 5.0]])
    kl, m = kl_k3(lp, ref, mask)
    assert kl.item() == pytest.approx(0.25, abs=1e-6)
    assert float(m["policy/kl"]) == pytest.approx(0.25, abs=1e-6)
    assert kl.item() > 0


def _batch_and_out():
    lp, old = _inputs()
    entropy = torch.tensor([[1.0, 3.0, 100.0], [2.0, 2.0, 2.0], [100.0, 100.0, 100.0]])
    batch = {"old_logprobs": old, "advantages": ADV, "action_mask": MASK}
    return batch, ForwardOut(logprobs=lp, entropy=entropy)


def test_policy_gradient_objective_via_combine():
    batch, out = _batch_and_out()
    total, m = combine([PolicyGradient(weight=0.5, agg="token-mean")], out, batch, step=0)
    assert total.item() == pytest.approx(0.5 * -0.32)
    assert float(m["loss/total"]) == pytest.approx(0.5 * -0.32)
    assert float(m["loss/pg"]) == pytest.approx(-0.32)
    assert float(m["policy/entropy"]) == pytest.approx((1 + 3 + 2 + 2 + 2) / 5)
    assert "policy/clip_frac" in m


def test_kl_objective_via_combine():
    batch, out = _batch_and_out()
    out.ref_logprobs = out.logprobs.detach() + torch.tensor([[math.log(2.0), -math.log(2.0), 9.0]] * 3)
    # ref - lp on masked tokens: row 0 (a, b) -> (+ln2, -ln2); row 1 (c, d, e) -> (+ln2, -ln2, +9)
    obj = KLPenalty(weight=0.1)
    assert obj.needs_ref
    total, m = combine([obj], out, batch, step=0)
    k_pos, k_neg = 2 - math.log(2) - 1, 0.5 + math.log(2) - 1
    k_9 = math.exp(9.0) - 9.0 - 1
    expected = (2 * k_pos + 2 * k_neg + k_9) / 5
    assert float(m["loss/kl"]) == pytest.approx(expected, rel=1e-5)
    assert total.item() == pytest.approx(0.1 * expected, rel=1e-5)


def test_kl_objective_without_ref_fails_clearly():
    batch, out = _batch_and_out()
    with pytest.raises(ValueError, match="ref_logprobs"):
        KLPenalty(weight=0.1)(out, batch)


@pytest.mark.parametrize(
    "kwargs,arg",
    [({"clip_low": 1.0}, "clip_low"), ({"clip_high": -0.1}, "clip_high"), ({"agg": "sum"}, "agg"), ({"norm_len": 0}, "norm_len")],
)
def test_policy_gradient_validates_args(kwargs, arg):
    with pytest.raises(ValueError, match=arg):
        PolicyGradient(**kwargs)
