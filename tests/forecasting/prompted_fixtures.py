"""A fake scaffold, a fake tokenizer and hand-written transcripts for the prompted forecast sample tests.

Scaffold ids: system_open 1, user_open 2 7, assistant_open 3 8, turn end 4, newline 5, a second stop id 6 (an
eos id, as Qwen2.5's <|endoftext|>). Instructions 10 11, actions 20..29, observations 40..49, harness 50,
prompt texts 80..99 (the fake tokenizer knows only them)."""
from __future__ import annotations

from collections import Counter

from cope.chat import ChatFormat
from cope.envs.base import Task
from cope.episode import EndReason, Episode, Role, Step

CHAT = ChatFormat(system_open=(1,), user_open=(2, 7), assistant_open=(3, 8), turn_end=(4,), newline=(5,),
                  stop_ids=(4, 6))
LIST_TEXT = ("Plan ahead: list the next {} actions you will take to make progress on the task, starting with the "
             "action you take right now, one action per line.")
TURNS_TEXT = ("Plan ahead: give the next {} actions you will take to make progress on the task, one action per "
              "reply, starting with the action you take right now. Reply with the action only.")
P, A, O, H = Role.PROMPT, Role.ACTION, Role.OBSERVATION, Role.HARNESS


class FakeTokenizer:
    """Encodes only the prompt texts: "list" prompt for k -> [90, 90 + k], "turns" prompt -> [80, 80 + k],
    "Next action?" -> [95]. Counts the calls per text."""

    def __init__(self):
        self.vocab = {LIST_TEXT.format(k): [90, 90 + k] for k in range(1, 6)}
        self.vocab.update({TURNS_TEXT.format(k): [80, 80 + k] for k in range(1, 6)})
        self.vocab["Next action?"] = [95]
        self.calls: Counter[str] = Counter()

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        assert add_special_tokens is False
        self.calls[text] += 1
        return list(self.vocab[text])


def _append_step(ep: Episode, action: list[int], valid: bool, feedback: list[tuple[Role, list[int]]],
                 projected: bool = False) -> None:
    a0, a1 = ep.append(action, A)
    starts = [ep.append(ids, role) for role, ids in feedback]
    closed = bool(action) and action[-1] in (4, 6)
    ep.steps.append(Step(a0, a1, closed, valid, "", obs_start=starts[0][0], obs_end=starts[-1][1],
                         projected=projected))


def reference_episode() -> Episode:
    """Five steps. a0 valid; a1 invalid; a2 valid, cut at the token cap (no stop id: the turn end 4 is scaffold);
    a3 valid but projected, closed by the second stop id 6; a4 valid, the last action (the episode ends)."""
    ep = Episode(task=Task("toy", "train", 0), group=0, reward=1.0, success=True, score=1.0)
    ep.append([1, 10, 11, 4, 5, 2, 7], P)
    ep.append([40, 41], O)
    ep.append([4, 5, 3, 8], P)
    _append_step(ep, [20, 21, 4], True, [(P, [5, 2, 7]), (O, [42]), (P, [4, 5, 3, 8])])
    _append_step(ep, [22, 23, 4], False, [(P, [5, 2, 7]), (O, [43]), (H, [50]), (P, [4, 5, 3, 8])])
    _append_step(ep, [24, 25], True, [(P, [4, 5, 2, 7]), (O, [44]), (P, [4, 5, 3, 8])])
    _append_step(ep, [26, 27, 6], True, [(P, [5, 2, 7]), (O, [45]), (P, [4, 5, 3, 8])], projected=True)
    _append_step(ep, [28, 29, 4], True, [(P, [5, 2, 7]), (O, [46]), (P, [4])])
    return ep


def simple_episode(n: int, reward: float, group: int, valid: list[bool] | None = None,
                   actions: list[list[int]] | None = None, end_reason: str = EndReason.DONE) -> Episode:
    """``n`` closed actions (default [20 + 2j, 21 + 2j, 4]), each answered by one observation id."""
    valid = valid or [True] * n
    actions = actions or [[20 + 2 * j, 21 + 2 * j, 4] for j in range(n)]
    ep = Episode(task=Task("toy", "train", group), group=group, reward=reward, success=reward > 0.5,
                 score=reward, end_reason=end_reason)
    ep.append([1, 10, 11, 4, 5, 2, 7], P)
    ep.append([40, 41], O)
    ep.append([4, 5, 3, 8], P)
    for j in range(n):
        last = j == n - 1
        _append_step(ep, actions[j], valid[j], [(P, [5, 2, 7]), (O, [42 + j]), (P, [4] if last else [4, 5, 3, 8])])
    return ep
