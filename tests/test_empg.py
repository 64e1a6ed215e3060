"""Hand-computed EMPG step modulation and its in-place application across minibatches."""
import math

import pytest
import torch

from cope.algos.empg.advantages import apply_empg, empg_step_advantages

K = 2 * math.log(2.0)  # exp(-K * 0.5) = 1/2, exp(-K * 1) = 1/4

# Steps: episode 1 (A=+1) H = 0, 1; episode 2 (A=-1) H = 2, 1.
#   Hn = [0, 0.5, 1, 0.5];  exp(-K Hn) = [1, 1/2, 1/4, 1/2], mean 9/16
#   g = [16/9, 8/9, 4/9, 8/9]
#   bonus for first steps (next step has Hn 0.5): 0.1 * exp(-K * 0.5) = 0.05
EXPECTED = [16 / 9 + 0.05, 8 / 9, -4 / 9 + 0.05, -8 / 9]


def test_empg_step_advantages_hand_case():
    adv, m = empg_step_advantages(
        step_entropy=torch.tensor([0.0, 1.0, 2.0, 1.0]),
        episode_adv=torch.tensor([1.0, 1.0, -1.0, -1.0]),
        has_next=torch.tensor([True, False, True, False]),
        next_entropy=torch.tensor([1.0, 0.0, 1.0, 0.0]),
        k=K, k_future=K, zeta=0.1,
    )
    torch.testing.assert_close(adv, torch.tensor(EXPECTED), atol=1e-6, rtol=0)
    assert m["empg/scale_mean"] == pytest.approx(1.0)
    assert m["empg/scale_min"] == pytest.approx(4 / 9)
    assert m["empg/scale_max"] == pytest.approx(16 / 9)
    assert m["empg/bonus_mean"] == pytest.approx(0.1 / 4)


def test_empg_single_step_is_identity():
    adv, m = empg_step_advantages(torch.tensor([3.0]), torch.tensor([-0.7]), torch.tensor([False]), torch.tensor([0.0]))
    torch.testing.assert_close(adv, torch.tensor([-0.7]))
    assert m["empg/scale_mean"] == pytest.approx(1.0)


def _minibatches():
    # mb0 row 0 = episode 1: P | step 0: A A O P | step 1: A A O ; row 1 = aborted episode (no action tokens)
    mb0 = {
        "step_ids": torch.tensor([[-1, 0, 0, 0, 0, 1, 1, 1], [-1, 0, 0, 0, -1, -1, -1, -1]]),
        "action_mask": torch.tensor([[False, True, True, False, False, True, True, False], [False] * 8]),
        # step 0 tokens (0, 0) -> H 0; step 1 tokens (0.5, 1.5) -> H 1; 9 off the action tokens is ignored
        "old_entropy": torch.tensor([[9.0, 0.0, 0.0, 9.0, 9.0, 0.5, 1.5, 9.0], [5.0] * 8]),
        "advantages": torch.tensor([[0.0, 1.0, 1.0, 0.0, 0.0, 1.0, 1.0, 0.0], [0.0] * 8]),
    }
    # mb1 row 0 = episode 2: P | step 0: A | step 1: A A  (H 2 and 1)
    mb1 = {
        "step_ids": torch.tensor([[-1, 0, 1, 1]]),
        "action_mask": torch.tensor([[False, True, True, True]]),
        "old_entropy": torch.tensor([[9.0, 2.0, 1.0, 1.0]]),
        "advantages": torch.tensor([[0.0, -1.0, -1.0, -1.0]]),
    }
    return [mb0, mb1]


def test_apply_empg_across_minibatches_no_normalize():
    mbs = _minibatches()
    m = apply_empg(mbs, k=K, k_future=K, zeta=0.1, normalize=False)
    a0, a1, b0, b1 = EXPECTED
    torch.testing.assert_close(mbs[0]["advantages"][0], torch.tensor([0.0, a0, a0, 0.0, 0.0, a1, a1, 0.0]), atol=1e-6, rtol=0)
    assert torch.equal(mbs[0]["advantages"][1], torch.zeros(8))  # aborted row untouched
    torch.testing.assert_close(mbs[1]["advantages"][0], torch.tensor([0.0, b0, b1, b1]), atol=1e-6, rtol=0)
    assert m["empg/steps"] == 4
    assert m["empg/scale_max"] == pytest.approx(16 / 9)


def test_apply_empg_normalizes_over_action_tokens():
    mbs = _minibatches()
    apply_empg(mbs, k=K, k_future=K, zeta=0.1, normalize=True)
    a0, a1, b0, b1 = EXPECTED
    raw = torch.tensor([a0, a0, a1, a1, b0, b1, b1], dtype=torch.float64)  # the 7 action tokens
    z = ((raw - raw.mean()) / raw.std(unbiased=False)).float()
    got = torch.cat([mbs[0]["advantages"][0][mbs[0]["action_mask"][0]], mbs[1]["advantages"][0][mbs[1]["action_mask"][0]]])
    torch.testing.assert_close(got, z, atol=1e-5, rtol=0)
    assert got.mean().item() == pytest.approx(0.0, abs=1e-6)
    assert got.std(unbiased=False).item() == pytest.approx(1.0, abs=1e-5)
    # off-action tokens stay 0
    assert torch.equal(mbs[0]["advantages"][~mbs[0]["action_mask"]], torch.zeros(4 + 8))
    assert mbs[1]["advantages"][0, 0] == 0.0


def test_apply_empg_skips_aux_rows():
    mbs = _minibatches()
    mbs[1]["aux_row"] = torch.tensor([True])
    before = mbs[1]["advantages"].clone()
    m = apply_empg(mbs, k=K, k_future=K, zeta=0.1, normalize=False)
    assert torch.equal(mbs[1]["advantages"], before)
    assert m["empg/steps"] == 2
    # only episode 1 left: H 0, 1 -> Hn 0, 1; exp(-K Hn) = 1, 1/4, mean 5/8; g = 8/5, 2/5; bonus 0.1 * 1/4
    torch.testing.assert_close(mbs[0]["advantages"][0, [1, 5]], torch.tensor([8 / 5 + 0.025, 2 / 5]), atol=1e-6, rtol=0)
