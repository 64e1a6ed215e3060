"""The epoch's scoring pass: the old (and reference) log-probs of every minibatch, before any update.

The PPO ratio of an update's first step is 1 only if the scoring pass computes what the training forward computes:
the same packed rows (:meth:`AgentRLModule.logprobs`), the same micro-batches and the same precision context
(e.g. bf16 autocast under ``bf16-mixed``, which Lightning applies to ``training_step`` only). The reference pass runs
after the policy's, so that under ``trainer=fsdp`` one whole model is gathered at a time.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from cope.train.module import AgentRLModule


@torch.no_grad()
def score_minibatches(module: AgentRLModule, minibatches: list[dict]) -> None:
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


def _score(module: AgentRLModule, mb: dict, model=None) -> tuple[torch.Tensor, torch.Tensor]:
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
                lp[r, c], ent[r, c] = module.logprobs(dev, rows, n)
            else:
                lp[r, c] = module.logprobs(dev, rows, n, entropy=False, model=model)[0]
    return lp.cpu(), ent.cpu()
