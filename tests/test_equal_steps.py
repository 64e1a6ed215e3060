"""bench.study.equal_steps: held-out success compared at equal env steps, by hand."""
from __future__ import annotations

import pytest

from bench.study.equal_steps import success_at, summarize


def _curve(steps, success):
    return {"env_steps": steps, "success": success}


def test_success_is_read_between_validations_and_never_past_the_last():
    c = _curve([0, 100, 200], [0.0, 0.4, 0.6])
    assert success_at(c, 150) == pytest.approx(0.5)
    assert success_at(c, 200) == pytest.approx(0.6)
    assert success_at(c, 201) is None


def test_arms_are_compared_at_the_cheapest_arms_last_env_steps_per_seed():
    # seed 0: branching ends at 120 env steps (GRPO at 200): GRPO read at 120 = 0.2 + 0.2 * 0.2 = 0.24; branch 0.5
    # seed 1: branching ends at 150 (GRPO 250): GRPO at 150 = 0.3 + 0.5 * 0.2 = 0.4; branch 0.3
    arms = {"grpo": {"runs": {0: _curve([0, 100, 200], [0.0, 0.2, 0.4]), 1: _curve([0, 100, 200, 250], [0.0, 0.3, 0.5, 0.5])}},
            "grpo_branch": {"runs": {0: _curve([0, 60, 120], [0.0, 0.3, 0.5]), 1: _curve([0, 75, 150], [0.0, 0.1, 0.3])}}}
    s = summarize(arms)
    assert s["budget"] == {0: 120, 1: 150}
    assert s["arms"]["grpo"]["success"][0] == pytest.approx((0.24 + 0.4) / 2)
    row = s["arms"]["grpo_branch"]
    assert row["success"][0] == pytest.approx(0.4)
    assert row["delta"][0] == pytest.approx(((0.5 - 0.24) + (0.3 - 0.4)) / 2) and row["delta"][3] == 2
    assert row["steps_ratio"] == pytest.approx((120 / 200 + 150 / 250) / 2)


def test_a_seed_that_one_arm_lacks_is_left_out():
    arms = {"grpo": {"runs": {0: _curve([0, 10], [0.0, 0.1]), 1: _curve([0, 10], [0.0, 0.2])}},
            "grpo_branch": {"runs": {1: _curve([0, 5], [0.0, 0.3])}}}
    s = summarize(arms)
    assert s["budget"] == {1: 5} and s["arms"]["grpo"]["n"] == 1


def test_the_same_comparison_at_equal_generated_tokens():
    """key="generated_tokens": the budget and the reads come from the tokens counter, the section says so."""
    from bench.study.equal_steps import lines

    arms = {"grpo": {"runs": {0: {"env_steps": [0, 100], "generated_tokens": [0, 1000], "success": [0.0, 0.5]}}},
            "grpo_branch": {"runs": {0: {"env_steps": [0, 80], "generated_tokens": [0, 400], "success": [0.0, 0.3]}}}}
    s = summarize(arms, "generated_tokens")
    assert s["key"] == "generated_tokens" and s["budget"] == {0: 400}
    assert s["arms"]["grpo"]["success"][0] == pytest.approx(0.2)  # 0.5 * 400 / 1000
    assert s["arms"]["grpo_branch"]["steps_ratio"] == pytest.approx(0.4)
    text = "\n".join(lines(s, {}))
    assert "### Held-out success at equal generated tokens" in text and "generated tokens of the whole run" in text
    assert summarize(arms)["budget"] == {0: 80}  # the default: env steps
