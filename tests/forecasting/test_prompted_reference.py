"""The authors' prompted forecast sample (cope.algos.cope.prompted) against a hand-written reference.

Every expected sequence below is written out by hand from the transcript of ``reference_episode`` (see
prompted_fixtures.py for the ids): prefix ``H_t`` = the transcript up to obs_t's turn end and newline, then
``user_open prompt(k) end nl assistant_open`` and the listed actions (the sampled stop ids dropped)."""
from __future__ import annotations

import math

import pytest
from prompted_fixtures import CHAT, LIST_TEXT, FakeTokenizer, reference_episode, simple_episode

from cope.algos.cope.prompted import PlanPrompt, build_prompted
from cope.episode import EndReason

F, T = False, True
# tokens[:anchor] of step t, written out from the fixture transcript
H0 = [1, 10, 11, 4, 5, 2, 7, 40, 41, 4, 5]
H1 = H0 + [3, 8, 20, 21, 4, 5, 2, 7, 42, 4, 5]
H2 = H1 + [3, 8, 22, 23, 4, 5, 2, 7, 43, 50, 4, 5]
H3 = H2 + [3, 8, 24, 25, 4, 5, 2, 7, 44, 4, 5]
H4 = H3 + [3, 8, 26, 27, 6, 5, 2, 7, 45, 4, 5]
PREFIX = [H0, H1, H2, H3, H4]
J = [5, 2, 7, 95, 4, 5, 3, 8]  # between two actions of layout `turns`: newline, the "Next action?" user turn


def head(k):  # the plan-ahead user turn of layout `list`, then the assistant's opening
    return [2, 7, 90, 90 + k, 4, 5, 3, 8]


def head_turns(k):
    return [2, 7, 80, 80 + k, 4, 5, 3, 8]


# step t -> (chunk tokens, target, action_index) or None (no sample at t), layout `list`
LIST = {
    "skip": {
        0: (head(3) + [20, 21, 5, 24, 25, 5, 28, 29, 4], [F] * 8 + [T] * 9, [-1] * 8 + [0, 0, 0, 2, 2, 2, 4, 4, 4]),
        1: (head(2) + [24, 25, 5, 28, 29, 4], [F] * 8 + [T] * 6, [-1] * 8 + [2, 2, 2, 4, 4, 4]),
        2: (head(2) + [24, 25, 5, 28, 29, 4], [F] * 8 + [T] * 6, [-1] * 8 + [2, 2, 2, 4, 4, 4]),
        3: (head(1) + [28, 29, 4], [F] * 8 + [T] * 3, [-1] * 8 + [4, 4, 4]),
        4: (head(1) + [28, 29, 4], [F] * 8 + [T] * 3, [-1] * 8 + [4, 4, 4]),
    },
    "mask": {
        0: (head(3) + [20, 21, 5, 22, 23, 5, 24, 25, 4], [F] * 8 + [T, T, T, F, F, F, T, T, T],
            [-1] * 8 + [0, 0, 0, 1, 1, 1, 2, 2, 2]),
        1: (head(3) + [22, 23, 5, 24, 25, 5, 26, 27, 4], [F] * 8 + [F, F, F, T, T, T, F, F, F],
            [-1] * 8 + [1, 1, 1, 2, 2, 2, 3, 3, 3]),
        2: (head(3) + [24, 25, 5, 26, 27, 5, 28, 29, 4], [F] * 8 + [T, T, T, F, F, F, T, T, T],
            [-1] * 8 + [2, 2, 2, 3, 3, 3, 4, 4, 4]),
        3: (head(2) + [26, 27, 5, 28, 29, 4], [F] * 8 + [F, F, F, T, T, T], [-1] * 8 + [3, 3, 3, 4, 4, 4]),
        4: (head(1) + [28, 29, 4], [F] * 8 + [T] * 3, [-1] * 8 + [4, 4, 4]),
    },
    "cut": {
        0: (head(1) + [20, 21, 4], [F] * 8 + [T] * 3, [-1] * 8 + [0, 0, 0]),
        1: None,
        2: (head(1) + [24, 25, 4], [F] * 8 + [T] * 3, [-1] * 8 + [2, 2, 2]),
        3: None,
        4: (head(1) + [28, 29, 4], [F] * 8 + [T] * 3, [-1] * 8 + [4, 4, 4]),
    },
}
SUPERVISED = {"skip": [3, 2, 2, 1, 1], "mask": [2, 1, 2, 1, 1], "cut": [1, None, 1, None, 1]}


