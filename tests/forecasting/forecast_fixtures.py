"""Hand-made episodes and constants shared by the forecast layout and gradient tests."""
from __future__ import annotations

import random

import transformers

from cope.chat import ChatFormat
from cope.envs.base import Task
from cope.episode import Episode, Role, Step

CHAT = ChatFormat(system_open=(1,), user_open=(2,), assistant_open=(3,), turn_end=(4,), newline=(5,))
NO_JOINER = ChatFormat(system_open=(1,), user_open=(2,), assistant_open=(), turn_end=(4,), newline=())  # empty joiner when closed
CFG = transformers.Qwen2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                               num_key_value_heads=2, vocab_size=64)
PAD = 0


def make_episode(chat, n, success, seed, valid=None, closed=None, min_action_len=1):
    rng = random.Random(seed)
    rand = lambda k: [rng.randrange(6, 64) for _ in range(k)]  # noqa: E731
    valid, closed = valid or [True] * n, closed or [True] * n
    ep = Episode(task=Task("toy", "train", 0), group=0, success=success, score=float(success))
    ep.append([*chat.system_open, *rand(3), *chat.turn_end, *chat.newline, *chat.user_open], Role.PROMPT)
    ep.append(rand(3), Role.OBSERVATION)
    ep.append(chat.close_turn(), Role.PROMPT)
    for j in range(n):
        a0, a1 = ep.append(rand(rng.randint(min_action_len, 3)) + (list(chat.turn_end) if closed[j] else []), Role.ACTION)
        o0, _ = ep.append(chat.after_action(closed[j]), Role.PROMPT)
        ep.append(rand(rng.randint(2, 4)), Role.OBSERVATION)
        _, o1 = ep.append(chat.close_turn() if j < n - 1 else [], Role.PROMPT)
        ep.steps.append(Step(a0, a1, closed[j], valid[j], f"a{j}", obs_start=o0, obs_end=o1))
    return ep


def capture_logger():
    """A Lightning logger that keeps every ``log_metrics`` call as ``(step, metrics)`` in ``.rows`` (no files)."""
    from lightning.pytorch.loggers import Logger

    class Capture(Logger):
        name, version = "capture", 0

        def __init__(self):
            super().__init__()
            self.rows = []

        def log_metrics(self, metrics, step=None):
            self.rows.append((step, dict(metrics)))

        def log_hyperparams(self, *args, **kwargs):
            pass

    return Capture()


def segment_mask(batch: dict, chunks: list):
    """(N, 1, T, T) bool, True = attend: the packed joint rows' attention written out by hand from the segments, the
    reference their prefix tree must equal. Transcript tokens attend causally; a segment (``forecast_chunk == c``, its
    repeated first token included) attends transcript keys before ``anchor - 1`` and itself causally; padding itself."""
    import torch

    N, T = batch["input_ids"].shape
    keep = torch.eye(T, dtype=torch.bool).repeat(N, 1, 1)  # (N, T, T)
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    for r in range(N):
        seg = batch["forecast_chunk"][r]  # (T,)
        n = int(((seg < 0) & batch["attention_mask"][r].bool()).sum())  # the transcript: real tokens in no segment
        keep[r, :n, :n] = causal[:n, :n]
        for c in seg[seg >= 0].unique().tolist():
            cols = (seg == c).nonzero().squeeze(-1)
            a, b = int(cols[0]), int(cols[-1]) + 1
            keep[r, a:b, : chunks[c].anchor - 1] = True
            keep[r, a:b, a:b] = causal[: b - a, : b - a]
    return keep[:, None]
