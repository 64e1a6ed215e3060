"""The epoch's scoring pass: the old (and reference) log-probs of every minibatch, before any update.

The PPO ratio of an update's first step is 1 only if the scoring pass computes what the training forward computes:
the same packed rows (:meth:`cope.train.module.AgentRLModule.logprobs`), the same micro-batches and the same precision context
(e.g. bf16 autocast under ``bf16-mixed``, which Lightning applies to ``training_step`` only). The reference pass runs
after the policy's, so that under ``trainer=fsdp`` one whole model is gathered at a time.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, ContextManager, Protocol

import torch

from cope.train.objectives import TokenScores

if TYPE_CHECKING:
    from cope.models.policy import Policy


class Scorer(Protocol):
    """What the scoring pass reads of the module (:class:`cope.train.module.AgentRLModule` is one)."""

    model: torch.nn.Module
    policy: Policy  # its ``reference()`` context gives the reference model
    device: torch.device
    needs_ref: bool

    def micro_batches(self, batch: dict) -> list[tuple[torch.Tensor | None, int | None]]: ...

    def precision_context(self) -> ContextManager: ...

    def logprobs(self, batch: dict, rows: torch.Tensor | None = None, length: int | None = None, entropy: bool = True,
                 model: torch.nn.Module | None = None, rows_at: Sequence[str] = ()) -> TokenScores: ...


@torch.no_grad()
def score_minibatches(module: Scorer, minibatches: list[dict]) -> None:
    """Fill ``old_logprobs``, ``old_entropy`` (and ``ref_logprobs`` when the objectives need a reference) of each
    minibatch, with the module's model in eval mode (no dropout); its mode is restored afterwards."""
    was = module.model.training
    module.model.eval()
    try:
        for mb in minibatches:
            mb["old_logprobs"], mb["old_entropy"] = _score(module, mb)
        if module.needs_ref:
            with module.policy.reference() as ref_model:
                for mb in minibatches:
                    mb["ref_logprobs"] = _score(module, mb, ref_model)[0]
    finally:
        module.model.train(was)


def _score(module: Scorer, mb: dict, model=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-probs, entropy) of every row of ``mb`` on CPU, micro-batch by micro-batch, under the training forward's
    precision context; ``model``: the KL reference (no entropy), else the policy."""
    dev = {k: v.to(module.device) for k, v in mb.items()}
    lp = torch.zeros(dev["input_ids"].shape, device=module.device)
    ent = torch.zeros(dev["input_ids"].shape, device=module.device)
    for rows, n in module.micro_batches(dev):
        r = slice(None) if rows is None else rows
        c = slice(None) if n is None else slice(0, n)
        with module.precision_context():
            if model is None:
                scores = module.logprobs(dev, rows, n)
                lp[r, c], ent[r, c] = scores.logprobs, scores.entropy
            else:
                lp[r, c] = module.logprobs(dev, rows, n, entropy=False, model=model).logprobs
    return lp.cpu(), ent.cpu()
