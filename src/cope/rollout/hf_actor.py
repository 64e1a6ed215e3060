"""Batched incremental sampling with a KV cache that persists across turns.

Multi-turn transcripts only ever grow by appending (token-in/token-out), so each turn the actor
feeds just the new tokens of every live episode (the feedback since its last action) on top of
the cache it already holds, then samples the next action token by token. Rows of episodes that
ended are dropped from the cache. Ragged suffixes are left-padded inside the new block; padded
slots are masked out of attention and position ids count real tokens only, so a row's logits equal
those of its unpadded transcript.

``model.generate`` would re-encode the whole history every turn (quadratic in episode length);
this is the cheaper path for long episodes and needs nothing beyond a causal LM's forward.
"""
from __future__ import annotations

import inspect
from collections.abc import Sequence

import torch

from cope.rollout.loop import Sampled


def cache_kwarg(model) -> str:
    """The name under which this model's forward takes and returns its KV cache: ``cache`` (transformers
    releases after the rename, this project's pin) or ``past_key_values`` (older ones, e.g. 5.17 on GPU images)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    params = inspect.signature(base.forward).parameters
    return "cache" if "cache" in params or "past_key_values" not in params else "past_key_values"


def sample_next(logits: torch.Tensor, temperature: float, top_p: float, generator: torch.Generator | None = None,
                logprobs: bool = False):
    """Pick one token per row from logits (B, V): greedy when temperature == 0, else nucleus sampling. ``logprobs``
    (top_p = 1): also each pick's log-prob under the distribution it was drawn from (temperature applied, whole
    vocabulary; temperature 1 for greedy), read off the same softmax: ``(tokens, logprobs)``, both (B,)."""
    if temperature <= 0:
        tok = logits.argmax(-1)
        if logprobs:
            return tok, torch.log_softmax(logits.float(), dim=-1).gather(-1, tok[:, None]).squeeze(-1)
        return tok
    probs = torch.softmax(logits.float() / temperature, dim=-1)  # (B, V)
    if top_p < 1.0:
        if logprobs:
            raise ValueError("sample_next: logprobs need top_p = 1 (nucleus-renormalized log-probs are not the policy's)")
        sorted_p, order = probs.sort(dim=-1, descending=True)
        drop = sorted_p.cumsum(-1) - sorted_p > top_p  # keep the smallest prefix with mass >= top_p
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_p)
    tok = torch.multinomial(probs, 1, generator=generator).squeeze(-1)  # (B,)
    if logprobs:  # a drawn token has probability > 0: its log is finite
        return tok, probs.gather(-1, tok[:, None]).squeeze(-1).log()
    return tok


class CachedSamplingActor:
    """Actor over a causal LM; keeps one KV cache for the live episodes of a rollout.

    Args:
        model: causal LM (peft-wrapped or not), already in eval mode.
        pad_id: id fed in padded slots (never attended to).
        stop_id: end-of-turn id, or the ids that all end a turn (``ChatFormat.stop_ids``, the primary one
            first); sampling stops for a row once it samples one of them.
        max_new_tokens: per-action token cap.
        temperature: 0 for greedy.
        top_p: nucleus mass.
        seed: the sampling generator's seed (None: the global generator).
        logprobs: also return each sampled token's log-prob under the distribution it was drawn from (temperature
            applied, over the whole vocabulary; :class:`cope.rollout.loop.Sampled`), as a server engine reports them.
    """

    def __init__(self, model, pad_id: int, stop_id: int | Sequence[int], max_new_tokens: int, temperature: float = 1.0,
                 top_p: float = 1.0, seed: int | None = None, logprobs: bool = False):
        self.stop_ids = (int(stop_id),) if isinstance(stop_id, int) else tuple(int(i) for i in stop_id)
        if not self.stop_ids:
            raise ValueError("CachedSamplingActor needs at least one stop id")
        self.model, self.pad_id, self.stop_id = model, pad_id, self.stop_ids[0]
        self.max_new_tokens, self.temperature, self.top_p = max_new_tokens, temperature, top_p
        self.logprobs = bool(logprobs)
        if self.logprobs and top_p < 1.0:  # the nucleus-renormalized log-probs would not be the trainer's
            raise ValueError("CachedSamplingActor: logprobs=True needs top_p=1")
        self.device = next(model.parameters()).device
        self._cache_kw = cache_kwarg(model)
        self._stops = torch.tensor(self.stop_ids, dtype=torch.long, device=self.device)  # (S,)
        self.generator = None
        if seed is not None:
            self.generator = torch.Generator(device=self.device).manual_seed(seed)
        self.reset()

    def fork(self) -> "CachedSamplingActor":
        """A second actor over the same model with its own cache (for another part of the live
        episodes, see ``chunks`` in :func:`cope.rollout.loop.run_episodes`); its sampling seed is drawn
        from this actor's generator, so a seeded rollout stays reproducible."""
        seed = None
        if self.generator is not None:
            seed = int(torch.randint(0, 2**62, (1,), generator=self.generator, device=self.device).item())
        return CachedSamplingActor(self.model, self.pad_id, self.stop_ids, self.max_new_tokens, self.temperature,
                                   self.top_p, seed=seed, logprobs=self.logprobs)

    def reset(self) -> None:
        self.keys: list[int] = []
        self.fed: list[int] = []  # tokens of each row already in the cache
        self.cache = None
        self.mask: torch.Tensor | None = None  # (B, cached columns)
        self.next_pos: torch.Tensor | None = None  # (B,)

    def _select(self, keys: list[int]) -> None:
        if keys == self.keys:
            return
        if self.cache is None or not set(keys) <= set(self.keys):
            self.reset()
            self.keys, self.fed = list(keys), [0] * len(keys)
            return
        rows = [self.keys.index(k) for k in keys]
        idx = torch.tensor(rows, device=self.device)
        self.cache.batch_select_indices(idx)
        self.mask, self.next_pos = self.mask[idx], self.next_pos[idx]
        self.fed = [self.fed[r] for r in rows]
        self.keys = list(keys)

    def _forward(self, ids: torch.Tensor, new_mask: torch.Tensor) -> torch.Tensor:
        """Feed a block (B, W) whose real tokens are marked by new_mask; returns last-column logits (B, V)."""
        from transformers import DynamicCache

        B = ids.shape[0]
        if self.cache is None:
            self.cache = DynamicCache()
            self.mask = torch.zeros((B, 0), dtype=torch.long, device=self.device)
            self.next_pos = torch.zeros((B,), dtype=torch.long, device=self.device)
        pos = self.next_pos[:, None] + new_mask.cumsum(-1) - 1  # (B, W)
        pos = pos.clamp(min=0)
        self.mask = torch.cat([self.mask, new_mask], dim=1)  # (B, past + W)
        self.next_pos = self.next_pos + new_mask.sum(-1)
        out = self.model(input_ids=ids, attention_mask=self.mask, position_ids=pos, use_cache=True, logits_to_keep=1,
                         **{self._cache_kw: self.cache})
        self.cache = getattr(out, self._cache_kw)
        return out.logits[:, -1]  # (B, V)

    @torch.no_grad()
    def __call__(self, contexts: list[list[int]], admissible=None, keys: list[int] | None = None) -> list:
        keys = list(range(len(contexts))) if keys is None else keys
        self._select(keys)
        suffixes = []
        for r, ctx in enumerate(contexts):
            if self.fed[r] > len(ctx):
                raise ValueError("a context shrank between turns: transcripts must only grow")
            suffixes.append(ctx[self.fed[r]:])
        W = max(1, max(len(s) for s in suffixes))
        B = len(contexts)
        ids = torch.full((B, W), self.pad_id, dtype=torch.long)
        new_mask = torch.zeros((B, W), dtype=torch.long)
        for r, s in enumerate(suffixes):  # left padding inside the new block: the last column is real
            if s:
                ids[r, W - len(s):] = torch.tensor(s, dtype=torch.long)
                new_mask[r, W - len(s):] = 1
            self.fed[r] += len(s)
        if any(not s for s in suffixes):
            raise ValueError("every live context needs at least one new token before its next action")
        logits = self._forward(ids.to(self.device), new_mask.to(self.device))
        out: list[list[int]] = [[] for _ in range(B)]
        lps: list[list[float]] = [[] for _ in range(B)]
        active = torch.ones(B, dtype=torch.bool, device=self.device)
        for step in range(self.max_new_tokens):
            if self.logprobs:  # the sampled token's log-prob at the sampling temperature, whole vocabulary
                tok, lp_t = sample_next(logits, self.temperature, self.top_p, self.generator, logprobs=True)  # (B,), (B,)
                lp = lp_t.tolist()
            else:
                tok = sample_next(logits, self.temperature, self.top_p, self.generator)  # (B,)
            tl = tok.tolist()
            for r in active.nonzero().flatten().tolist():
                out[r].append(tl[r])
                if self.logprobs:
                    lps[r].append(lp[r])
            active = active & ~torch.isin(tok, self._stops)  # with one stop id: exactly tok != stop_id
            if step == self.max_new_tokens - 1 or not bool(active.any()):
                break  # the last sampled tokens are fed with the next turn's block
            feed = torch.where(active, tok, torch.full_like(tok, self.pad_id))
            logits = self._forward(feed[:, None], active.long()[:, None])
            for r in active.nonzero().flatten().tolist():
                self.fed[r] += 1
        return [Sampled(ids, lp) for ids, lp in zip(out, lps)] if self.logprobs else out
