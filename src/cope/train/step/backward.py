"""Forward and backward of one minibatch in micro-batches under the module's token budget, with the exact gradient.

Micro-batching gives the same loss and gradients as one forward of the whole minibatch: objectives are sums of
per-row terms with normalizers read from the masks (never from other rows' log-probs), so micro-batch ``j``'s
backward runs the full-minibatch objectives on log-probs that are live on its rows and constant elsewhere; the
logged losses come from one more (gradient-free, cheap) pass of the objectives over every row's log-probs.
Whatever else the objectives declared (:class:`~cope.train.objectives.Needs`: the predictive rows at a batch key's
positions) is spliced the same way (:class:`Spliced`), without knowing which objective asked. Under DDP the
gradients are all-reduced once, at the last micro-batch.
"""
from __future__ import annotations

import contextlib

import torch

from cope.train.objectives import ForwardOut, TokenScores, combine


class Spliced:
    """The whole minibatch's forward output, assembled micro-batch by micro-batch.

    Rows not scored yet hold ``old_logprobs`` (any constant would do: a batch of another kind is not scored, and
    zeros stand in), entropy 0 and zero predictive rows; :meth:`live` gives the output with one micro-batch's scores
    in place (differentiable there only), :meth:`keep` stores them, detached.
    """

    def __init__(self, module, batch: dict):
        old = batch.get("old_logprobs")
        self.lp = (old.to(module.device, torch.float32).clone() if old is not None
                   else torch.zeros(batch["input_ids"].shape, device=module.device))  # (N, T)
        self.ent = torch.zeros_like(self.lp)  # (N, T)
        self.ref = batch.get("ref_logprobs") if module.needs_ref else None
        self.sizes = {k: batch[k].shape[0] for k in module.needs.rows_at if k in batch}  # key -> P
        self.rows: dict[str, torch.Tensor] = {}  # key -> (P, V), made at the first scores (V known then)

    def live(self, rows: torch.Tensor, n: int, scores: TokenScores) -> ForwardOut:
        """The output with ``scores`` (of ``rows``, first ``n`` columns) in place, the rest constant."""
        lp, ent = self.lp.clone(), self.ent.clone()
        lp[rows, :n], ent[rows, :n] = scores.logprobs, scores.entropy
        full = {}
        for key, found in scores.rows.items():
            if key not in self.rows:
                self.rows[key] = found.new_zeros(self.sizes[key], found.shape[-1])
            full[key] = self.rows[key].clone()
            full[key][scores.row_index[key]] = found
        return ForwardOut(lp, ent, self.ref, full)

    def keep(self, rows: torch.Tensor, n: int, scores: TokenScores) -> None:
        """Store ``scores`` (detached) as the constants the later micro-batches see."""
        self.lp[rows, :n], self.ent[rows, :n] = scores.logprobs.detach(), scores.entropy
        for key, found in scores.rows.items():
            self.rows[key][scores.row_index[key]] = found.detach()

    def whole(self) -> ForwardOut:
        return ForwardOut(self.lp, self.ent, self.ref, self.rows)


def backward_microbatched(module, batch: dict, pad_to: int | None = None) -> tuple[ForwardOut, torch.Tensor, dict]:
    """Forward + backward of every micro-batch. Returns the whole minibatch's forward output, its total
    loss (detached) and the objectives' metrics, as one forward over every row gives them. ``pad_to``: run this many
    backward passes in all, the ones past the micro-batches on one token of the first row with a zero loss (zero
    gradient: a rank with fewer micro-batches meets the others' per-pass gradient collectives, trainer=fsdp's
    ``sync_every_microbatch``)."""
    parts = module.micro_batches(batch)
    if len(parts) == 1 and parts[0][0] is None:
        out = module(batch)
        total, metrics = combine(module.objectives, out, batch, module.global_step)
        module.manual_backward(total)
        rows = {k: v.detach() for k, v in out.rows.items()}
        return ForwardOut(out.logprobs.detach(), out.entropy, out.ref_logprobs, rows), total.detach(), metrics
    spliced, rows_at = Spliced(module, batch), module.needs.rows_at
    blocker = _backward_sync_blocker(module)
    passes = max(len(parts), pad_to or 0)
    for j, (rows, n) in enumerate(parts):
        scores = module.logprobs(batch, rows, n, rows_at=rows_at)
        total, _ = combine(module.objectives, spliced.live(rows, n, scores), batch, module.global_step)
        last = j == passes - 1
        with (blocker() if blocker is not None and not last else contextlib.nullcontext()):  # DDP: sync once
            module.manual_backward(total)
        spliced.keep(rows, n, scores)
    first = parts[0][0][:1]  # a token budget is set whenever passes are padded: parts carry their rows
    for j in range(len(parts), passes):  # padding passes: every parameter's gradient gets + 0
        zero = module.logprobs(batch, first, 2, entropy=False).logprobs.sum() * 0.0
        with (blocker() if blocker is not None and j != passes - 1 else contextlib.nullcontext()):
            module.manual_backward(zero)
    out = spliced.whole()
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
