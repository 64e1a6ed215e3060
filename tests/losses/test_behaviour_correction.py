"""Decoupled PPO for stale episodes (``data.max_lag`` >= 1): the clip around the proximal policy (``old_logprobs``),
each token weighted by the detached, truncated behaviour weight min(pi_old / pi_sampler, cap), against hand-computed
references and against the forms that anchor the weight or the ratio on the current policy; the sampler's log-probs
placed at their action tokens by collate and kept there by CoPE's forecast layouts and the GRPO group packing."""
from __future__ import annotations

import math
import random

import pytest
import torch

from cope.algos.cope.chunks import build_chunks
from cope.algos.cope.packing import pack_forecasts, plain_forecasts
from cope.algos.grpo import BEHAVIOUR_CAP, PolicyGradient, behaviour_weight, clipped_pg_loss
from cope.batch import collate
from cope.chat import ChatFormat
from cope.envs.base import Task
from cope.episode import EndReason, Episode, Role, Step
from cope.train.collect.experience import cut_minibatches
from cope.train.objectives import ForwardOut
from cope.train.packing.group_prefix import pack_groups

CLIP = 0.2
PAD = 0
CHAT = ChatFormat(system_open=(1,), user_open=(2,), assistant_open=(3,), turn_end=(4,), newline=(5,))

# Six action tokens (r = pi_theta / pi_old, w = pi_old / pi_behaviour, A), clip 0.2, cap 5:
#   t0: r=1.1,  w=2,    A=+1   unclipped   per-token -2 * 1.1           = -2.2     d/dlp -w r A = -2.2
#   t1: r=1.5,  w=0.5,  A=+1   clipped     -0.5 * 1.2                   = -0.6     0
#   t2: r=0.9,  w=8->5, A=-2   unclipped   -5 * (0.9 * -2)              =  9.0     9.0
#   t3: r=0.7,  w=1,    A=-1   clipped     -1 * (0.8 * -1)              =  0.8     0
#   t4: r=1.05, w=0.25, A=+3   unclipped   -0.25 * 3.15                 = -0.7875  -0.7875
#   t5: r=0.95, w=3,    A=-0.5 unclipped   -3 * -0.475                  =  1.425   1.425
# row 0 = [t0, t1, t2, junk], row 1 = [t3, t4, t5, junk], row 2 = no action token
R = [[1.1, 1.5, 0.9, 1.0], [0.7, 1.05, 0.95, 1.0], [1.0, 1.0, 1.0, 1.0]]
W = [[2.0, 0.5, 8.0, 1.0], [1.0, 0.25, 3.0, 1.0], [1.0, 1.0, 1.0, 1.0]]
ADV = torch.tensor([[1.0, 1.0, -2.0, 50.0], [-1.0, 3.0, -0.5, 50.0], [4.0, 4.0, 4.0, 4.0]])
MASK = torch.tensor([[True, True, True, False], [True, True, True, False], [False] * 4])
PER_TOKEN = [-2.2, -0.6, 9.0, 0.8, -0.7875, 1.425]  # the hand values above, mask order
GRAD_NUM = [[-2.2, 0.0, 9.0, 0.0], [0.0, -0.7875, 1.425, 0.0], [0.0] * 4]  # -w r A on unclipped tokens


def _inputs():
    """(current log-probs with grad, old, behaviour) realising R and W; junk off the mask."""
    old = torch.tensor([[-1.0, -2.0, -0.5, -float("inf")], [-0.3, -1.2, -2.5, 0.0], [-1.0, -1.0, -1.0, -1.0]])
    old_f = old.nan_to_num(neginf=0.0)
    lp = old_f + torch.tensor(R).log()
    lp[0, 3], lp[1, 3] = 60.0, -60.0  # off the mask: must neither overflow nor leak
    behaviour = old_f - torch.tensor(W).log()
    behaviour[1, 3] = 500.0  # off the mask
    return lp.requires_grad_(True), old, behaviour


def _grad(loss, lp):
    (g,) = torch.autograd.grad(loss, lp)
    return g


