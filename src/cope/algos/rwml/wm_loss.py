"""WM-SFT's loss: the next-observation cross-entropy behind the world-model prompt (``algo=wm_sft``, ``loss/wm``).

Follows the world-model SFT term of CoPE's authors' code (ulab-uiuc/CoPE,
``src/verl/agent_trainer/ppo/world_model_loss.py``): the mean token NLL of the observation targets of the batch's
world-model samples (sum of -log p over every target token / the number of target tokens), times a small
coefficient (their range 1e-4 .. 0.01; 0.01 here). The samples and where they sit in the batch:
:mod:`cope.algos.rwml.wm_sft`.

Where we differ: their recommended path runs it as its own optimizer step after the policy update (an Adam step on
the same optimizer, which mostly normalizes the coefficient away); here it is summed into the policy-gradient loss of
each rollout minibatch, as their in-place variant does (:mod:`cope.algos.rwml.wm_sft` says why). The token mean's
normalizer is the number of target tokens of the whole minibatch, read from its mask: the micro-batch contract of
:class:`cope.train.objectives.ForwardOut` holds.
"""
from __future__ import annotations

import torch

from cope.train.objectives import ForwardOut, Metrics, Objective

WM_MASK = "wm_mask"  # (N, T) bool batch key: the world-model targets (the observation ids and their turn end)


def observation_nll(logprobs: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, Metrics]:
    """Mean NLL over the target tokens.

    Args:
        logprobs: (N, T) log p(token t | tokens < t), with grad (the model's own distribution at non-action tokens).
        mask: (N, T) bool, the target tokens.

    Returns:
        (loss, metrics): ``wm/nll`` (the loss, detached) and ``wm/tokens``. No target token: exactly 0, attached.
    """
    mask = mask.bool()
    n = mask.sum()
    nll = torch.where(mask, -logprobs, torch.zeros_like(logprobs)).sum()  # off-mask values never enter
    loss = nll / n.clamp(min=1)
    return loss, {"wm/nll": loss.detach(), "wm/tokens": n.detach().float()}


class WorldModelNLL(Objective):
    """WM-SFT's objective (``loss/wm``) on the rollout minibatches; reads ``batch["wm_mask"]`` (a batch without it,
    or without targets, gives a loss of exactly 0).

    Args:
        weight: the coefficient (default 0.01; CoPE's authors' range 1e-4 .. 0.01).
        schedule, final_weight, schedule_steps, power: see :class:`cope.train.objectives.Objective`.
    """

    name = "wm"

    def __init__(self, weight: float = 0.01, schedule: str = "constant", final_weight: float = 0.0,
                 schedule_steps: int = 0, power: float = 2.0):
        super().__init__(weight=weight, schedule=schedule, final_weight=final_weight, schedule_steps=schedule_steps,
                         power=power)

    def __call__(self, out: ForwardOut, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, Metrics]:
        mask = batch.get(WM_MASK)
        if mask is None:
            mask = torch.zeros_like(out.logprobs, dtype=torch.bool)
        return observation_nll(out.logprobs, mask.to(out.logprobs.device))
