"""CoPE forecast targets (cope.algos.cope.chunks.build_chunks) on hand-made episodes."""
import random

import pytest

from cope.algos.cope.chunks import build_chunks
from cope.chat import ChatFormat
from cope.envs.base import Task
from cope.episode import EndReason, Episode, Role, Step

# Scaffold ids 1..5, prompt text 10..11, actions 20..29 (step j: 20+2j, 21+2j), observations 40..49, harness 50.
CHAT = ChatFormat(system_open=(1,), user_open=(2,), assistant_open=(3,), turn_end=(4,), newline=(5,))
OBS = set(range(40, 50))


def make_episode(n=5, valid=None, closed=None, success=True, score=None, end_reason=EndReason.DONE):
    valid = valid or [True] * n
    closed = closed or [True] * n
    ep = Episode(task=Task("toy", "train", 0), group=0, success=success, end_reason=end_reason)
    ep.score = float(success) if score is None else score
    ep.append([*CHAT.system_open, 10, 11, *CHAT.turn_end, *CHAT.newline, *CHAT.user_open], Role.PROMPT)
    ep.append([40, 41], Role.OBSERVATION)
    ep.append(CHAT.close_turn(), Role.PROMPT)
    ep.prompt_len = len(ep.tokens)
    for j in range(n):
        a0, a1 = ep.append([20 + 2 * j, 21 + 2 * j, *(CHAT.turn_end if closed[j] else ())], Role.ACTION)
        o0, _ = ep.append(CHAT.after_action(closed[j]), Role.PROMPT)
        ep.append([42 + j % 8, 43], Role.OBSERVATION)
        ep.append([50], Role.HARNESS)
        _, o1 = ep.append(CHAT.close_turn() if j < n - 1 else [], Role.PROMPT)
        ep.steps.append(Step(a0, a1, closed[j], valid[j], f"a{j}", obs_start=o0, obs_end=o1))
    return ep


def action(ep, j):
    s = ep.steps[j]
    return ep.tokens[s.action_start : s.action_end]


def supervision_counts(chunks):
    counts = {}
    for c in chunks:
        for j in {j for j, t in zip(c.action_index, c.target) if t}:
            counts[(c.episode, j)] = counts.get((c.episode, j), 0) + 1
    return counts


def test_only_successful_not_aborted_episodes_give_targets():
    eps = [make_episode(success=False), make_episode(), make_episode(end_reason=EndReason.ABORTED)]
    chunks, m = build_chunks(eps, CHAT, K=3)
    assert {c.episode for c in chunks} == {1}
    assert m["forecast/episodes"] == 1 and m["forecast/targets"] == 5
    # a success_threshold replaces the success flag (reward > t, the authors' rule); gate=all admits failures
    eps[0].reward, eps[1].reward = 0.7, 0.2
    chunks, _ = build_chunks(eps, CHAT, K=3, success_threshold=0.5)
    assert {c.episode for c in chunks} == {0}
    chunks, m = build_chunks(eps, CHAT, K=3, gate="all")
    assert {c.episode for c in chunks} == {0, 1} and m["forecast/episodes"] == 2
    # mixed: the wins of groups that also lost (all three in group 0 here: episode 1 wins, episode 0 lost)
    chunks, _ = build_chunks(eps, CHAT, K=3, gate="mixed")
    assert {c.episode for c in chunks} == {1}
    with pytest.raises(ValueError, match="cope.gate must be one of"):
        build_chunks(eps, CHAT, K=3, gate="winners")


def test_chunk_content_skips_observations():
    ep = make_episode(closed=[True, False, True, True, True])
    chunks, _ = build_chunks([ep], CHAT, K=3)
    c0 = chunks[0]
    assert c0.step == 0 and c0.anchor == ep.steps[0].action_start
    # closed a0 ends with the sampled turn end: joiner is newline + assistant open;
    # a1 hit the cap: the joiner re-adds the turn end.
    assert c0.tokens == action(ep, 0) + [5, 3] + action(ep, 1) + [4, 5, 3] + action(ep, 2)
    assert c0.action_index == [0, 0, 0, -1, -1, 1, 1, -1, -1, -1, 2, 2, 2]
    assert c0.target == [j >= 0 for j in c0.action_index]
    assert c0.num_actions == 3
    for c in chunks:
        assert not OBS & set(c.tokens)
        assert 2 not in c.tokens and 50 not in c.tokens  # no user turn, no harness text
        roles = [ep.roles[ep.steps[c.step].action_start + i] for i in range(len(action(ep, c.step)))]
        assert roles and all(r == Role.ACTION for r in roles)


