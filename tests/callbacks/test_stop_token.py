"""`StopTokenStats` (watching the demo's action collapse): the end-of-turn probability after a complete action and the policy gradient's
push on it, measured by the callback under micro-batching, against a plain full-logits forward of the same
policy and the push computed by hand from those logits."""
from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parents[1] / "forecasting"))
from forecast_fixtures import CFG, CHAT, PAD, make_episode  # noqa: E402

from cope.algos.grpo import PolicyGradient  # noqa: E402
from cope.algos.stop_stats import aggregation_weights, stop_metrics  # noqa: E402
from cope.batch import collate  # noqa: E402
from cope.callbacks.stop_token import StopTokenStats, complete_positions  # noqa: E402
from cope.models.policy import Policy  # noqa: E402
from cope.records import EpochRecord  # noqa: E402
from cope.train.module import AgentRLModule  # noqa: E402

STOP = CHAT.turn_end[0]


def _module(agg: str, budget: int | None, temperature: float) -> AgentRLModule:
    from peft import LoraConfig, get_peft_model
    from transformers import Qwen2ForCausalLM

    torch.manual_seed(0)
    base = Qwen2ForCausalLM(CFG)
    with torch.no_grad():  # make the end-of-turn id likely, as after a warm start
        base.lm_head.weight[STOP] += 0.6 * base.lm_head.weight.std() * torch.randn(CFG.hidden_size).sign()
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
    policy = Policy(model=model, tokenizer=SimpleNamespace(pad_token_id=PAD), chat=CHAT, source="test")
    return AgentRLModule(policy, [PolicyGradient(agg=agg)], optimizer=torch.optim.SGD, temperature=temperature,
                         max_tokens_per_microbatch=budget)


def _episodes():
    """Four episodes (a group: two short wins, two long losses); every step's first action token is a complete
    action, so a step that sampled more than one content token is a multi-action answer."""
    eps = [make_episode(CHAT, n, ok, seed) for n, ok, seed in [(2, True, 1), (2, True, 2), (5, False, 3), (6, False, 4)]]
    for e, a in zip(eps, [0.87, 0.87, -0.87, -0.87]):
        e.advantage = a
        for s in e.steps:
            s.complete_len = 1
    return eps


def _by_hand(module, eps, order, mb, agg: str, temperature: float, behaviour: torch.Tensor | None = None,
             cap: float = 5.0) -> dict:
    """The tally's terms from full logits of the transcripts, in the minibatch's row order; ``behaviour`` (N, T): the
    sampler's log-probs, each token's weight then times min(p / p_behaviour, cap) as in the loss."""
    rows = [eps[i] for i in order]
    plain = collate(rows, PAD)
    with torch.no_grad():
        logits = module.model(input_ids=plain["input_ids"], attention_mask=plain["attention_mask"]).logits  # (N, T, V)
    probs = torch.softmax(logits / temperature, -1)  # (N, T, V): position t predicts token t + 1
    ids, act, adv = plain["input_ids"], plain["action_mask"], plain["advantages"]
    w = aggregation_weights(agg, mb["action_mask"])[:, : ids.shape[1]].clone()
    if behaviour is not None:
        for r in range(ids.shape[0]):
            for c in range(1, ids.shape[1]):
                if act[r, c]:
                    w[r, c] *= min(float(probs[r, c - 1, ids[r, c]]) / float(behaviour[r, c].exp()), cap)
    total = sp = sn = net = 0.0
    r_pos, c_pos = complete_positions(rows, ids.shape[1])
    p_stop = [float(probs[r, c - 1, STOP]) for r, c in zip(r_pos.tolist(), c_pos.tolist())]
    for r in range(ids.shape[0]):
        for c in range(1, ids.shape[1]):
            if not act[r, c]:
                continue
            g = float(adv[r, c] * w[r, c] * (1 - probs[r, c - 1, ids[r, c]]))
            total += abs(g)
            if ids[r, c] == STOP:
                sp, sn = (sp + abs(g), sn) if adv[r, c] > 0 else (sp, sn + abs(g))
    for (r, c), p in zip(zip(r_pos.tolist(), c_pos.tolist()), p_stop):
        if act[r, c]:
            net += float(adv[r, c] * w[r, c]) * (float(ids[r, c] == STOP) - p)
    return {"p_stop": p_stop, "total": total, "sp": sp, "sn": sn, "net": net, "aw": (adv * w)[act], "probs": probs,
            "plain": plain}


