"""Episodes -> padded training tensors: the batch contract (:class:`RolloutBatch`) and :func:`collate`.

Log-prob convention: position t holds log p(input_ids[t] | input_ids[:t]); position 0 holds 0.
"""
from __future__ import annotations

from typing import TypedDict

import torch

from cope.episode import Episode, Role


class RolloutBatch(TypedDict, total=False):
    """One minibatch of N sequences, T tokens, right padded (a dict at run time: transforms add keys).

    Made by :func:`collate`:
        input_ids (N, T) long: the exact transcript ids; pad id past the end.
        attention_mask (N, T) long: 1 on real tokens. A transform may replace it by a 4D additive float
            mask (N, 1, T, T); then ``position_ids`` must be honoured.
        position_ids (N, T) long.
        roles (N, T) long: :class:`cope.episode.Role` values, PAD = -1.
        step_ids (N, T) long: the step a token belongs to, -1 for the first prompt and padding.
        action_mask (N, T) bool: policy-gradient targets, the ACTION tokens of non-aborted episodes.
        invalid_mask (N, T) bool: the part of ``action_mask`` whose step the env refused (``Step.valid`` False);
            SFT leaves it out by default (:mod:`cope.algos.sft.loss`).
        advantages (N, T) float: the episode's advantage on its action tokens, 0 elsewhere.
        aborted (N,) bool: the episode was aborted (env error); ECHO leaves such rows out.
        unclean_steps (N,) long: the episode's actions not in the env's strict format (``Step.strict`` False: the env
            refused it, or read it out of free text under ``env.action_parsing=project``); ECHO's clean-rollout
            filter (``clean_only``) leaves rows with any out.
        episode_index (N,) long: index into the epoch's episode list (-1: a row a transform appended).
        aux_row (N,) bool: rows that are not episode transcripts (all False here; CoPE's plain forecast
            packing appends such rows): transcript-level objectives (ECHO, EMPG) skip them.
        behaviour_logprobs (N, T) float32, only with ``collate(..., behaviour=True)`` (``data.max_lag`` >= 1): the
            sampler's own log-prob of each ACTION token of a non-aborted episode (``Step.sampler_logprobs``, the
            behaviour policy that sampled it), 0 elsewhere. The policy gradient weights each token by
            pi_old / pi_behaviour (:func:`cope.algos.grpo.clipped_pg_loss`). A transform that moves or adds tokens
            keeps it aligned with ``action_mask`` (the forecast packings pad every (N, T) key with 0, where
            ``action_mask`` is False).

    Added by CoPE (:mod:`cope.algos.cope.packing`): ``forecast_mask`` (N, T) bool, ``forecast_chunk`` (N, T)
    long, ``forecast_actions`` (C,) long, ``forecast_weight`` (C,) float. CoPE's separate update trains batches of its
    own, ``kind == "forecast"`` (:func:`cope.algos.cope.packing.collate_chunks`; no ``kind``: a rollout minibatch).
    The temporal ensemble's scored transform adds ``te_position`` (P, 2) long [row, column], ``te_ids`` (P, M) long
    and ``te_probs`` (P, M) float.

    Shared prefixes: ``packed``, a :class:`cope.train.packing.tree_batch.PackedRows` (not a tensor): the rows the model
    forwards, trees of a prefix stored once and its branches, with ``index`` from every token of the batch's rows to
    its place in them. The one form for all three producers: GRPO groups (``data.share_prefix``,
    :func:`cope.train.packing.group_prefix.pack_groups`), CoPE's packed joint rows (each row a transcript and its forecast
    segments, :func:`cope.algos.cope.packing.pack_forecasts`) and CoPE's separate forecast steps with
    ``data.share_prefix`` (:func:`cope.algos.cope.shared_prefix.collate_shared`: the packed rows are the batch's
    rows, identity index). Every other key keeps the batch rows' shape, and so do the module's log-probs.

    Filled by the module's scoring pass before any update (same shape as ``input_ids``):
    ``old_logprobs``, ``old_entropy``, and ``ref_logprobs`` when a KL term is on. EMPG's scored
    transform then rewrites ``advantages`` in place.
    """

    kind: str
    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    position_ids: torch.Tensor
    roles: torch.Tensor
    step_ids: torch.Tensor
    action_mask: torch.Tensor
    invalid_mask: torch.Tensor
    advantages: torch.Tensor
    aborted: torch.Tensor
    unclean_steps: torch.Tensor
    episode_index: torch.Tensor
    aux_row: torch.Tensor
    behaviour_logprobs: torch.Tensor
    forecast_mask: torch.Tensor
    forecast_chunk: torch.Tensor
    forecast_actions: torch.Tensor
    forecast_weight: torch.Tensor
    te_position: torch.Tensor
    te_ids: torch.Tensor
    te_probs: torch.Tensor
    packed: object  # cope.train.packing.tree_batch.PackedRows (not imported here: tree_batch imports this module)
    old_logprobs: torch.Tensor
    old_entropy: torch.Tensor
    ref_logprobs: torch.Tensor