def _plain_ppo_reference(lp, old, adv, mask):
    """Today's loss written out again: -min(rA, clip(r)A), seq-mean-token-mean, and its metrics."""
    rs, clipped, kl = [], [], []
    rows = []
    for i in range(lp.shape[0]):
        row = []
        for t in range(lp.shape[1]):
            if not mask[i, t]:
                continue
            lr = lp[i, t] - old[i, t]
            r = torch.exp(lr)
            a = float(adv[i, t])
            unclipped, clip = r * a, torch.clamp(r, 1 - CLIP, 1 + CLIP) * a
            row.append(-torch.minimum(unclipped, clip))
            rs.append(float(r.detach()))
            clipped.append(float(clip.detach()) < float(unclipped.detach()))
            kl.append(float((r - 1 - lr).detach()))
        if row:
            rows.append(torch.stack(row).mean())
    loss = torch.stack(rows).mean()
    n = len(rs)
    return loss, {"policy/clip_frac": sum(clipped) / n, "policy/ratio_mean": sum(rs) / n, "policy/approx_kl": sum(kl) / n}


def test_without_behaviour_the_loss_grads_and_metrics_are_todays():
    lp, old, _ = _inputs()
    loss, m = clipped_pg_loss(lp, old, ADV, MASK, clip_low=CLIP, clip_high=CLIP)
    ref, ref_m = _plain_ppo_reference(lp, old.nan_to_num(neginf=0.0), ADV, MASK)
    assert loss.item() == pytest.approx(ref.item(), rel=1e-6)
    torch.testing.assert_close(_grad(loss, lp), _grad(ref, lp))
    assert set(m) == set(ref_m)  # no behaviour metric without the key
    for k, v in ref_m.items():
        assert float(m[k]) == pytest.approx(v, rel=1e-5, abs=1e-7), k


def test_behaviour_equal_to_old_weighs_every_token_exactly_one():
    lp, old, _ = _inputs()
    weight, m = behaviour_weight(old, old.clone(), MASK)
    assert bool((weight[MASK] == 1.0).all())
    assert float(m["policy/behaviour_weight_mean"]) == 1.0 and float(m["policy/behaviour_weight_max"]) == 1.0
    assert float(m["policy/behaviour_capped_frac"]) == 0.0
    for agg in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"):
        plain, pm = clipped_pg_loss(lp, old, ADV, MASK, agg=agg)
        lagged, lm = clipped_pg_loss(lp, old, ADV, MASK, agg=agg, behaviour_logprobs=old.clone())
        assert torch.equal(plain, lagged)
        assert torch.equal(_grad(plain, lp), _grad(lagged, lp))
        assert all(torch.equal(pm[k], lm[k]) for k in pm)


def test_decoupled_loss_and_gradient_equal_the_hand_computed_reference():
    lp, old, behaviour = _inputs()
    loss, m = clipped_pg_loss(lp, old, ADV, MASK, clip_low=CLIP, clip_high=CLIP, agg="token-mean",
                              behaviour_logprobs=behaviour, behaviour_cap=5.0)
    assert loss.item() == pytest.approx(sum(PER_TOKEN) / 6, rel=1e-5)
    grad = _grad(loss, lp)
    torch.testing.assert_close(grad, torch.tensor(GRAD_NUM) / 6)
    # seq-mean-token-mean: row 0 the mean of t0..t2, row 1 of t3..t5, then their mean (row 2 has no token)
    loss_s, _ = clipped_pg_loss(lp, old, ADV, MASK, behaviour_logprobs=behaviour, behaviour_cap=5.0)
    assert loss_s.item() == pytest.approx((sum(PER_TOKEN[:3]) / 3 + sum(PER_TOKEN[3:]) / 3) / 2, rel=1e-5)
    torch.testing.assert_close(_grad(loss_s, lp), torch.tensor(GRAD_NUM) / torch.tensor([[6.0], [6.0], [1.0]]))
    # the clip is taken around the old (proximal) policy: t1 and t3 clipped, as without the weight
    assert float(m["policy/clip_frac"]) == pytest.approx(2 / 6)
    assert float(m["policy/behaviour_weight_mean"]) == pytest.approx((2 + 0.5 + 5 + 1 + 0.25 + 3) / 6, rel=1e-5)
    assert float(m["policy/behaviour_weight_max"]) == pytest.approx(8.0, rel=1e-5)  # before the cap
    assert float(m["policy/behaviour_capped_frac"]) == pytest.approx(1 / 6)
    assert not any(v.requires_grad for v in m.values())


