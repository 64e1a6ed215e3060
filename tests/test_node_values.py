"""Node-value advantages over a branched group (TreeRL, ``algo.advantage_mode=node_value``):
:mod:`cope.train.collect.branching.node_values`, computed by hand on a small tree."""
from __future__ import annotations

import math

import pytest
import torch

from cope.batch import collate
from cope.envs.base import Task
from cope.episode import EndReason, Episode, Role, Step
from cope.train.collect.branching.node_values import node_value_advantages
from cope.train.collect.experience import assign_advantages


def _episode(reward: float, steps: int, group: int = 0, parent: int = -1, shared: int = 0) -> Episode:
    """``steps`` turns of one action token and one observation token each, after a one-token prompt."""
    e = Episode(task=Task(env="maze", split="train", index=0), group=group, reward=reward, branch_of=parent, shared_steps=shared)
    e.append([1], Role.PROMPT)
    for k in range(steps):
        a0, a1 = e.append([10 + k], Role.ACTION)
        o0, o1 = e.append([20 + k], Role.OBSERVATION)
        e.steps.append(Step(a0, a1, True, True, f"a{k}", obs_start=o0, obs_end=o1))
    e.prompt_len = 1
    return e


def _tree() -> list[Episode]:
    """Root A (3 steps, reward 1); B forks from A after 1 step (reward 0); C forks from A after 2 steps (reward 1);
    root D (2 steps, reward 0). Group mean 0.5."""
    return [_episode(1.0, 3), _episode(0.0, 3, parent=0, shared=1), _episode(1.0, 3, parent=0, shared=2),
            _episode(0.0, 2)]


def test_node_values_equal_treerl_by_hand():
    got = node_value_advantages(_tree(), [0, 0, 0, 0])
    root = 0.5
    abc = (2 * (2 / 3) - root - root) / math.sqrt(3)  # step 1 of A, B, C: leaves {A, B, C}, value 2/3
    ac = (2 * 1.0 - root - 2 / 3) / math.sqrt(2)  # step 2 of A and C: leaves {A, C}, value 1, after 2/3
    a_own = c_own = (2 * 1.0 - root - 1.0) / 1.0  # step 3 of A (of C): itself, value 1, after {A, C}'s 1
    b_own = (2 * 0.0 - root - 2 / 3) / 1.0  # steps 2-3 of B: itself, value 0, after {A, B, C}'s 2/3
    d = (2 * 0.0 - root - root) / 1.0  # D alone under the root
    want = [[abc, ac, a_own], [abc, b_own, b_own], [abc, ac, c_own], [d, d]]
    for g, w in zip(got, want):
        assert g == pytest.approx(w, abs=1e-12)


def test_without_forks_a_leaf_is_one_node_twice_drgrpo():
    eps = [_episode(r, 2, group=g) for g, r in ((0, 1.0), (0, 0.0), (0, 0.5), (1, 0.2), (1, 0.2))]
    got = node_value_advantages(eps, [e.group for e in eps])
    assert got[:3] == [pytest.approx([2 * (r - 0.5)] * 2) for r in (1.0, 0.0, 0.5)]
    assert got[3:] == [[0.0, 0.0], [0.0, 0.0]]  # equal rewards: no signal


def test_an_aborted_leaf_is_in_no_value_and_gets_zero():
    eps = _tree()
    eps[2].end_reason = EndReason.ABORTED  # C: its reward 1 no longer counts anywhere
    got = node_value_advantages(eps, [0] * 4)
    root = (1.0 + 0.0 + 0.0) / 3
    assert got[0][0] == pytest.approx((2 * 0.5 - 2 * root) / math.sqrt(2))  # {A, B} valid of {A, B, C}
    assert got[0][1] == pytest.approx(2 * 1.0 - root - 0.5)  # {A} valid of {A, C}: a new segment, after {A, B}
    assert got[2][2] == 0.0  # C's own step: no valid leaf


def test_a_link_outside_the_group_is_refused():
    eps = _tree()
    with pytest.raises(ValueError, match="branch_of=0 is not an earlier episode of its group"):
        node_value_advantages(eps, [0, 1, 0, 0])


def test_assign_and_collate_put_each_steps_advantage_on_its_action_tokens():
    eps = _tree()
    assign_advantages(eps, [0] * 4, "node_value")
    want = node_value_advantages(_tree(), [0] * 4)
    batch = collate(eps, pad_id=0)
    for i, e in enumerate(eps):
        assert e.step_advantages == pytest.approx(want[i]) and e.advantage == pytest.approx(e.reward - 0.5)
        for k, s in enumerate(e.steps):
            assert batch["advantages"][i, s.action_start].item() == pytest.approx(want[i][k], abs=1e-6)
            assert batch["advantages"][i, s.obs_start].item() == 0.0  # only action tokens carry it
    assign_advantages(eps, [0] * 4, "grpo")  # another mode clears the per-step values
    assert all(e.step_advantages is None for e in eps)
    flat = collate(eps, pad_id=0)["advantages"]
    assert torch.equal(flat[0][flat[0] != 0].unique(), torch.tensor([eps[0].advantage], dtype=flat.dtype))


def test_node_value_needs_a_branching_collector(compose, tmp_path):
    from cope.run.config_check import check_config
    from cope.run.config_keys import ConfigError

    with pytest.raises(ConfigError, match="data.advantage_mode"):
        check_config(compose(["algo.advantage_mode=node_value"], tmp_path))
