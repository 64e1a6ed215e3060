"""CoPE temporal ensemble (TE): the policy is pulled toward what its own earlier forecasts said about each action.

Follows CoPE (Co-Evolving Acting and Forecasting for Language Agents, arXiv 2610.20597). The members of action
a_t are the forecasts emitted at turns s = t - k < t that contain a_t; each gives pi^k(a_t | h_s, a_s..a_{t-1}),
the chain-conditional distribution of a_t inside that forecast sample (the factor the forecast loss trains)::

    q^F_t = (1 / K_t) sum_{k=1..K_t} pi^k(. | h_{t-k})          (temporal mixture)
    q_t   = (1 - eta) pi^0_frozen(. | h_t) + eta q^F_t            (frozen reference)
    L     = L_GRPO + lambda_TE * KL(pi_theta(. | h_t) || q_t)   at action tokens

Members are matched by the real step index (``action_index == t`` and ``chunk.step < t``), never by slot: a chunk
whose own action was skipped starts at a_{s+1}, and that first slot is already a k >= 1 member. Per token u of a_t
a member ships the top-M of its next-token distribution; q^F is their arithmetic mean merged by token id, cut to
top-M again, and q is renormalized by Z = (1 - eta) + eta * mass(q^F). The KL runs over the whole vocabulary without
building q (with r(v) = eta q^F(v) / ((1 - eta) p0(v)) on q^F's support)::

    KL(pi || q) = KL(pi || p0) - log((1 - eta) / Z) - sum_{v in top-M} pi(v) log1p(r(v))

since log q(v) = log((1 - eta) / Z) + log p0(v) + log1p(r(v)) and sum pi = 1. Because q >= (1 - eta) p0 / Z, the log
ratio is bounded and needs no smoothing. An action without members has q = p0 and is left out (term and gradient 0).

Where we differ or are specific:
    * p0 is the detached current policy, as in the authors' code (``te_mix=fullvocab``): it equals the frozen policy
      exactly on the first pass over an epoch's experience; on later passes the term is no longer a trust region.
    * Members are our forecast chunks (:mod:`cope.algos.cope.chunks`), scored untempered; a member whose token count
      for a_t differs from the transcript's is dropped and counted (the tokens are aligned 1:1, never re-aligned).
    * No cap on tokens per action (the authors keep at most 16 and so drop longer actions).

Pipeline: :func:`member_positions` -> :func:`forecast_batch` -> :func:`topm_at_positions` (no grad) ->
:func:`ensemble_targets` -> :func:`te_kl` on the policy's logits at ``EnsembleTargets.position - 1``.
"""
from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from cope.algos.cope.chunks import ForecastChunk
from cope.train.logprobs import CHUNK_ELEMS, head_forward, linear_head
from cope.train.objectives import Metrics
from cope.train.packing.tree_batch import attention_kwargs

TOPM = 64  # vocabulary entries kept per member token (the authors' TE_TOPM)


@dataclass(frozen=True)
class MemberTokens:
    """Every member token: a supervised token of action a_t (t > chunk.step) inside a forecast chunk. All (L,) long."""

    chunk: torch.Tensor  # index into the chunk list
    position: torch.Tensor  # index in the chunk's full sample ``episode.tokens[:anchor] + chunk.tokens``
    episode: torch.Tensor  # chunk.episode
    step: torch.Tensor  # the target step t
    offset: torch.Tensor  # u: the token's index inside a_t
    length: torch.Tensor  # the member's token count for a_t (checked against the transcript's)
    token: torch.Tensor  # the token id in the chunk (checked against the transcript's when asked)

    def __len__(self) -> int:
        return self.chunk.numel()


@dataclass(frozen=True)
class EnsembleTargets:
    """q^F at every covered transcript action token (P of them), in (episode, step, offset) order, on the CPU."""

    episode: torch.Tensor  # (P,) long
    position: torch.Tensor  # (P,) long, index of the action token in Episode.tokens (its logits: position - 1)
    step: torch.Tensor  # (P,) long, t
    members: torch.Tensor  # (P,) long, K_t
    ids: torch.Tensor  # (P, M) long, q^F's top-M token ids, -1 padded
    probs: torch.Tensor  # (P, M) float32, their probabilities, 0 padded

    def __len__(self) -> int:
        return self.position.numel()


