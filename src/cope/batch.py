"""Episodes -> padded training tensors (a "RolloutBatch", a plain dict of tensors).

Keys (N sequences, T tokens; right padded):

    input_ids      (N, T) long   exact transcript ids; pad id past the end
    attention_mask (N, T) long   1 on real tokens (a transform may replace it by a 4D additive
                                 float mask (N, 1, T, T); then position_ids must be honoured)
    attn_context_end, attn_segment_start (N, T) long   optional segment attention (CoPE's packed
                                 forecasts): query i attends keys j < context_end[i] and
                                 segment_start[i] <= j <= i (see segment_attention)
    position_ids   (N, T) long
    roles          (N, T) long   cope.episode.Role values, PAD=-1
    step_ids       (N, T) long   index of the step a token belongs to, -1 for the first prompt/pad
    action_mask    (N, T) bool   policy-gradient targets: ACTION tokens of non-aborted episodes
    advantages     (N, T) float  per-token advantage (episode advantage on action tokens, 0 elsewhere)
    rewards        (N,)   float;  success (N,) bool;  group (N,) long;  aborted (N,) bool
    step_valid     (N, S) bool   validity of each step (False past the episode's last step)
    num_steps      (N,)   long
    episode_index  (N,)   long   index into the epoch's episode list (for transforms)
    aux_row        (N,)   bool   rows that are not episode transcripts (all False here; a collate
                                 transform that appends rows, e.g. CoPE's plain forecast layout,
                                 sets them True): transcript-level objectives (ECHO, EMPG) skip them

Filled later by the module's scoring pass, before any update (same shapes as input_ids):
    old_logprobs, old_entropy, and ref_logprobs when a KL term is on.

Log-prob convention: position t holds log p(input_ids[t] | input_ids[:t]); position 0 holds 0.
"""
from __future__ import annotations

import torch

from cope.episode import Episode, Role


def collate(episodes: list[Episode], pad_id: int, indices: list[int] | None = None) -> dict[str, torch.Tensor]:
    n = len(episodes)
    T = max(len(e.tokens) for e in episodes)
    S = max(1, max(e.num_steps for e in episodes))
    input_ids = torch.full((n, T), pad_id, dtype=torch.long)
    attention = torch.zeros((n, T), dtype=torch.long)
    roles = torch.full((n, T), int(Role.PAD), dtype=torch.long)
    step_ids = torch.full((n, T), -1, dtype=torch.long)
    step_valid = torch.zeros((n, S), dtype=torch.bool)
    advantages = torch.zeros((n, T))
    for i, e in enumerate(episodes):
        L = len(e.tokens)
        input_ids[i, :L] = torch.tensor(e.tokens, dtype=torch.long)
        attention[i, :L] = 1
        roles[i, :L] = torch.tensor(e.roles, dtype=torch.long)
        step_ids[i, :L] = torch.tensor(e.step_of_token(), dtype=torch.long)
        for j, s in enumerate(e.steps):
            step_valid[i, j] = s.valid
        advantages[i, :L] = e.advantage
    aborted = torch.tensor([e.aborted for e in episodes], dtype=torch.bool)
    action_mask = (roles == int(Role.ACTION)) & ~aborted[:, None]
    advantages = advantages * action_mask
    position_ids = (attention.cumsum(-1) - 1).clamp(min=0)
    return {
        "input_ids": input_ids,
        "attention_mask": attention,
        "position_ids": position_ids,
        "roles": roles,
        "step_ids": step_ids,
        "action_mask": action_mask,
        "advantages": advantages,
        "rewards": torch.tensor([e.reward for e in episodes], dtype=torch.float),
        "success": torch.tensor([e.success for e in episodes], dtype=torch.bool),
        "group": torch.tensor([e.group for e in episodes], dtype=torch.long),
        "aborted": aborted,
        "step_valid": step_valid,
        "num_steps": torch.tensor([e.num_steps for e in episodes], dtype=torch.long),
        "episode_index": torch.tensor(indices if indices is not None else list(range(n)), dtype=torch.long),
        "aux_row": torch.zeros(n, dtype=torch.bool),
    }


def row_lengths(batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """(N,) real length of each row: one past its last attended token (2D ``attention_mask``, right
    padded, segments of segment attention included); the full width T when a transform replaced the
    mask by a 4D one."""
    mask = batch["attention_mask"]
    N, T = batch["input_ids"].shape
    if mask.dim() != 2:
        return torch.full((N,), T, dtype=torch.long, device=mask.device)
    pos = torch.arange(1, T + 1, device=mask.device).expand(N, T)
    return (pos * (mask != 0)).amax(-1).clamp(min=1)


SEGMENT_KEYS = ("attn_context_end", "attn_segment_start")


def segment_attention(context_end: torch.Tensor, segment_start: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """The (N, 1, T, T) mask of segment attention: query i attends key j iff j < context_end[i] or
    segment_start[i] <= j <= i. Bool (True = attend: SDPA's form) when ``dtype`` is None, else additive
    in ``dtype`` (0 = attend, the dtype's min = blocked) for eager attention. Every query attends itself."""
    T = context_end.shape[-1]
    j = torch.arange(T, device=context_end.device)  # keys
    i = j[:, None]  # queries
    keep = (j < context_end[..., None]) | ((j >= segment_start[..., None]) & (j <= i))  # (N, T, T)
    if dtype is None:
        return keep[:, None]
    return torch.zeros(keep.shape, dtype=dtype, device=keep.device).masked_fill_(~keep, torch.finfo(dtype).min)[:, None]