def test_chunks_cut_at_episode_end_and_ensemble_counts():
    ep = make_episode(n=5)
    chunks, m = build_chunks([ep], CHAT, K=3)
    assert [c.step for c in chunks] == [0, 1, 2, 3, 4]
    assert [c.num_actions for c in chunks] == [3, 3, 3, 2, 1]
    assert chunks[-1].tokens == action(ep, 4)
    counts = supervision_counts(chunks)
    assert [counts[(0, j)] for j in range(5)] == [1, 2, 3, 3, 3]
    assert m["forecast/ensemble_size"] == pytest.approx(12 / 5)
    assert m["forecast/masked_frac"] == 0.0


def test_invalid_actions_masked():
    ep = make_episode(n=5, valid=[True, True, False, True, True])
    chunks, m = build_chunks([ep], CHAT, K=3)
    assert len(chunks) == 5  # the chunk anchored at a2 still supervises a3 and a4
    for c in chunks:
        for j, t in zip(c.action_index, c.target):
            if j >= 0:
                assert t == (j != 2)
    assert [c.num_actions for c in chunks] == [2, 2, 2, 2, 1]
    # a2 (3 tokens) is in chunks 0, 1, 2; action tokens per chunk: 9, 9, 9, 6, 3
    assert m["forecast/masked_frac"] == pytest.approx(9 / 36)
    assert all(j != 2 for _, j in supervision_counts(chunks))
    # K=1: the anchor at the invalid action has nothing to supervise
    chunks, _ = build_chunks([ep], CHAT, K=1)
    assert [c.step for c in chunks] == [0, 1, 3, 4]
    chunks, m = build_chunks([ep], CHAT, K=3, mask_invalid=False)
    assert all(all(t for j, t in zip(c.action_index, c.target) if j >= 0) for c in chunks)
    assert m["forecast/masked_frac"] == 0.0


def test_cut_at_invalid():
    ep = make_episode(n=5, valid=[True, True, False, True, True])
    chunks, m = build_chunks([ep], CHAT, K=3, cut_at_invalid=True)
    assert [(c.step, c.num_actions) for c in chunks] == [(0, 2), (1, 1), (3, 2), (4, 1)]
    assert chunks[0].tokens == action(ep, 0) + [5, 3] + action(ep, 1)
    assert all(2 not in c.action_index for c in chunks)
    assert m["forecast/masked_frac"] == 0.0


def test_cold_start():
    chunks, m = build_chunks([make_episode(success=False), make_episode(success=False)], CHAT, K=3)
    assert chunks == [] and m["forecast/targets"] == 0 and m["forecast/episodes"] == 0
    assert m["forecast/ensemble_size"] == 0.0 and m["forecast/masked_frac"] == 0.0
    chunks, m = build_chunks([], CHAT)
    assert chunks == [] and m["forecast/targets"] == 0


def test_k1_is_the_action_itself():
    ep = make_episode(n=4)
    chunks, m = build_chunks([ep], CHAT, K=1)
    assert [c.tokens for c in chunks] == [action(ep, j) for j in range(4)]
    assert all(all(c.target) and c.num_actions == 1 for c in chunks)
    assert m["forecast/ensemble_size"] == 1.0


def test_sampled_anchors_and_indices():
    eps = [make_episode(n=6), make_episode(n=6)]
    a, _ = build_chunks(eps, CHAT, K=2, anchors="sample", max_anchors_per_episode=2, rng=random.Random(3), indices=[7, 9])
    b, _ = build_chunks(eps, CHAT, K=2, anchors="sample", max_anchors_per_episode=2, rng=random.Random(3), indices=[7, 9])
    assert [(c.episode, c.step) for c in a] == [(c.episode, c.step) for c in b]
    assert sorted({c.episode for c in a}) == [7, 9] and len(a) == 4
    for kwargs, word in [({"K": 0}, "K"), ({"anchors": "some"}, "anchors"), ({"anchors": "sample"}, "max_anchors"),
                         ({"max_anchors_per_episode": 2}, "max_anchors")]:
        with pytest.raises(ValueError, match=word):
            build_chunks(eps, CHAT, **kwargs)


def test_projected_actions_are_no_forecast_targets_unless_asked():
    """An action the env read out of free text (Step.projected) is valid for the env and the reward, but
    its tokens are prose: by default the forecast masks it like an invalid action (or cuts there)."""
    ep = make_episode(4)
    ep.steps[1].projected = True
    assert ep.steps[1].valid and not ep.steps[1].strict
    masked, _ = build_chunks([ep], CHAT, K=3)
    kept, _ = build_chunks([ep], CHAT, K=3, mask_projected=False)
    sup = lambda chunks: {j for c in chunks for j, t in zip(c.action_index, c.target) if t}  # noqa: E731
    assert 1 not in sup(masked) and 1 in sup(kept)
    assert sup(masked) == {0, 2, 3}
    cut, _ = build_chunks([ep], CHAT, K=3, cut_at_invalid=True)
    assert all(1 not in c.action_index for c in cut)
