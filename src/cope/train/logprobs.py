"""Per-token log-probs of a causal LM without a (N, T, V) fp32 tensor.

Every objective reads ``logprobs[:, t] = log p(ids[t] | ids[<t])`` (0 at t = 0). A full log-softmax
over the vocabulary at every position is the cost that dominates a LoRA step at real vocabularies
(152k for Qwen2.5: one 8k-token row's fp32 log-softmax alone is about 5 GB). Here the model body
gives hidden states (N, T, H); the output head runs on chunks of at most ``chunk_elems // V`` tokens;
each chunk yields ``z[y] - logsumexp(z)`` and is then dropped (:class:`_LinearHeadLogprob`). Backward needs no
(N, T, V) tensor either: for a frozen head, d lp_t / d h_t = (W[y_t] - p_t W) / tau_t, a (K, H) tensor the forward
computes while the chunk's probabilities are at hand (the same identity fused linear-cross-entropy kernels use); a
trained head (full fine-tuning) also needs dW = sum_t (onehot(y_t) - p_t)^T h_t g_t / tau_t, so its backward forms
each chunk's probabilities again. Memory is O(K * H) beyond the body's activations, plus one (chunk, V) buffer.

The head runs inside the causal LM's own forward (:func:`head_forward`: the head's ``forward`` is replaced for the
call), so every parameter is read where its module's forward runs: what FSDP needs to gather a sharded head and
embedding (:mod:`cope.train.fsdp.sharding`), and what any wrapper that hooks a module's forward expects.

Temperature: rollouts sample from ``softmax(z / T)``, so the policy's log-probs at action tokens
(the PPO ratio, KL) are taken under that distribution; every other position (observations for ECHO,
forecast targets for CoPE) keeps the model's own distribution (tau = 1). ``temperature <= 0``
(greedy sampling) scores at tau = 1.

Rows holding prefix trees (shared-prefix packing): a token's predecessor is the last token it sees, which for a
node's first token is an ancestor's token, not its left neighbour in memory; ``source`` says which output predicts
each token, so a shared token is stored once and a node needs no copy of its parent's last token.

Entropy is computed only where asked (``entropy_mask``: the action tokens; EMPG and the entropy
metric read nothing else), without graph.

Fallback: when the head is not an ``nn.Linear`` (LoRA on ``lm_head``) or the architecture post-processes logits
(soft-capping, logit scale), the model's own logits are used with the same chunked math under autograd (memory not
bounded; logged once).
"""
from __future__ import annotations

import contextlib
import logging
from typing import Any, Callable

import torch
import torch.nn.functional as F

from cope.train.packing.prefix_tree import PrefixTree

log = logging.getLogger(__name__)

CHUNK_ELEMS = 2**25  # fp32 logits per chunk (128 MB): tokens per chunk = CHUNK_ELEMS // vocab
_LOGIT_POSTPROCESSING = ("final_logit_softcapping", "logit_scale", "logits_scaling", "output_multiplier_scale")


