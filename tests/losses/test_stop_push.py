"""The end-of-turn token under the policy gradient (`cope.algos.stop_stats`; the demo's collapse).

A group where the failing episodes are longer than the winning ones, every action one move plus the
end-of-turn id: under ``token-mean`` each sampled end-of-turn id weighs the same, so the group's push on that
id is proportional to sum_i A_i n_i = G Cov(A, n) < 0 and every update lowers the probability of stopping;
per-episode normalization (``seq-mean-token-mean``, the default since the demo's collapse) gives each episode the same
total weight and the push vanishes (which did not remove every collapse of the demo: bench/results/demo_seeds/README.md).
Checked twice: with the tally's closed form, and with autograd through the
real ``PolicyGradient`` objective on a table of logits."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from cope.algos.grpo import AGGREGATIONS, PolicyGradient
from cope.algos.stop_stats import aggregation_weights, stop_metrics, stop_push
from cope.train.objectives import ForwardOut

STOP, MOVE, V = 1, 2, 4  # token ids in a 4-token vocabulary: 0 prompt, 1 end of turn, 2 a move, 3 another


def _group(turns=(2, 2, 6, 6), wins=(True, True, False, False)):
    """A GRPO group as a batch: prompt token, then per turn [move, stop]; advantages +-1 (std-normalized
    with two wins of four). Returns the batch and the (rows, cols) of the end-of-turn positions."""
    N, T = len(turns), 1 + 2 * max(turns)
    ids = torch.zeros(N, T, dtype=torch.long)
    act = torch.zeros(N, T, dtype=torch.bool)
    r = torch.tensor([float(w) for w in wins])
    adv = ((r - r.mean()) / r.std()).view(N, 1).expand(N, T).clone()
    rows, cols = [], []
    for i, n in enumerate(turns):
        for k in range(n):
            ids[i, 1 + 2 * k], ids[i, 2 + 2 * k] = MOVE, STOP
            act[i, 1 + 2 * k: 3 + 2 * k] = True
            rows.append(i)
            cols.append(2 + 2 * k)
    return {"input_ids": ids, "action_mask": act, "advantages": adv * act}, (torch.tensor(rows), torch.tensor(cols))


def test_aggregation_weights_are_each_rules_token_weight():
    b, _ = _group()
    act = b["action_mask"]
    n_tok = act.sum(-1, keepdim=True).float()  # 4, 4, 12, 12
    w = aggregation_weights("token-mean", act)
    assert torch.allclose(w[act], torch.full_like(w[act], 1 / 32))
    w = aggregation_weights("seq-mean-token-mean", act)
    assert torch.allclose(w, (act / (4 * n_tok)).float())
    w = aggregation_weights("seq-mean-token-sum-norm", act, norm_len=16)
    assert torch.allclose(w, act.float() / (4 * 16))
    assert float(aggregation_weights("token-mean", torch.zeros_like(act)).abs().sum()) == 0.0
    assert set(AGGREGATIONS) == {"token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"}  # all covered


@pytest.mark.parametrize("p", [0.99, 0.9])
def test_token_mean_pushes_the_stop_token_down_and_per_episode_normalization_does_not(p):
    b, pos = _group()
    sampled = torch.where(b["action_mask"], torch.full(b["input_ids"].shape, p), torch.zeros(b["input_ids"].shape))
    is_stop = b["input_ids"] == STOP
    p_stop = torch.full((pos[0].numel(),), p)
    out = {}
    for agg in ("token-mean", "seq-mean-token-mean"):
        w = aggregation_weights(agg, b["action_mask"])
        out[agg] = stop_metrics(stop_push(b["advantages"], w, b["action_mask"], sampled, is_stop, pos, p_stop))
    A = 0.866025  # |A| of a 2-of-4 group: 0.5 / std([1, 1, 0, 0]) (unbiased)
    # token-mean: sum_i A_i n_i w (1 - p) = A (2 + 2 - 6 - 6) / 32 (1 - p), over the total push A 32 / 32 (1 - p)
    assert out["token-mean"]["stop/push"] == pytest.approx(-8 / 32, rel=1e-4)
    assert out["token-mean"]["stop/share_neg"] == pytest.approx(12 / 32) and out["token-mean"]["stop/share_pos"] == pytest.approx(4 / 32)
    assert out["seq-mean-token-mean"]["stop/push"] == pytest.approx(0.0, abs=1e-7)
    # the net advantage mass: (4 + 4 - 12 - 12) / 32 of the absolute under token-mean, none per episode
    assert out["token-mean"]["pg/adv_balance"] == pytest.approx(-0.5, rel=1e-5)
    assert out["seq-mean-token-mean"]["pg/adv_balance"] == pytest.approx(0.0, abs=1e-7)
    assert out["seq-mean-token-mean"]["stop/share_neg"] == pytest.approx(out["seq-mean-token-mean"]["stop/share_pos"])
    assert out["token-mean"]["stop/prob"] == pytest.approx(p)
    assert A > 0


def _stop_logit_gradient(objective: PolicyGradient, b: dict, p: float) -> float:
    """-d loss / d (end-of-turn logit), summed over every position: how the objective's descent step moves that logit."""
    N, T = b["input_ids"].shape
    base = torch.zeros(V)
    base[STOP] = torch.log(torch.tensor(p / (1 - p) * (V - 1)))  # softmax puts p on the stop id, the rest uniform
    # (the same row everywhere; only the end-of-turn positions' gradient is read)
    logits = base.repeat(N, T, 1).requires_grad_(True)  # (N, T, V)
    lp = torch.log_softmax(logits, -1).gather(-1, b["input_ids"][..., None]).squeeze(-1)  # (N, T)
    out = ForwardOut(logprobs=lp, entropy=torch.zeros(N, T))
    loss, _ = objective(out, {**b, "old_logprobs": lp.detach()})
    (g,) = torch.autograd.grad(loss, logits)
    return float(-g[..., STOP][b["input_ids"] == STOP].sum())


def test_the_real_objective_old_push_and_its_absence_under_the_new_default():
    """Autograd through ``PolicyGradient``: the old default (``token-mean``) lowers the stop logit on this group; the
    default since the demo's collapse (``conf/algo/grpo.yaml``: ``seq-mean-token-mean``) leaves it where it is."""
    from omegaconf import OmegaConf

    default = OmegaConf.load(Path(__file__).resolve().parents[2] / "conf" / "algo" / "grpo.yaml").objectives.pg.agg
    b, _ = _group()
    old = _stop_logit_gradient(PolicyGradient(agg="token-mean"), b, p=0.95)
    new = _stop_logit_gradient(PolicyGradient(agg=default), b, p=0.95)
    assert old < -1e-3
    assert abs(new) < 1e-7
    assert default == "seq-mean-token-mean"