def test_the_approx_kl_under_lag_is_the_behaviour_weighted_estimate():
    """Tokens sampled by pi_b estimate KL(pi_prox || pi_theta) only when each k3 term carries w = pi_prox / pi_b: the
    weighted, self-normalized mean (the truncated w, as the loss uses), not the plain mean over tokens."""
    lp, old, behaviour = _inputs()
    _, m = clipped_pg_loss(lp, old, ADV, MASK, clip_low=CLIP, clip_high=CLIP, behaviour_logprobs=behaviour, behaviour_cap=5.0)
    _, plain = clipped_pg_loss(lp, old, ADV, MASK, clip_low=CLIP, clip_high=CLIP)
    w = [2, 0.5, 5, 1, 0.25, 3]  # the truncated weights of the six tokens (test above)
    lr = [float(lp[i, t] - old[i, t]) for i in range(lp.shape[0]) for t in range(lp.shape[1]) if MASK[i, t]]
    k3 = [math.exp(x) - 1 - x for x in lr]
    assert float(m["policy/approx_kl"]) == pytest.approx(sum(a * b for a, b in zip(w, k3)) / sum(w), rel=1e-5)
    assert float(plain["policy/approx_kl"]) == pytest.approx(sum(k3) / len(k3), rel=1e-5)  # lag 0: unchanged
    assert float(m["policy/approx_kl"]) != pytest.approx(float(plain["policy/approx_kl"]), rel=1e-3)
    # the expectation it stands for, on a toy state: actions drawn from pi_b, the weighted mean -> KL(pi_prox || pi_theta)
    g = torch.Generator().manual_seed(0)
    p_b, p_prox, p_theta = (torch.softmax(torch.randn(6, generator=g), 0) for _ in range(3))
    a = torch.multinomial(p_b, 200_000, replacement=True, generator=g)  # (S,)
    lr_s, w_s = (p_theta.log() - p_prox.log())[a], (p_prox / p_b)[a]
    est = float(((lr_s.exp() - 1 - lr_s) * w_s).sum() / w_s.sum())
    assert est == pytest.approx(float((p_prox * (p_prox.log() - p_theta.log())).sum()), rel=0.03)


def _mutations(lp, old, behaviour):
    """Per-token losses (token-mean) of the forms that anchor the weight or the ratio on the wrong policy."""
    n = MASK.sum()
    A = torch.where(MASK, ADV, torch.zeros_like(ADV))
    old_f = old.nan_to_num(neginf=0.0)

    def surrogate(log_r):
        r = torch.where(MASK, log_r, torch.zeros_like(log_r)).exp()
        return torch.minimum(r * A, r.clamp(1 - CLIP, 1 + CLIP) * A)

    live_w = torch.where(MASK, lp - behaviour, torch.zeros_like(lp)).exp().clamp(max=5.0)  # w on the current policy
    return {
        "weight on the current policy, with grad": -(live_w * surrogate(lp - old_f)).sum() / n,
        "weight on the current policy, detached": -(live_w.detach() * surrogate(lp - old_f)).sum() / n,
        "ratio against the behaviour policy (clip anchored there)": -surrogate(lp - behaviour).sum() / n,
        "ratio against the behaviour policy, weighted too": -(live_w.detach() * surrogate(lp - behaviour)).sum() / n,
    }