def member_positions(chunks: Sequence[ForecastChunk]) -> MemberTokens:
    """The member tokens of ``chunks``: each supervised token whose step t = action_index > chunk.step."""
    cols: list[tuple[int, int, int, int, int, int, int]] = []
    for c, ch in enumerate(chunks):
        start: dict[int, int] = {}
        for i, j in enumerate(ch.action_index):
            start.setdefault(j, i)
        lengths = {j: ch.action_index.count(j) for j in start}
        for i, (j, tg) in enumerate(zip(ch.action_index, ch.target)):
            if tg and j > ch.step:  # j = -1 (scaffold) and k = 0 (j == step) are never members
                cols.append((c, ch.anchor + i, ch.episode, j, i - start[j], lengths[j], ch.tokens[i]))
    t = torch.tensor(cols, dtype=torch.long).view(-1, 7)  # (L, 7)
    return MemberTokens(*t.unbind(1))


def forecast_batch(chunks: Sequence[ForecastChunk], episode_tokens: Mapping[int, Sequence[int]] | Sequence[Sequence[int]],
                   pad_id: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded ``(input_ids, attention_mask, position_ids)``, each (C, T), row c = chunk c's full sample."""
    seqs = [list(episode_tokens[ch.episode][: ch.anchor]) + list(ch.tokens) for ch in chunks]
    T = max((len(s) for s in seqs), default=0)
    ids = torch.full((len(seqs), T), pad_id, dtype=torch.long)
    mask = torch.zeros(len(seqs), T, dtype=torch.long)
    for r, s in enumerate(seqs):
        ids[r, : len(s)] = torch.tensor(s, dtype=torch.long)
        mask[r, : len(s)] = 1
    return ids, mask, (mask.cumsum(-1) - 1).clamp(min=0)


@torch.no_grad()
def topm_at_positions(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor,
                      rows: torch.Tensor, positions: torch.Tensor, M: int = TOPM,
                      chunk_elems: int = CHUNK_ELEMS, tree=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-M of the next-token distribution predicting ``input_ids[rows, positions]`` (the logits at position - 1).

    The output head runs only on the selected hidden states, ``chunk_elems // V`` at a time (never (N, T, V));
    when the head is not an ``nn.Linear`` the model's own logits are used instead (as
    :func:`cope.train.logprobs.causal_lm_logprobs` falls back). Untempered; no graph; the caller sets eval mode.

    Args:
        model: causal LM (peft-wrapped or not).
        input_ids, attention_mask, position_ids: (N, T) the padded forecast samples.
        rows, positions: (L,) long, the tokens whose predictive distribution is wanted (positions >= 1).
        M: entries kept (min(M, V)).
        chunk_elems: logits held at once.
        tree: the rows' :class:`~cope.train.packing.prefix_tree.PrefixTree` when they are shared-prefix rows (attended as
            :func:`cope.train.packing.tree_batch.attention_kwargs` decides), else None.

    Returns:
        ``ids`` (L, M) long and ``probs`` (L, M) float32, sorted by decreasing probability.
    """
    if positions.numel() and int(positions.min()) < 1:
        raise ValueError("topm_at_positions: position 0 has no predicting logits")
    head = linear_head(model)
    V = head.out_features if head is not None else None
    if not rows.numel():
        m = min(M, V or M)
        return torch.empty(0, m, dtype=torch.long), torch.empty(0, m, dtype=torch.float32)
    kw = dict(input_ids=input_ids, position_ids=position_ids, use_cache=False, **attention_kwargs(model, attention_mask, tree))
    r, p = rows.to(input_ids.device), positions.to(input_ids.device) - 1

    def top(head, hidden):  # (L, H) hidden states (or (L, V) logits: head None) -> top-m ids and probabilities
        h = hidden[r, p]
        v = head.out_features if head is not None else h.shape[-1]
        m, step = min(M, v), max(1, chunk_elems // v)
        ids = torch.empty(h.shape[0], m, dtype=torch.long, device=h.device)
        probs = torch.empty(h.shape[0], m, dtype=torch.float32, device=h.device)
        for s in range(0, h.shape[0], step):
            z = (F.linear(h[s: s + step], head.weight, head.bias) if head is not None else h[s: s + step]).float()  # (c, V)
            lp, ids[s: s + step] = z.log_softmax(-1).topk(m, dim=-1)  # (c, m)
            probs[s: s + step] = lp.exp()
        return ids, probs

    return head_forward(model, kw, top)


def action_spans(episodes: Sequence, indices: Sequence[int] | None = None) -> dict[tuple[int, int], tuple[int, int]]:
    """``{(episode index, t): (action_start, action_end)}`` of every step, the spans :func:`ensemble_targets` aligns to."""
    idx = indices if indices is not None else range(len(episodes))
    return {(ei, t): (s.action_start, s.action_end) for ei, ep in zip(idx, episodes) for t, s in enumerate(ep.steps)}


def ensemble_targets(members: MemberTokens, topm_ids: torch.Tensor, topm_probs: torch.Tensor,
                     spans: Mapping[tuple[int, int], tuple[int, int]], M: int = TOPM,
                     episode_tokens: Mapping[int, Sequence[int]] | Sequence[Sequence[int]] | None = None,
                     ) -> tuple[EnsembleTargets, Metrics]:
    """Merge the members' sparse distributions into q^F per covered transcript token (episode, t, u).

    Args:
        members: the L member tokens (:func:`member_positions`).
        topm_ids, topm_probs: (L, M') each member token's top-M' (:func:`topm_at_positions`), -1 / 0 padded.
        spans: transcript span [start, end) of a_t per (episode, t) (:func:`action_spans`); a member whose
            token count differs from end - start (or whose step has no span) is dropped.
        M: entries kept in q^F.
        episode_tokens: ``Episode.tokens`` by episode index; when given, a member token whose id differs from the
            transcript's is dropped (a prompted chunk ends a listed action with a newline where the transcript
            has the stop id: that distribution is about another token).

    Returns:
        (targets, metrics): ``te/members_per_action`` (mean K_t over actions with members), ``te/actions``
        (actions with members), ``te/tokens`` (P), ``te/length_mismatch`` (members dropped),
        ``te/token_mismatch`` (member tokens dropped for their id).
    """
    ep, st = members.episode.tolist(), members.step.tolist()
    span = [spans.get((e, t), (0, -1)) for e, t in zip(ep, st)]
    start = torch.tensor([a for a, _ in span], dtype=torch.long)  # (L,)
    keep = torch.tensor([b - a for a, b in span], dtype=torch.long) == members.length  # (L,)
    dropped = {(c, t) for c, t, k in zip(members.chunk.tolist(), st, keep.tolist()) if not k}
    n_keep = int(keep.sum())
    if episode_tokens is not None:
        at = (start + members.offset).tolist()
        keep &= torch.tensor([k and episode_tokens[e][i] == tok for k, e, i, tok in zip(keep.tolist(), ep, at, members.token.tolist())],
                             dtype=torch.bool)
    key = torch.stack([members.episode, members.step, members.offset], 1)[keep]  # (L', 3)
    ukey, g = torch.unique(key, dim=0, return_inverse=True)  # (P, 3), (L',)
    P = ukey.shape[0]
    K = torch.bincount(g, minlength=P)  # (P,) each member gives one token per (episode, t, u)
    ids_k, pr_k = topm_ids[keep].cpu(), topm_probs[keep].float().cpu()  # (L', M')
    pair = torch.stack([g[:, None].expand_as(ids_k), ids_k], -1).view(-1, 2)  # (L' M', 2)
    val = (pr_k / K[g, None]).view(-1)  # (L' M',) the mean's 1 / K_t
    ok = pair[:, 1] >= 0
    upair, inv = torch.unique(pair[ok], dim=0, return_inverse=True)  # (U, 2) sorted by key
    merged = torch.zeros(upair.shape[0]).index_add_(0, inv, val[ok])  # (U,)
    order = merged.argsort(descending=True, stable=True)
    order = order[upair[order, 0].argsort(stable=True)]  # by key, then by decreasing probability
    gk, gid, gp = upair[order, 0], upair[order, 1], merged[order]
    first = torch.cumsum(torch.bincount(gk, minlength=P), 0) - torch.bincount(gk, minlength=P)  # (P,)
    rank = torch.arange(gk.numel()) - first[gk]
    top = rank < M
    ids = torch.full((P, M), -1, dtype=torch.long)
    probs = torch.zeros(P, M)
    ids[gk[top], rank[top]] = gid[top]
    probs[gk[top], rank[top]] = gp[top]
    pos = torch.zeros(P, dtype=torch.long).index_copy_(0, g, start[keep] + members.offset[keep])  # (P,)
    actions, a_inv = torch.unique(ukey[:, :2], dim=0, return_inverse=True)  # (A, 2), (P,)
    k_action = torch.zeros(actions.shape[0], dtype=torch.long).index_copy_(0, a_inv, K)  # (A,) K_t per action
    targets = EnsembleTargets(ukey[:, 0], pos, ukey[:, 1], K, ids, probs)
    metrics: Metrics = {
        "te/members_per_action": k_action.float().mean().item() if P else 0.0,
        "te/actions": float(actions.shape[0]),
        "te/tokens": float(P),
        "te/length_mismatch": float(len(dropped)),
        "te/token_mismatch": float(n_keep - int(keep.sum())),
    }
    return targets, metrics


def te_kl(rows: torch.Tensor, qf_ids: torch.Tensor, qf_probs: torch.Tensor, eta: float = 0.5,
          p0_logprobs: torch.Tensor | None = None) -> tuple[torch.Tensor, Metrics]:
    """Mean over covered tokens of KL(pi_theta || q) over the full vocabulary, in closed form (module docstring).

    Args:
        rows: (P, V) the policy's untempered logits predicting each covered action token, with grad.
        qf_ids, qf_probs: (P, M) q^F's top-M (:class:`EnsembleTargets`), -1 / 0 padded.
        eta: the members' weight in q, in [0, 1).
        p0_logprobs: (P, V) log p0; default ``log_softmax(rows).detach()`` (the frozen policy on a first pass).
            Always treated as a constant.

    Returns:
        (kl, metrics): ``te/kl`` (the loss, detached), ``te/positions`` (P), ``te/member_share`` (mean
        eta * mass / Z, the share of q from members), ``te/eta``. P = 0: an exact 0 attached to the graph.
    """
    if not 0.0 <= eta < 1.0:
        raise ValueError(f"te_kl: eta must be in [0, 1), got {eta}")
    P = rows.shape[0]
    if P == 0:
        zero = rows.sum() * 0.0
        return zero, {"te/kl": zero.detach(), "te/positions": 0.0, "te/member_share": 0.0, "te/eta": float(eta)}
    logpi = (rows if rows.dtype == torch.float64 else rows.float()).log_softmax(-1)  # (P, V)
    logp0 = logpi.detach() if p0_logprobs is None else p0_logprobs.detach().to(logpi)  # (P, V)
    pi = logpi.exp()
    kl0 = (pi * (logpi - logp0)).sum(-1)  # (P,) KL(pi || p0): 0 with 0 gradient when p0 = pi.detach()
    valid = qf_ids >= 0  # (P, M)
    idx = qf_ids.clamp(min=0)
    qf = torch.where(valid, qf_probs.to(logpi), 0.0)  # (P, M)
    share = eta * qf.sum(-1)  # (P,) eta * mass(q^F)
    Z = (1.0 - eta) + share  # (P,)
    with torch.no_grad():  # log1p(r) = log((1 - eta) p0 + eta qF) - log((1 - eta) p0): no overflow where p0 underflows
        a = math.log1p(-eta) + logp0.gather(-1, idx)  # (P, M)
        b = (math.log(eta) if eta > 0 else -math.inf) + qf.log()
        bonus = torch.where(valid, torch.logaddexp(a, b) - a, 0.0)  # (P, M)
    kl = kl0 - (math.log1p(-eta) - Z.log()) - (pi.gather(-1, idx) * bonus).sum(-1)  # (P,)
    loss = kl.mean()
    metrics: Metrics = {"te/kl": loss.detach(), "te/positions": float(P),
                        "te/member_share": (share / Z).mean().detach(),
                        "te/eta": float(eta)}
    return loss, metrics