def collate(episodes: list[Episode], pad_id: int, indices: list[int] | None = None,
            behaviour: bool = False) -> RolloutBatch:
    """The padded batch of ``episodes`` (row i: ``episodes[i]``, ``episode_index`` from ``indices``, default
    0..N-1); with ``behaviour`` also ``behaviour_logprobs`` (:func:`behaviour_logprobs`)."""
    n = len(episodes)
    T = max(len(e.tokens) for e in episodes)
    input_ids = torch.full((n, T), pad_id, dtype=torch.long)
    attention = torch.zeros((n, T), dtype=torch.long)
    roles = torch.full((n, T), int(Role.PAD), dtype=torch.long)
    step_ids = torch.full((n, T), -1, dtype=torch.long)
    advantages = torch.zeros((n, T))
    invalid = torch.zeros((n, T), dtype=torch.bool)
    for i, e in enumerate(episodes):
        L = len(e.tokens)
        input_ids[i, :L] = torch.tensor(e.tokens, dtype=torch.long)
        attention[i, :L] = 1
        roles[i, :L] = torch.tensor(e.roles, dtype=torch.long)
        step_ids[i, :L] = torch.tensor(e.step_of_token(), dtype=torch.long)
        if e.step_advantages is None:
            advantages[i, :L] = e.advantage
        else:  # each step's own advantage on its tokens (only its action tokens are kept below)
            table = torch.tensor([0.0, *e.step_advantages])  # index 0: no step (the prompt)
            advantages[i, :L] = table[step_ids[i, :L] + 1]
        if any(not s.valid for s in e.steps):  # each refused step's tokens (only its action tokens are kept below)
            invalid[i, :L] = torch.tensor([False, *(not s.valid for s in e.steps)])[step_ids[i, :L] + 1]
    aborted = torch.tensor([e.aborted for e in episodes], dtype=torch.bool)
    action_mask = (roles == int(Role.ACTION)) & ~aborted[:, None]
    advantages = advantages * action_mask
    position_ids = (attention.cumsum(-1) - 1).clamp(min=0)
    extra = {"behaviour_logprobs": behaviour_logprobs(episodes, action_mask)} if behaviour else {}
    return RolloutBatch(**{
        "input_ids": input_ids,
        "attention_mask": attention,
        "position_ids": position_ids,
        "roles": roles,
        "step_ids": step_ids,
        "action_mask": action_mask,
        "invalid_mask": invalid & action_mask,
        "advantages": advantages,
        "aborted": aborted,
        "unclean_steps": torch.tensor([sum(not s.strict for s in e.steps) for e in episodes], dtype=torch.long),
        "episode_index": torch.tensor(indices if indices is not None else list(range(n)), dtype=torch.long),
        "aux_row": torch.zeros(n, dtype=torch.bool),
        **extra,
    })


def behaviour_logprobs(episodes: list[Episode], action_mask: torch.Tensor) -> torch.Tensor:
    """(N, T) float32: at every position of ``action_mask`` (the ACTION tokens of non-aborted episodes, row i =
    ``episodes[i]``) the sampler's log-prob of that token, ``step.sampler_logprobs[j]`` at ``step.action_start + j``;
    0 elsewhere. Raises ValueError when an action token has none (an engine that does not report them)."""
    out = torch.zeros(action_mask.shape, dtype=torch.float32)  # (N, T)
    have = torch.zeros(action_mask.shape, dtype=torch.bool)  # (N, T)
    for i, e in enumerate(episodes):
        if e.aborted:
            continue
        for s in e.steps:
            lps = s.sampler_logprobs
            if lps is not None and len(lps) == s.action_end - s.action_start:
                out[i, s.action_start: s.action_end] = torch.tensor(lps, dtype=torch.float32)
                have[i, s.action_start: s.action_end] = True
    missing = action_mask & ~have  # (N, T)
    if bool(missing.any()):
        i, t = (int(x) for x in missing.nonzero()[0])
        e = episodes[i]
        raise ValueError(
            f"collate(behaviour=True): action token {t} of episode {e.task.id!r} (row {i}) has no sampler log-prob: "
            f"the rollout engine did not report its log-probs (Step.sampler_logprobs is None or not one per action "
            f"token). data.max_lag >= 1 weights each token by the behaviour policy's log-prob and needs an engine "
            f"that reports them (rollout=vllm)")
    return out


def row_lengths(batch: RolloutBatch) -> torch.Tensor:
    """(N,) real length of each row: one past its last attended token (2D ``attention_mask``, right
    padded, forecast segments included); the full width T when a transform replaced the
    mask by a 4D one."""
    mask = batch["attention_mask"]
    N, T = batch["input_ids"].shape
    if mask.dim() != 2:
        return torch.full((N,), T, dtype=torch.long, device=mask.device)
    pos = torch.arange(1, T + 1, device=mask.device).expand(N, T)
    return (pos * (mask != 0)).amax(-1).clamp(min=1)


def microbatch_plan(lengths: list[int], budget: int) -> list[tuple[int, int, int]]:
    """Rows ``[start, end)`` and their longest length for each micro-batch: consecutive rows whose count times
    their longest real length fits ``budget`` tokens (one row at least, even if it alone is longer)."""
    parts, start, longest = [], 0, 0
    for i, n in enumerate(lengths):
        grown = max(longest, n)
        if i > start and grown * (i + 1 - start) > budget:
            parts.append((start, i, longest))
            start, grown = i, n
        longest = grown
    parts.append((start, len(lengths), longest))
    return parts