class _LinearHeadLogprob(torch.autograd.Function):
    """lp_t = log softmax(h_t W^T + b)[y_t] / tau_t-tempered, chunk by chunk. A frozen head: d lp_t / d h_t formed in
    the forward; a trained one (``weight`` needs a gradient): the backward forms each chunk's probabilities again."""

    @staticmethod
    def forward(ctx, h, weight, bias, targets, tau, ent_rows, chunk):  # noqa: D401 - autograd signature
        need_h, trained = ctx.needs_input_grad[0], ctx.needs_input_grad[1] or ctx.needs_input_grad[2]
        K = h.shape[0]
        lp = h.new_empty(K, dtype=torch.float32)
        ent = h.new_zeros(K, dtype=torch.float32)
        jac = torch.empty_like(h) if need_h and not trained else None
        tempered = bool((tau != 1).any())
        for s in range(0, K, chunk):
            e = min(K, s + chunk)
            z = F.linear(h[s:e], weight, bias).float()  # (c, V); the only (c, V) buffer kept
            if tempered:
                z.div_(tau[s:e, None])
            lse = z.logsumexp(-1)  # (c,)
            y = targets[s:e]
            lp[s:e] = z.gather(-1, y[:, None]).squeeze(-1) - lse
            rows = ent_rows[s:e].nonzero().squeeze(-1)  # entropy only where asked (action tokens)
            if rows.numel():
                zr = z[rows]
                ent[s + rows] = lse[rows] - ((zr - lse[rows, None]).exp() * zr).sum(-1)
            if jac is not None:  # (W[y] - p W) / tau: the whole Jacobian row of lp_t w.r.t. h_t
                p = z.sub_(lse[:, None]).exp_()  # (c, V) softmax of the tempered logits, in place
                pw = (p.to(weight.dtype) @ weight).float()  # (c, H)
                g = weight[y].float() - pw
                if tempered:
                    g.div_(tau[s:e, None])
                jac[s:e] = g.to(h.dtype)
        ctx.chunk, ctx.trained, ctx.has_bias = chunk, trained, bias is not None
        if trained:
            ctx.save_for_backward(h, weight, bias, targets, tau)
        elif jac is not None:
            ctx.save_for_backward(jac)
        ctx.mark_non_differentiable(ent)
        return lp, ent

    @staticmethod
    def backward(ctx, grad_lp, grad_ent):
        if not ctx.trained:
            (jac,) = ctx.saved_tensors
            return (grad_lp.to(jac.dtype)[:, None] * jac), None, None, None, None, None, None
        h, weight, bias, targets, tau = ctx.saved_tensors
        gh = torch.empty_like(h) if ctx.needs_input_grad[0] else None
        gw = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        gb = torch.zeros(weight.shape[0], dtype=torch.float32, device=weight.device) if ctx.has_bias else None
        for s in range(0, h.shape[0], ctx.chunk):
            e = min(h.shape[0], s + ctx.chunk)
            z = F.linear(h[s:e], weight, bias).float().div_(tau[s:e, None])  # (c, V)
            dz = z.softmax(-1).neg_()  # d lp / d z = (onehot(y) - p) / tau, times the incoming gradient
            dz[torch.arange(e - s, device=dz.device), targets[s:e]] += 1.0
            dz.mul_((grad_lp[s:e].float() / tau[s:e])[:, None])
            if gh is not None:
                gh[s:e] = (dz.to(weight.dtype) @ weight).to(h.dtype)
            gw += dz.t() @ h[s:e].float()
            if gb is not None:
                gb += dz.sum(0)
        return (gh, gw.to(weight.dtype), None if gb is None else gb.to(bias.dtype), None, None, None, None)


def _chunked_from_logits(logits, targets, tau, ent_rows, chunk):
    """The same math on logits already computed (fallback path; autograd through the chunks)."""
    lps, ents = [], []
    for s in range(0, logits.shape[0], chunk):
        z = logits[s: s + chunk].float() / tau[s: s + chunk, None]
        lse = z.logsumexp(-1)
        lps.append(z.gather(-1, targets[s: s + chunk, None]).squeeze(-1) - lse)
        with torch.no_grad():
            p = (z - lse[:, None]).exp()
            ents.append(torch.where(ent_rows[s: s + chunk], lse - (p * z).sum(-1), 0.0))
    return torch.cat(lps), torch.cat(ents)


