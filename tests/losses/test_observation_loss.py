"""Hand-computed ECHO observation loss: HARNESS out of the numerator, in the denominator."""
import pytest
import torch

from cope.algos.echo import ObservationLoss, observation_nll
from cope.episode import Role
from cope.train.objectives import ForwardOut, combine

P, A, O, H, X = int(Role.PROMPT), int(Role.ACTION), int(Role.OBSERVATION), int(Role.HARNESS), int(Role.PAD)

# row 0: OBS lps -1, -2, -3 (num 6), one HARNESS lp -10 (excluded) -> den 4 -> 1.5
# row 1: OBS lp -4 -> 4 / 1 = 4
# row 2: aborted (excluded); row 3: valid but no observation (excluded)
ROLES = torch.tensor([
    [P, A, O, O, H, P, A, O],
    [P, A, O, X, X, X, X, X],
    [P, A, O, O, X, X, X, X],
    [P, A, A, X, X, X, X, X],
])
LP = torch.tensor([
    [0.0, -0.5, -1.0, -2.0, -10.0, -0.1, -0.5, -3.0],
    [0.0, -0.5, -4.0, 0.0, 0.0, 0.0, 0.0, 0.0],
    [0.0, -0.5, -7.0, -7.0, 0.0, 0.0, 0.0, 0.0],
    [0.0, -0.5, -0.5, 0.0, 0.0, 0.0, 0.0, 0.0],
])
ABORTED = torch.tensor([False, False, True, False])


def test_observation_nll_hand_case():
    lp = LP.clone().requires_grad_(True)
    loss, m = observation_nll(lp, ROLES, ~ABORTED)
    assert loss.item() == pytest.approx((6 / 4 + 4 / 1) / 2)  # 2.75
    assert float(m["echo/obs_tokens"]) == 4
    assert float(m["echo/harness_tokens"]) == 1
    assert float(m["echo/nll_per_token"]) == pytest.approx(10 / 4)
    loss.backward()
    g = lp.grad
    # d/dlp of mean_rows(-sum lp / den): row 0 obs -> -1/(4*2), row 1 obs -> -1/(1*2); all else 0
    expected = torch.zeros_like(LP)
    expected[0, [2, 3, 7]] = -1 / 8
    expected[1, 2] = -1 / 2
    torch.testing.assert_close(g, expected)
    assert g[0, 4] == 0.0  # the harness token is no target


def test_no_observation_rows_zero_loss_connected():
    lp = LP.clone().requires_grad_(True)
    loss, m = observation_nll(lp, ROLES, torch.tensor([False, False, False, True]))
    assert loss.item() == 0.0 and loss.requires_grad
    assert float(m["echo/nll_per_token"]) == 0.0
    loss.backward()
    assert torch.equal(lp.grad, torch.zeros_like(LP))


def test_harness_only_row_counts_in_mean():
    # a row whose observation is only harness text: num 0, den 1 -> contributes 0 to the mean
    roles = torch.tensor([[P, O, O], [P, H, X]])
    lp = torch.tensor([[0.0, -1.0, -3.0], [0.0, -9.0, 0.0]])
    loss, m = observation_nll(lp, roles, torch.tensor([True, True]))
    assert loss.item() == pytest.approx((4 / 2 + 0.0) / 2)
    assert float(m["echo/nll_per_token"]) == pytest.approx(2.0)


def _batch(forecast=None):
    b = {"roles": ROLES, "aborted": ABORTED}
    if forecast is not None:
        b["aux_row"] = forecast
    return b


def test_objective_via_combine():
    out = ForwardOut(logprobs=LP.clone().requires_grad_(True), entropy=torch.zeros_like(LP))
    total, m = combine([ObservationLoss()], out, _batch(), step=0)
    assert float(m["loss/echo"]) == pytest.approx(2.75)
    assert total.item() == pytest.approx(0.05 * 2.75)
    assert float(m["loss/total"]) == pytest.approx(0.05 * 2.75)


def test_objective_skips_aux_rows_and_schedules():
    out = ForwardOut(logprobs=LP.clone(), entropy=torch.zeros_like(LP))
    obj = ObservationLoss(weight=0.05, schedule="linear", final_weight=0.005, schedule_steps=10)
    total, m = combine([obj], out, _batch(torch.tensor([False, True, False, False])), step=5)
    # only row 0 left: 1.5; weight halfway: 0.0275
    assert float(m["loss/echo"]) == pytest.approx(1.5)
    assert total.item() == pytest.approx(0.0275 * 1.5)
    assert m["weight/echo"] == pytest.approx(0.0275)


def test_objective_validates_weight():
    with pytest.raises(ValueError, match="weight"):
        ObservationLoss(weight=-0.1)