def test_a_weight_or_ratio_anchored_on_the_current_policy_gives_another_gradient():
    lp, old, behaviour = _inputs()
    loss, _ = clipped_pg_loss(lp, old, ADV, MASK, agg="token-mean", behaviour_logprobs=behaviour, behaviour_cap=5.0)
    real = _grad(loss, lp)
    torch.testing.assert_close(real, torch.tensor(GRAD_NUM) / 6)  # the reference the mutants must miss
    for name, mutant in _mutations(lp, old, behaviour).items():
        g = _grad(mutant, lp)
        # the tokens where they must differ: unclipped, r != 1 and w != 1 (t0, t2, t4, t5)
        assert not torch.allclose(g, real, atol=1e-4), name
        with pytest.raises(AssertionError):
            torch.testing.assert_close(g, torch.tensor(GRAD_NUM) / 6)
    # a weight that carried a gradient through the old log-probs: the function detaches them
    old_live = old.nan_to_num(neginf=0.0).clone().requires_grad_(True)
    loss2, _ = clipped_pg_loss(lp, old_live, ADV, MASK, agg="token-mean", behaviour_logprobs=behaviour, behaviour_cap=5.0)
    g_lp, g_old = torch.autograd.grad(loss2, (lp, old_live), allow_unused=True)
    assert g_old is None or bool((g_old == 0).all())
    torch.testing.assert_close(g_lp, real)


def test_the_cap_truncates_exactly_the_tokens_above_it():
    # r = 1, A = 1: each token's gradient is -w_applied / n, so it shows the weight the loss used
    raw = torch.tensor([[0.5, 4.9, 5.1, 50.0, 1.0e8, 7.0]])
    mask = torch.tensor([[True, True, True, True, True, False]])
    old = torch.full((1, 6), -2.0)
    behaviour = old - raw.log()
    lp = old.clone().requires_grad_(True)
    adv = torch.ones(1, 6)
    loss, m = clipped_pg_loss(lp, old, adv, mask, agg="token-mean", behaviour_logprobs=behaviour, behaviour_cap=5.0)
    applied = torch.tensor([[0.5, 4.9, 5.0, 5.0, 5.0, 0.0]])  # truncated, not masked: above the cap weighs 5
    torch.testing.assert_close(_grad(loss, lp), -applied / 5)
    assert loss.item() == pytest.approx(-applied.sum().item() / 5, rel=1e-5)
    assert float(m["policy/behaviour_capped_frac"]) == pytest.approx(3 / 5)  # 5.1, 50, 1e8; not the off-mask 7
    assert float(m["policy/behaviour_weight_max"]) == pytest.approx(1.0e8, rel=1e-4)
    assert float(m["policy/behaviour_weight_mean"]) == pytest.approx(applied.sum().item() / 5, rel=1e-5)
    # a cap of 2 moves the cut: 4.9 truncated too
    loss2, m2 = clipped_pg_loss(lp, old, adv, mask, agg="token-mean", behaviour_logprobs=behaviour, behaviour_cap=2.0)
    assert float(m2["policy/behaviour_capped_frac"]) == pytest.approx(4 / 5)
    torch.testing.assert_close(_grad(loss2, lp), -torch.tensor([[0.5, 2.0, 2.0, 2.0, 2.0, 0.0]]) / 5)
    # a sampler log-prob far below the old one (the weight overflows float32) stays finite: the cap bounds it
    far = behaviour.clone()
    far[0, 0] = -200.0
    loss3, m3 = clipped_pg_loss(lp, old, adv, mask, agg="token-mean", behaviour_logprobs=far)
    assert math.isfinite(loss3.item()) and bool(torch.isfinite(_grad(loss3, lp)).all())
    assert float(m3["policy/behaviour_capped_frac"]) == pytest.approx(4 / 5)


def test_policy_gradient_reads_the_batch_key_and_validates_the_cap():
    lp, old, behaviour = _inputs()
    out = ForwardOut(logprobs=lp, entropy=torch.ones_like(lp))
    batch = {"old_logprobs": old, "advantages": ADV, "action_mask": MASK}
    obj = PolicyGradient(agg="token-mean", behaviour_cap=5.0)
    plain, pm = obj(out, batch)
    assert not any(k.startswith("policy/behaviour") for k in pm)
    lagged, lm = obj(out, {**batch, "behaviour_logprobs": behaviour})
    assert lagged.item() == pytest.approx(sum(PER_TOKEN) / 6, rel=1e-5)
    assert {"policy/behaviour_weight_mean", "policy/behaviour_weight_max", "policy/behaviour_capped_frac"} <= set(lm)
    assert PolicyGradient().behaviour_cap == BEHAVIOUR_CAP == 5.0
    for bad in (1.0, 0.5, float("nan")):
        with pytest.raises(ValueError, match=r"algo\.objectives\.pg\.behaviour_cap"):
            PolicyGradient(behaviour_cap=bad)