def build(episodes, layout="list", tok=None, **kw):
    return build_prompted(episodes, CHAT, PlanPrompt(tok or FakeTokenizer(), layout), **kw)


@pytest.mark.parametrize("invalid", ["skip", "mask", "cut"])
def test_list_layout_matches_the_hand_reference(invalid):
    ep = reference_episode()
    chunks, _ = build([ep], K=3, invalid=invalid)
    want = {t: v for t, v in LIST[invalid].items() if v is not None}
    assert [c.step for c in chunks] == sorted(want)
    for c in chunks:
        tokens, target, index = want[c.step]
        assert ep.tokens[: c.anchor] == PREFIX[c.step]
        assert ep.tokens[: c.anchor] + c.tokens == PREFIX[c.step] + tokens
        assert (c.tokens, c.target, c.action_index) == (tokens, target, index)
        assert c.num_actions == SUPERVISED[invalid][c.step] and c.episode == 0 and c.weight == 1.0


def test_turns_layout_matches_the_hand_reference():
    ep = reference_episode()
    chunks, _ = build([ep], "turns", K=3, invalid="skip")
    t0 = head_turns(3) + [20, 21, 4] + J + [24, 25, 4] + J + [28, 29, 4]
    tg0 = [F] * 8 + [T] * 3 + [F] * 8 + [T] * 3 + [F] * 8 + [T] * 3
    ix0 = [-1] * 8 + [0] * 3 + [-1] * 8 + [2] * 3 + [-1] * 8 + [4] * 3
    assert (chunks[0].tokens, chunks[0].target, chunks[0].action_index) == (t0, tg0, ix0)
    assert chunks[1].tokens == head_turns(2) + [24, 25, 4] + J + [28, 29, 4]
    assert chunks[3].tokens == head_turns(1) + [28, 29, 4] and chunks[3].target == [F] * 8 + [T] * 3
    masked, _ = build([ep], "turns", K=3, invalid="mask")
    assert masked[0].tokens == head_turns(3) + [20, 21, 4] + J + [22, 23, 4] + J + [24, 25, 4]
    assert masked[0].target == [F] * 8 + [T] * 3 + [F] * 8 + [F] * 3 + [F] * 8 + [T] * 3


def test_projected_actions_count_only_with_mask_projected():
    ep = reference_episode()
    chunks, _ = build([ep], K=3, invalid="skip", mask_projected=False)
    # a3 (closed by the second stop id 6, which is dropped) is listed now; a1 is still looked past
    assert chunks[0].tokens == head(3) + [20, 21, 5, 24, 25, 5, 26, 27, 4]
    assert chunks[1].tokens == head(3) + [24, 25, 5, 26, 27, 5, 28, 29, 4]
    assert [c.step for c in chunks] == [0, 1, 2, 3, 4] and chunks[3].tokens == head(2) + [26, 27, 5, 28, 29, 4]


def test_projected_masked_is_counted_and_warned_once_when_it_leaves_no_sample(caplog):
    """``forecast/projected_masked`` counts the accepted actions read out of prose in kept episodes (0 without the
    mask); when they leave an epoch without a sample, CopeForecasts says once which key to set."""
    from cope.algos.cope.forecasts import CopeForecasts

    ep = reference_episode()
    assert build([ep], K=3, mask_projected=False)[1]["forecast/projected_masked"] == 0.0
    prose = simple_episode(3, reward=1.0, group=0)
    for s in prose.steps:
        s.projected = True  # every answer read by the projection (SmolLM2's early answers)
    chunks, m = build([prose], K=3)
    assert chunks == [] and m["forecast/projected_masked"] == 3.0
    cb = CopeForecasts(K=3)
    cb._chat, cb._plan = CHAT, PlanPrompt(FakeTokenizer())  # what setup() reads from the policy
    with caplog.at_level("WARNING", logger="cope.algos.cope.forecasts"):
        for _ in range(2):  # two epochs: one warning
            assert cb.samples([prose])[0] == []
        assert cb.samples([ep])[0] != []  # masked, but other samples remain: no warning
    warned = [r.getMessage() for r in caplog.records if "cope.mask_projected=false" in r.getMessage()]
    assert len(warned) == 1 and "3 actions" in warned[0]
    cb = CopeForecasts(K=3, mask_projected=False)
    cb._chat, cb._plan = CHAT, PlanPrompt(FakeTokenizer())
    assert len(cb.samples([prose])[0]) == 3