def linear_head(model) -> torch.nn.Linear | None:
    """The output head when the chunked path applies to ``model`` (a peft or plain causal LM): an ``nn.Linear``,
    frozen or trained, with no logit post-processing; else None (the fallback on the model's own logits)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    head = base.get_output_embeddings() if hasattr(base, "get_output_embeddings") else None
    cfg = getattr(base, "config", None)
    if type(head) is not torch.nn.Linear:
        return None
    if cfg is not None and any(getattr(cfg, k, None) not in (None, 1, 1.0) for k in _LOGIT_POSTPROCESSING):
        return None
    return head


def head_forward(model, kw: dict[str, Any], fn: Callable[[torch.nn.Linear | None, torch.Tensor], Any]) -> Any:
    """``fn(head, hidden)`` on the (N, T, H) hidden states before the output head, run *as* the head inside the causal
    LM's own forward (``base(**kw)``; the head's ``forward`` is replaced for the call), returning its result. The LM's
    ``logits`` output is what ``fn`` returns as its first element (a tensor: FSDP hooks its backward there). Where
    :func:`linear_head` finds no such head (the fallback, logged once): ``fn(None, logits)`` on the model's own (N, T, V)
    logits."""
    head = linear_head(model)
    if head is None:
        _warn_fallback(model)
        return fn(None, model(**kw).logits)
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    result: dict[str, Any] = {}

    def run(hidden: torch.Tensor):
        result["out"] = fn(head, hidden)
        return result["out"][0] if isinstance(result["out"], tuple) else result["out"]

    with _replaced_forward(head, run):
        base(**kw)
    return result["out"]


@contextlib.contextmanager
def _replaced_forward(module: torch.nn.Module, fn: Callable):
    had = "forward" in module.__dict__
    previous = module.__dict__.get("forward")
    module.forward = fn
    try:
        yield
    finally:
        if had:
            module.forward = previous
        else:
            del module.forward


def causal_lm_logprobs(
    model,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    position_ids: torch.Tensor,
    tempered: torch.Tensor | None = None,
    temperature: float = 1.0,
    entropy_mask: torch.Tensor | None = None,
    chunk_elems: int = CHUNK_ELEMS,
    rows_at: torch.Tensor | None = None,
    prefix_tree: PrefixTree | None = None,
    source: torch.Tensor | None = None,
) -> tuple[torch.Tensor, ...]:
    """(log-probs, entropy), both (N, T) fp32, 0 at t = 0 and wherever not computed; with ``rows_at``, also the
    untempered logits rows (P, V) fp32, with gradient, that predict the tokens at those positions.

    Args:
        model: causal LM (peft-wrapped or not).
        input_ids, attention_mask (2D, or 4D additive float), position_ids: the batch.
        tempered: (N, T) bool, positions scored under ``softmax(z / temperature)`` (the action tokens).
        temperature: the sampling temperature of the rollouts (<= 0: greedy, scored at 1).
        entropy_mask: (N, T) bool, positions whose predictive entropy is returned (no graph).
        chunk_elems: logits held at once (tokens per chunk = chunk_elems // vocab).
        rows_at: (P, 2) long (row, column >= 1) of tokens whose full predictive row is wanted (CoPE's temporal
            ensemble takes a KL over the whole vocabulary there): only those P rows of logits are formed.
        prefix_tree: the :class:`~cope.train.packing.prefix_tree.PrefixTree` of shared-prefix rows (the model must run
            ``"cope_tree"`` attention; ``position_ids`` are the tree's), or None.
        source: (N, T) long, per token the flat position ``row * T + column`` whose output predicts it (-1: none,
            scored 0): rows holding trees (:meth:`~cope.train.packing.prefix_tree.PrefixTree.predecessors`, where a
            node's first token is predicted by the last ancestor token it sees, not by its left neighbour in memory).
            None: the position before it in its row. ``rows_at`` then names the token too (its source's row of logits).
    """
    where = None
    if source is None:  # each token predicted by the position before it in its row; column 0 by none
        N, T = input_ids.shape
        source = torch.arange(-1, N * T - 1, device=input_ids.device).view(N, T)
        source[:, 0] = -1
        where = torch.arange(N * T, device=input_ids.device).view(N, T)[:, 1:].reshape(-1)  # known: no device sync
    return _scored(model, input_ids, attention_mask, position_ids, tempered, temperature, entropy_mask, chunk_elems,
                   rows_at, prefix_tree, source, where)


def _scored(model, input_ids, attention_mask, position_ids, tempered, temperature, entropy_mask, chunk_elems,
            rows_at, prefix_tree, source, where=None) -> tuple[torch.Tensor, ...]:
    """:func:`causal_lm_logprobs` with each token predicted by the output at ``source`` (see its docstring). Only
    tokens with a source reach the head, in row-major order (plain rows: every column but the first, as slicing
    would give them); one output may predict several tokens (in a tree, a branching node's last token predicts each
    child's first), and its gradient then sums over them. ``where``: the flat positions with a source, when the
    caller knows them (plain rows), else found from ``source``."""
    N, T = input_ids.shape
    tau_value = float(temperature) if temperature and temperature > 0 else 1.0
    src = source.reshape(-1)  # (N*T,)
    if where is None:  # (K,) tokens that have a predecessor (a host sync on an accelerator: trees only)
        where = (src >= 0).nonzero().squeeze(-1)
    src = src[where]  # (K,)
    targets = input_ids.reshape(-1)[where]  # (K,)
    tau = torch.ones(where.shape[0], dtype=torch.float32, device=input_ids.device)
    if tempered is not None and tau_value != 1.0:
        tau = tau.masked_fill(tempered.reshape(-1)[where], tau_value)
    ent_rows = entropy_mask.reshape(-1)[where] if entropy_mask is not None else torch.zeros_like(targets, dtype=torch.bool)
    kw = _forward_kwargs(input_ids, attention_mask, position_ids, prefix_tree)
    flat = None if rows_at is None else source[rows_at[:, 0], rows_at[:, 1]]  # (P,): the output predicting each

    def score(head, hidden):  # (N, T, H) hidden states -> lp, ent (K,) and the (P, V) rows; inside the LM's forward
        hidden = hidden.reshape(N * T, hidden.shape[-1])
        h = hidden.index_select(0, src)  # (K, H): each target's predicting output
        if head is None:
            lp, ent = _chunked_from_logits(h, targets, tau, ent_rows, max(1, chunk_elems // h.shape[-1]))
            return lp, ent, (None if flat is None else hidden[flat].float())
        chunk = max(1, chunk_elems // head.out_features)
        lp, ent = _LinearHeadLogprob.apply(h, head.weight, head.bias, targets, tau, ent_rows, chunk)
        return lp, ent, (None if flat is None else F.linear(hidden[flat], head.weight, head.bias).float())

    lp, ent, rows = head_forward(model, kw, score)
    out = tuple(x.new_zeros(N * T).index_put((where,), x).view(N, T) for x in (lp, ent))  # (N, T) each, 0 without source
    return out if rows_at is None else (*out, rows)


def _forward_kwargs(input_ids, attention_mask, position_ids, prefix_tree: PrefixTree | None = None) -> dict[str, Any]:
    """The model's forward keyword arguments; a ``prefix_tree`` travels with them down to the attention function."""
    kw = dict(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False)
    if prefix_tree is not None:
        kw["prefix_tree"] = prefix_tree
    return kw


_warned: set[int] = set()


def _warn_fallback(model) -> None:
    if id(model) not in _warned:
        _warned.add(id(model))
        log.warning("log-probs from the model's full logits (its output head is trained or post-processes logits): "
                    "memory grows with tokens x vocabulary")


@torch.no_grad()
def causal_lm_predictions(
    model,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    position_ids: torch.Tensor,
    chunk_elems: int = CHUNK_ELEMS,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Teacher-forced (log-probs, argmax predictions) of every next token, no graph: what evaluation reads.

    ``logprobs[:, t] = log p(ids[t] | ids[<t])`` under the model's own distribution (tau = 1 everywhere,
    whatever the sampling temperature) and ``pred[:, t] = argmax_v p(v | ids[<t])`` (the first one on a tie, as
    ``argmax`` of the full logits gives it), so ``pred == ids`` marks the tokens a greedy decoder would
    have produced. The output head runs on chunks of at most ``chunk_elems // V`` positions, as in
    :func:`causal_lm_logprobs`; the same fallback to the model's own logits applies.

    Args:
        model: causal LM (peft-wrapped or not).
        input_ids, attention_mask (2D, or 4D additive float), position_ids: the batch.
        chunk_elems: logits held at once (positions per chunk = chunk_elems // vocab).

    Returns:
        ``logprobs`` (N, T) fp32, 0 at t = 0; ``pred`` (N, T) long, -1 at t = 0 (no token predicts it).
    """
    N, T = input_ids.shape
    targets = input_ids[:, 1:].reshape(-1)  # (K,) with K = N * (T - 1)
    K = targets.shape[0]

    def predict(head, hidden):  # inside the LM's forward (head None: ``hidden`` are the model's own logits)
        h = hidden[:, :-1].reshape(-1, hidden.shape[-1])
        vocab = head.out_features if head is not None else h.shape[-1]
        lp = torch.empty(K, dtype=torch.float32, device=input_ids.device)
        pred = torch.empty(K, dtype=torch.long, device=input_ids.device)
        chunk = max(1, chunk_elems // vocab)
        for s in range(0, K, chunk):
            e = min(K, s + chunk)
            z = (F.linear(h[s:e], head.weight, head.bias) if head is not None else h[s:e]).float()  # (c, V); the only one
            lp[s:e] = z.gather(-1, targets[s:e, None]).squeeze(-1) - z.logsumexp(-1)
            pred[s:e] = z.argmax(-1)
        return lp, pred

    lp, pred = head_forward(model, _forward_kwargs(input_ids, attention_mask, position_ids), predict)
    lp = torch.cat([lp.new_zeros(N, 1), lp.view(N, T - 1)], 1)  # (N, T)
    pred = torch.cat([pred.new_full((N, 1), -1), pred.view(N, T - 1)], 1)  # (N, T)
    return lp, pred


def token_logprobs(logits: torch.Tensor, input_ids: torch.Tensor, with_entropy: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token log p(ids[t] | ids[<t]) and predictive entropy, aligned at t (0 at t=0).

    Computed one row at a time in fp32 to bound the (T, V) working set on large vocabularies."""
    N, T, _ = logits.shape
    lps, ents = [], []
    for i in range(N):
        logp = logits[i, :-1].float().log_softmax(-1)  # (T-1, V)
        lps.append(logp.gather(-1, input_ids[i, 1:, None]).squeeze(-1))  # (T-1,)
        if with_entropy:
            with torch.no_grad():
                ents.append(-(logp.exp() * logp).sum(-1))  # (T-1,)
    zero = logits.new_zeros((N, 1), dtype=torch.float32)
    lp = torch.cat([zero, torch.stack(lps)], dim=1)  # (N, T)
    ent = torch.cat([zero, torch.stack(ents)], dim=1) if with_entropy else torch.zeros_like(lp)
    return lp, ent


def sampler_gap(minibatches: list[dict], episodes: list) -> dict[str, float]:
    """How far the trainer's old log-probs are from the sampler's own, over the action tokens of every
    step whose sampler reported them (``Step.sampler_logprobs``: a server engine such as vLLM).

    ``rollout/logprob_gap``: mean |old - sampler| per token; ``rollout/logprob_gap_max``: the largest.
    Same weights on both sides, so this is numerics only (kernels, dtype): ~1e-6 in fp32, up to ~0.2 in
    bf16. Empty when no step carries sampler log-probs (the in-process engine samples from the scored model)."""
    diffs = []
    for mb in minibatches:
        if "old_logprobs" not in mb:
            continue
        for row, ei in enumerate(mb["episode_index"].tolist()):
            ep = episodes[ei]
            if bool(mb["aux_row"][row]) or ep.aborted:
                continue
            for s in ep.steps:
                lps, a0, a1 = s.sampler_logprobs, s.action_start, s.action_end
                if lps is None or len(lps) != a1 - a0 or mb["input_ids"][row, a0:a1].tolist() != ep.tokens[a0:a1]:
                    continue  # a transform moved this row's tokens: no aligned comparison
                diffs.append(mb["old_logprobs"][row, a0:a1].double() - torch.tensor(lps, dtype=torch.float64))  # (a1-a0,)
    if not diffs:
        return {}
    gap = torch.cat(diffs).abs()
    return {"rollout/logprob_gap": gap.mean().item(), "rollout/logprob_gap_max": gap.max().item()}