@pytest.mark.parametrize("agg, budget, temperature", [("token-mean", None, 1.0), ("seq-mean-token-mean", 40, 0.7)])
def test_rollout_tally_matches_a_plain_forward(agg, budget, temperature):
    module = _module(agg, budget, temperature)
    eps = _episodes()
    assert any(s.multi_action for e in eps for s in e.steps) and any(not s.multi_action for e in eps for s in e.steps)
    order = [2, 0, 3, 1]
    mb = collate([eps[i] for i in order], PAD, indices=order)
    record = EpochRecord(epoch=0, episodes=eps, minibatches=[mb], metrics={}, counters={})
    got = StopTokenStats().rollout_tally(module, record)

    hand = _by_hand(module, eps, order, mb, agg, temperature)
    p_stop, total, sp, sn, net, aw = (hand[k] for k in ("p_stop", "total", "sp", "sn", "net", "aw"))
    assert got["positions"] == len(p_stop) == sum(e.num_steps for e in eps)
    assert got["p_stop_sum"] == pytest.approx(sum(p_stop), rel=1e-5)
    assert got["total_push"] == pytest.approx(total, rel=1e-5)
    assert got["stop_push_pos"] == pytest.approx(sp, rel=1e-5) and got["stop_push_neg"] == pytest.approx(sn, rel=1e-5)
    assert got["net_push"] == pytest.approx(net, rel=1e-5, abs=1e-9)
    assert got["adv_net"] == pytest.approx(float(aw.sum()), rel=1e-5, abs=1e-9) and got["adv_abs"] == pytest.approx(float(aw.abs().sum()))
    m = stop_metrics(got)
    assert 0 < m["stop/prob"] < 1 and m["stop/share_neg"] > 0 and m["stop/share_pos"] > 0
    assert m["stop/positions"] == len(p_stop)
    none = stop_metrics({**got, "positions": 0.0, "p_stop_sum": 0.0})  # nothing measured: the 0 says so by its count
    assert none["stop/prob"] == 0.0 and none["stop/positions"] == 0.0
    # the panel's probability is the same measurement on the held-out episodes
    assert StopTokenStats().panel_tally(module, eps)["positions"] == len(p_stop)


def test_a_lagged_minibatch_is_measured_with_its_behaviour_weights():
    """data.max_lag >= 1: the loss weighs each token by min(pi / pi_behaviour, cap) (cope.algos.grpo), so the push the
    callback reports does too; a minibatch without the sampler's log-probs keeps the plain weights."""
    module = _module("seq-mean-token-mean", None, 0.7)
    eps, order = _episodes(), [2, 0, 3, 1]
    mb = collate([eps[i] for i in order], PAD, indices=order)
    plain_hand = _by_hand(module, eps, order, mb, "seq-mean-token-mean", 0.7)
    ids = plain_hand["plain"]["input_ids"]
    p_cur = plain_hand["probs"][:, :-1].gather(-1, ids[:, 1:, None]).squeeze(-1)  # (N, T-1): p of token t+1
    shift = torch.linspace(-1.0, 2.5, ids.shape[1] - 1).expand_as(p_cur)  # some tokens' weights above the cap of 5
    behaviour = torch.zeros(ids.shape)
    behaviour[:, 1:] = p_cur.log() - shift
    mb["behaviour_logprobs"] = torch.zeros(mb["input_ids"].shape)
    mb["behaviour_logprobs"][:, : ids.shape[1]] = behaviour
    record = EpochRecord(epoch=0, episodes=eps, minibatches=[mb], metrics={}, counters={})
    got = StopTokenStats().rollout_tally(module, record)
    hand = _by_hand(module, eps, order, mb, "seq-mean-token-mean", 0.7, behaviour=behaviour)
    assert hand["total"] != pytest.approx(plain_hand["total"], rel=1e-3)  # the weights matter here
    assert got["total_push"] == pytest.approx(hand["total"], rel=1e-4)
    assert got["net_push"] == pytest.approx(hand["net"], rel=1e-4, abs=1e-9)
    assert got["stop_push_pos"] == pytest.approx(hand["sp"], rel=1e-4) and got["stop_push_neg"] == pytest.approx(hand["sn"], rel=1e-4)
    assert got["adv_net"] == pytest.approx(float(hand["aw"].sum()), rel=1e-4, abs=1e-9)


def test_token_mean_weighs_the_long_losses_end_of_turn_ids_more():
    """On the same group and policy: the losing episodes' share of the push on the end-of-turn id exceeds the wins'
    under token-mean (they have more turns), and per-episode normalization brings the two back together."""
    eps = _episodes()
    mb = collate(eps, PAD, indices=[0, 1, 2, 3])
    record = EpochRecord(epoch=0, episodes=eps, minibatches=[mb], metrics={}, counters={})
    old = stop_metrics(StopTokenStats().rollout_tally(_module("token-mean", None, 1.0), record))
    new = stop_metrics(StopTokenStats().rollout_tally(_module("seq-mean-token-mean", None, 1.0), record))
    assert old["stop/share_neg"] > 2 * old["stop/share_pos"]
    assert new["stop/share_neg"] / new["stop/share_pos"] < old["stop/share_neg"] / old["stop/share_pos"] / 2
    assert old["pg/adv_balance"] < -0.3 and new["pg/adv_balance"] == pytest.approx(0.0, abs=1e-6)
