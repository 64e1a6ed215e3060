"""Forward and backward of one minibatch in micro-batches under the module's token budget, with the exact gradient.

Micro-batching gives the same loss and gradients as one forward of the whole minibatch: objectives are sums of
per-row terms with normalizers read from the masks (never from other rows' log-probs), so micro-batch ``j``'s
backward runs the full-minibatch objectives on log-probs that are live on its rows and constant elsewhere; the
logged losses come from one more (gradient-free, cheap) pass of the objectives over every row's log-probs.
CoPE's temporal-ensemble rows (``ForwardOut.te_rows``) are spliced the same way. Under DDP the gradients are
all-reduced once, at the last micro-batch.
"""
from __future__ import annotations

import contextlib

import torch

from cope.train.objectives import ForwardOut, combine


def backward_microbatched(module, batch: dict) -> tuple[ForwardOut, torch.Tensor, dict]:
    """Forward + backward of every micro-batch. Returns the whole minibatch's forward output, its total
    loss (detached) and the objectives' metrics, as one forward over every row gives them."""
    parts = module.micro_batches(batch)
    if len(parts) == 1 and parts[0][0] is None:
        out = module(batch)
        total, metrics = combine(module.objectives, out, batch, module.global_step)
        module.manual_backward(total)
        te = out.te_rows.detach() if out.te_rows is not None else None
        return ForwardOut(out.logprobs.detach(), out.entropy, out.ref_logprobs, te), total.detach(), metrics
    ref = batch.get("ref_logprobs") if module.needs_ref else None
    old = batch.get("old_logprobs")  # a forecast batch is not scored: any constant stands in for rows not live
    lp = old.to(module.device, torch.float32).clone() if old is not None else torch.zeros(batch["input_ids"].shape, device=module.device)
    ent = torch.zeros_like(lp)
    te_store = None  # (P, V) TE rows: constants for positions not live, as the log-probs
    blocker = _backward_sync_blocker(module)
    for j, (rows, n) in enumerate(parts):
        live_lp, live_ent, *te = module.logprobs(batch, rows, n, te=True)
        full = lp.clone()
        full[rows, :n] = live_lp  # differentiable on this micro-batch's rows only
        te_full = None
        if te:
            if te_store is None:
                te_store = te[0].new_zeros(batch["te_position"].shape[0], te[0].shape[-1])
            te_full = te_store.clone()
            te_full[te[1]] = te[0]
        total, _ = combine(module.objectives, ForwardOut(full, ent, ref, te_full), batch, module.global_step)
        last = j == len(parts) - 1
        with (blocker() if blocker is not None and not last else contextlib.nullcontext()):  # DDP: sync once
            module.manual_backward(total)
        lp[rows, :n], ent[rows, :n] = live_lp.detach(), live_ent
        if te:
            te_store[te[1]] = te[0].detach()
    out = ForwardOut(lp, ent, ref, te_store)
    with torch.no_grad():  # the logged losses: every row's log-probs at once
        total, metrics = combine(module.objectives, out, batch, module.global_step)
    return out, total, metrics


def _backward_sync_blocker(module):
    """DDP's ``block_backward_sync`` (gradients all-reduced once per step, at the last micro-batch); None
    without a strategy that has one (one process, or the module driven without a trainer, as tests do)."""
    try:
        strategy = module.trainer.strategy
    except RuntimeError:  # not attached to a Trainer
        return None
    return getattr(strategy, "block_backward_sync", None)
