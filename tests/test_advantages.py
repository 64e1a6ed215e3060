"""Hand-computed GRPO / Dr.GRPO group advantages."""
import math

import pytest
import torch

from cope.train.advantages import ADVANTAGE_MODES, group_advantages

# group 0: rewards [1, 0, 0]      -> mean 1/3, population std sqrt(2)/3
# group 1: rewards [1, 1]         -> zero signal
# group 2: rewards [1, 0, (5)]    -> third episode aborted: stats over [1, 0], mean 0.5, std 0.5
REWARDS = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 0.0, 5.0])
GROUPS = torch.tensor([0, 0, 0, 1, 1, 2, 2, 2])
VALID = torch.tensor([True, True, True, True, True, True, True, False])


def test_grpo_hand_case():
    adv, m = group_advantages(REWARDS, GROUPS, mode="grpo", eps=0.0, valid=VALID)
    s2 = math.sqrt(2.0)
    # (1 - 1/3) / (sqrt(2)/3) = 2/sqrt(2) = sqrt(2);  (0 - 1/3) / (sqrt(2)/3) = -1/sqrt(2)
    expected = torch.tensor([s2, -1 / s2, -1 / s2, 0.0, 0.0, 1.0, -1.0, 0.0])
    torch.testing.assert_close(adv, expected)
    assert adv[7] == 0.0  # aborted: exactly 0
    assert adv[3] == 0.0 and adv[4] == 0.0  # zero-signal group: exactly 0
    assert m["rollout/zero_signal_groups"] == pytest.approx(1 / 3)


def test_grpo_eps_in_denominator():
    adv, _ = group_advantages(torch.tensor([1.0, 0.0]), torch.tensor([0, 0]), eps=0.5)
    # mean 0.5, std 0.5 -> 0.5 / (0.5 + 0.5) = 0.5
    torch.testing.assert_close(adv, torch.tensor([0.5, -0.5]))


def test_drgrpo_hand_case():
    adv, m = group_advantages(REWARDS, GROUPS, mode="drgrpo", valid=VALID)
    expected = torch.tensor([2 / 3, -1 / 3, -1 / 3, 0.0, 0.0, 0.5, -0.5, 0.0])
    torch.testing.assert_close(adv, expected)
    assert m["rollout/zero_signal_groups"] == pytest.approx(1 / 3)


def test_zero_signal_is_exactly_zero_despite_rounding():
    # 0.1 is not exact in float32; a naive (r - mean) / (0 + eps) would give a visible residue
    adv, m = group_advantages(torch.tensor([0.1, 0.1, 0.1]), torch.tensor([7, 7, 7]))
    assert torch.equal(adv, torch.zeros(3))
    assert m["rollout/zero_signal_groups"] == 1.0


def test_non_contiguous_groups_and_all_aborted_group():
    rewards = torch.tensor([3.0, 1.0, 2.0, 9.0])
    groups = torch.tensor([10, 10, 4, 4])
    valid = torch.tensor([True, True, False, False])
    adv, m = group_advantages(rewards, groups, mode="drgrpo", valid=valid)
    torch.testing.assert_close(adv, torch.tensor([1.0, -1.0, 0.0, 0.0]))
    assert m["rollout/zero_signal_groups"] == 0.5  # the all-aborted group carries no signal


def test_unknown_mode_names_allowed():
    assert set(ADVANTAGE_MODES) == {"grpo", "drgrpo"}
    with pytest.raises(ValueError, match="drgrpo.*grpo"):
        group_advantages(REWARDS, GROUPS, mode="rloo")
