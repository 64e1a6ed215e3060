"""The vLLM engine's actor: one wave's next actions from the server, a seeded request per live episode and turn.

Each request is a single prompt (the transcript's ids) with its own seed derived from the rollout call's seed, the
wave, the episode slot and the turn (:func:`request_seed`): a fixed seed shared by several prompts would give them one
random stream. The answer's ids and log-probs come back as :class:`cope.rollout.loop.Sampled`.
"""
from __future__ import annotations

import hashlib
from typing import Any, Callable

from cope.rollout.engine import Sampling
from cope.rollout.loop import Sampled
from cope.rollout.vllm.client import Completion


def request_seed(*parts: Any) -> int:
    """A 31-bit seed from the parts (stable across processes and Python versions, unlike ``hash``)."""
    return int.from_bytes(hashlib.blake2b("/".join(map(str, parts)).encode(), digest_size=8).digest(), "little") % 2**31


class ServerActor:
    """The :class:`cope.rollout.loop.Actor` of one wave: every context's next action from the server at once."""

    def __init__(self, complete: Callable[[list[dict]], list], model: str, stop_ids: list[int], sampling: Sampling,
                 seed: int | None):
        self.complete, self.model, self.stop_ids, self.sampling, self.seed = complete, model, stop_ids, sampling, seed
        self.turns: dict[int, int] = {}

    def reset(self) -> None:
        """Nothing to clear: the turn counters survive, so an actor reused over several calls whose keys restart at 0
        (the branching collector's waves, :mod:`cope.train.collect.branching`) never sends one seed twice."""

    def fork(self) -> "ServerActor":
        return ServerActor(self.complete, self.model, self.stop_ids, self.sampling, self.seed)  # keys differ per part

    def request(self, context: list[int], key: int) -> dict:
        s, turn = self.sampling, self.turns.get(key, 0)
        self.turns[key] = turn + 1
        body = {"model": self.model, "prompt": list(context), "max_tokens": s.max_action_tokens, "temperature": s.temperature,
                "top_p": s.top_p, "n": 1, "logprobs": 1, "return_token_ids": True, "stop_token_ids": self.stop_ids,
                "skip_special_tokens": False}
        if self.seed is not None and s.temperature > 0:
            body["seed"] = request_seed(self.seed, key, turn)
        return body

    def __call__(self, contexts: list[list[int]], admissible=None, keys: list[int] | None = None) -> list:
        keys = list(range(len(contexts))) if keys is None else keys
        out = self.complete([self.request(c, k) for c, k in zip(contexts, keys)])
        return [Sampled(r.ids, r.logprobs) if isinstance(r, Completion) else r for r in out]