def test_metrics_and_prompt_tokenized_once_per_k():
    tok = FakeTokenizer()
    ep = reference_episode()
    _, m = build([ep], tok=tok, K=3, invalid="skip")
    assert m == {"forecast/samples": 5.0, "forecast/trajectories": 1.0, "forecast/groups_skipped_mixed": 0.0,
                 "forecast/k_mean": (3 + 2 + 2 + 1 + 1) / 5, "forecast/weight_std": 0.0,
                 "forecast/target_tokens": 9 + 6 + 6 + 3 + 3, "forecast/dropped_long": 0.0,
                 # t=0 looks past a1 and a3, t=1 past a1 and a3, t=2 and t=3 past a3
                 "forecast/invalid_skipped": 2 + 2 + 1 + 1, "forecast/projected_masked": 1.0}  # a3
    assert {LIST_TEXT.format(k): 1 for k in (1, 2, 3)}.items() <= tok.calls.items()
    assert sum(tok.calls.values()) == 3 + 1  # + "Next action?" once, at construction
    _, m = build([ep], K=3, invalid="mask")
    assert m["forecast/invalid_skipped"] == 0 and m["forecast/target_tokens"] == 6 + 3 + 6 + 3 + 3
    chunks, m = build([ep], K=1, invalid="skip")
    assert [c.tokens for c in chunks] == [head(1) + [20, 21, 4], head(1) + [24, 25, 4], head(1) + [24, 25, 4],
                                          head(1) + [28, 29, 4], head(1) + [28, 29, 4]]
    assert m["forecast/invalid_skipped"] == 1 + 1


def test_empty_actions_are_never_listed():
    ep = simple_episode(3, 1.0, 0, actions=[[20, 21, 4], [4], [24, 25, 4]])
    skip, m = build([ep], K=3, invalid="skip")
    assert [c.tokens for c in skip] == [head(2) + [20, 21, 5, 24, 25, 4], head(1) + [24, 25, 4], head(1) + [24, 25, 4]]
    assert m["forecast/invalid_skipped"] == 1 + 1
    mask, _ = build([ep], K=3, invalid="mask")
    assert [c.tokens for c in mask] == [head(2) + [20, 21, 5, 24, 25, 4], head(1) + [24, 25, 4], head(1) + [24, 25, 4]]


def test_long_samples_are_dropped_and_counted():
    ep = reference_episode()
    # full lengths under skip: 11 + 17 = 28, 22 + 14 = 36, 34 + 14 = 48, 45 + 11 = 56, 56 + 11 = 67
    chunks, m = build([ep], K=3, invalid="skip", max_context=48)
    assert [c.step for c in chunks] == [0, 1, 2]
    assert m["forecast/dropped_long"] == 2 and m["forecast/samples"] == 3
    assert m["forecast/invalid_skipped"] == 2 + 2 + 1  # counted over the returned samples only
    chunks, m = build([ep], K=3, invalid="skip", max_context=27)
    assert chunks == [] and m["forecast/dropped_long"] == 5 and m["forecast/trajectories"] == 0


def groups():
    """Index: (group, reward, steps). e4's 0.5 is not a win (reward must exceed 0.5); e8 and e10 are aborted
    (e8 with a winning reward); e11 wins but all its actions are invalid, so it gives no sample."""
    ab = EndReason.ABORTED
    return [simple_episode(2, 1.0, 0), simple_episode(3, 1.0, 0), simple_episode(2, 0.0, 0),
            simple_episode(1, 1.0, 1), simple_episode(1, 0.5, 1),
            simple_episode(2, 1.0, 2), simple_episode(1, 1.0, 2),
            simple_episode(2, 0.0, 3), simple_episode(2, 1.0, 3, end_reason=ab),
            simple_episode(2, 1.0, 4), simple_episode(1, 0.0, 4, end_reason=ab),
            simple_episode(2, 1.0, 1, valid=[False, False])]