# -- the sampler's log-probs in the batch --------------------------------------------------------------------------

def _episode(seed: int, steps: int, task: int = 0, group: int = 0, logprobs: bool = True, success: bool = True) -> Episode:
    """A transcript whose prompt is fixed by ``task`` (episodes of a task share it); actions drawn from ``seed``; each
    action token's sampler log-prob a distinct value -(seed + step / 10 + token / 100 + 0.001)."""
    task_rng, rng = random.Random(task), random.Random(seed)
    ep = Episode(task=Task("toy", "train", task), group=group, success=success, score=float(success))
    ep.append([*CHAT.system_open, *(task_rng.randrange(6, 64) for _ in range(4)), *CHAT.turn_end, *CHAT.newline,
               *CHAT.user_open], Role.PROMPT)
    ep.append([task_rng.randrange(6, 64) for _ in range(3)], Role.OBSERVATION)
    ep.append(CHAT.close_turn(), Role.PROMPT)
    for j in range(steps):
        a0, a1 = ep.append([*(rng.randrange(6, 64) for _ in range(rng.randint(1, 3))), *CHAT.turn_end], Role.ACTION)
        o0, _ = ep.append(CHAT.after_action(True), Role.PROMPT)
        ep.append([rng.randrange(6, 64) for _ in range(rng.randint(2, 4))], Role.OBSERVATION)
        _, o1 = ep.append(CHAT.close_turn() if j < steps - 1 else [], Role.PROMPT)
        lps = [-(seed + j / 10 + k / 100 + 0.001) for k in range(a1 - a0)] if logprobs else None
        ep.steps.append(Step(a0, a1, True, True, f"a{j}", obs_start=o0, obs_end=o1, sampler_logprobs=lps))
    return ep


def _aborted(seed: int) -> Episode:
    ep = _episode(seed, 1, logprobs=False, success=False)  # the engine failed mid-episode: no log-probs, no error
    ep.end_reason = EndReason.ABORTED
    return ep


def _assert_placed(batch: dict, episodes: list[Episode]) -> None:
    """Every action target of ``batch`` holds its token's sampler log-prob, read from the episodes (rows by
    ``episode_index``, transcript columns); the targets are exactly those tokens; everything else is 0."""
    b, mask = batch["behaviour_logprobs"], batch["action_mask"]
    assert b.dtype == torch.float32 and b.shape == batch["input_ids"].shape
    expected = torch.zeros_like(b)
    want = torch.zeros_like(mask)
    for r, e in enumerate(batch["episode_index"].tolist()):
        if e < 0 or bool(batch["aux_row"][r]) or episodes[e].aborted:
            continue
        for s in episodes[e].steps:
            expected[r, s.action_start: s.action_end] = torch.tensor(s.sampler_logprobs)
            want[r, s.action_start: s.action_end] = True
            assert batch["input_ids"][r, s.action_start: s.action_end].tolist() == episodes[e].tokens[s.action_start: s.action_end]
    assert torch.equal(mask, want)
    assert torch.equal(b, expected)