def weights_by_episode(chunks):
    out = {}
    for c in chunks:
        out.setdefault(c.episode, set()).add(round(c.weight, 12))
    return out


def test_gate_wins_and_group_weights():
    chunks, m = build(groups(), K=3)
    # m_g: g0 2 (e0, e1), g1 1 (e3; e11 gave no sample), g2 2 (e5, e6), g4 1 (e9); raw 1/m_g over
    # 2 + 3 + 1 + 2 + 1 + 2 = 11 samples sums to 7, so 1/2 -> 11/14 and 1 -> 11/7
    w = {0: 11 / 14, 1: 11 / 14, 3: 11 / 7, 5: 11 / 14, 6: 11 / 14, 9: 11 / 7}
    assert weights_by_episode(chunks) == {e: {round(v, 12)} for e, v in w.items()}
    assert m["forecast/samples"] == 11 and m["forecast/trajectories"] == 6
    assert math.isclose(sum(c.weight for c in chunks), 11)
    assert math.isclose(m["forecast/weight_std"], math.sqrt((8 * (3 / 14) ** 2 + 3 * (8 / 14) ** 2) / 10))
    plain, m = build(groups(), K=3, group_weights=False)
    assert [c.weight for c in plain] == [1.0] * 11 and m["forecast/weight_std"] == 0.0


def test_gate_all():
    chunks, m = build(groups(), K=3, gate="all")
    # every episode but the aborted e8 and e10; m_g: g0 3, g1 2 (e3, e4), g2 2, g3 1 (e7), g4 1 (e9);
    # 16 samples, raw sum 7/3 + 2/2 + 3/2 + 2 + 2 = 53/6, mean 53/96: 1/3 -> 32/53, 1/2 -> 48/53, 1 -> 96/53
    w = {0: 32 / 53, 1: 32 / 53, 2: 32 / 53, 3: 48 / 53, 4: 48 / 53, 5: 48 / 53, 6: 48 / 53, 7: 96 / 53, 9: 96 / 53}
    assert weights_by_episode(chunks) == {e: {round(v, 12)} for e, v in w.items()}
    assert m["forecast/samples"] == 16 and m["forecast/trajectories"] == 9 and m["forecast/groups_skipped_mixed"] == 0


def test_gate_mixed():
    chunks, m = build(groups(), K=3, gate="mixed")
    # g0 and g1 hold a win and a loss; g2 only wins; g4 only wins once its aborted e10 is left out (as GRPO
    # leaves it out of the group statistics); g3 holds no win. Kept: e0, e1, e3 (e11 gives no sample).
    # m_g: g0 2 -> 1/2 over 5 samples, g1 1 -> 1 over 1 sample; mean 7/12: 6/7 and 12/7
    assert weights_by_episode(chunks) == {0: {round(6 / 7, 12)}, 1: {round(6 / 7, 12)}, 3: {round(12 / 7, 12)}}
    assert m["forecast/groups_skipped_mixed"] == 2 and m["forecast/trajectories"] == 3 and m["forecast/samples"] == 6


def test_indices_and_bad_arguments():
    chunks, _ = build([simple_episode(2, 1.0, 0)], K=3, indices=[7])
    assert {c.episode for c in chunks} == {7}
    with pytest.raises(ValueError, match="K must be"):
        build([], K=0)
    with pytest.raises(ValueError, match="invalid must be"):
        build([], invalid="drop")
    with pytest.raises(ValueError, match="gate must be"):
        build([], gate="losses")
    with pytest.raises(ValueError, match="layout must be"):
        PlanPrompt(FakeTokenizer(), "lines")
    with pytest.raises(ValueError, match="needs '{k}'"):
        PlanPrompt(FakeTokenizer(), prompt="Plan ahead.")
    ep = simple_episode(2, 1.0, 0)
    ep.tokens[ep.steps[1].action_start - 3] = 9  # the turn end before a1's assistant opening
    with pytest.raises(ValueError, match="not preceded"):
        build([ep], K=3)