def test_collate_places_each_steps_sampler_logprobs_at_its_action_tokens():
    eps = [_episode(1, 2), _episode(2, 1), _aborted(3), _episode(4, 3)]  # different lengths: padding
    batch = collate(eps, PAD, behaviour=True)
    _assert_placed(batch, eps)
    assert int(batch["action_mask"].sum()) == sum(e.num_action_tokens for e in eps if not e.aborted)
    assert bool((batch["behaviour_logprobs"][2] == 0).all())  # the aborted row
    s = eps[0].steps[1]
    assert batch["behaviour_logprobs"][0, s.action_start].item() == pytest.approx(-(1 + 0.1 + 0.001))  # step 2, token 0
    plain = collate(eps, PAD)
    assert "behaviour_logprobs" not in plain and set(batch) - set(plain) == {"behaviour_logprobs"}
    assert all(torch.equal(plain[k], batch[k]) for k in plain)  # without it, the batch is today's
    # cut_minibatches passes the flag on
    mbs = cut_minibatches(eps, 3, PAD, random.Random(0), behaviour=True)
    assert len(mbs) == 2 and all("behaviour_logprobs" in mb for mb in mbs)
    for mb in mbs:
        _assert_placed(mb, eps)
    assert all("behaviour_logprobs" not in mb for mb in cut_minibatches(eps, 3, PAD, random.Random(0)))


@pytest.mark.parametrize("broken", ["missing", "wrong length"])
def test_collate_refuses_an_action_without_sampler_logprobs(broken):
    eps = [_episode(1, 2), _episode(2, 2)]
    step = eps[1].steps[1]
    step.sampler_logprobs = None if broken == "missing" else step.sampler_logprobs[:-1]
    with pytest.raises(ValueError, match=r"data\.max_lag >= 1.*rollout=vllm") as err:
        collate(eps, PAD, behaviour=True)
    assert "did not report its log-probs" in str(err.value) and "toy/train/0" in str(err.value)
    collate(eps, PAD)  # without the flag nothing reads them


def _forecast_batch(eps, order):
    base = collate([eps[i] for i in order], PAD, indices=order, behaviour=True)
    chunks, _ = build_chunks([eps[i] for i in order], CHAT, K=2, indices=order)
    return base, chunks


def test_cope_forecast_layouts_keep_the_sampler_logprobs_on_the_action_tokens():
    eps = [_episode(1, 3), _episode(2, 2, success=False), _episode(3, 2)]
    order = [2, 0, 1]  # rows in another order than the episode list
    base, chunks = _forecast_batch(eps, order)
    assert chunks and {c.episode for c in chunks} == {0, 2}
    for layout in (pack_forecasts, plain_forecasts):
        out = layout(base, eps, chunks, PAD)
        assert out["input_ids"].shape[1] > base["input_ids"].shape[1] or out["input_ids"].shape[0] > 3  # tokens added
        _assert_placed(out, eps)
        assert torch.equal(out["behaviour_logprobs"][out["action_mask"]], base["behaviour_logprobs"][base["action_mask"]])
        assert bool((out["behaviour_logprobs"][out["forecast_mask"]] == 0).all())
    plain = plain_forecasts(base, eps, chunks, PAD)
    assert bool((plain["behaviour_logprobs"][plain["aux_row"]] == 0).all()) and int(plain["aux_row"].sum()) == len(chunks)


def test_group_packing_keeps_the_sampler_logprobs_on_the_action_tokens():
    # two groups of two with a shared prompt, one episode alone
    eps = [_episode(1, 2, task=0, group=0), _episode(2, 1, task=1, group=1), _episode(3, 3, task=0, group=0),
           _episode(4, 2, task=1, group=1), _episode(5, 1, task=2, group=2)]
    base = collate(eps, PAD, behaviour=True)
    out = pack_groups(base, eps)
    assert any(len(m) > 1 for m in out["packed"].members)  # a prefix is shared
    _assert_placed(out, eps)
    assert torch.equal(out["behaviour_logprobs"][out["action_mask"]], base["behaviour_logprobs"][base["action_mask"]])
    # CoPE's joint rows under data.share_prefix: the forecast layout first, then the packing
    order = [0, 2, 1, 3, 4]
    joint, chunks = _forecast_batch(eps, order)
    both = pack_groups(pack_forecasts(joint, eps, chunks, PAD), eps)
    assert chunks and both["packed"] is not None
    _assert_placed(both, eps)
    assert torch.equal(both["behaviour_logprobs"][both["action_mask"]], joint["behaviour_logprobs"][joint["action_mask"]])
