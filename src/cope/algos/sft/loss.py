"""Supervised fine-tuning loss: next-token cross-entropy on a demonstration's action tokens (``loss/sft``).

Behaviour cloning (Pomerleau 1989; for LLM agents, the "SFT on expert trajectories" baseline of AgentTuning, Zeng et
al. 2023, and ETO, Song et al. 2024): ``L = sum over target tokens of -log p(token | prefix) / number of target
tokens``, the targets being the ACTION tokens of the batch's non-aborted rows (``batch["action_mask"]``), each
action's end-of-turn id included (the policy learns where an action stops), so the policy imitates the expert's
actions given the transcript it saw, in its own chat scaffold.

Deliberate choices:
    * Token mean over the whole batch (every target token weighs the same; TRL's SFTTrainer and HF Trainer average
      the same way), not a mean per episode first: a demonstration is a sequence of correct actions, and a long one
      has more of them to teach. The normalizer is the batch's target count, read from the masks alone, so a
      micro-batched step computes exactly the loss of the whole minibatch (``ForwardOut``'s contract). Under DDP the
      mean is each rank's own (the ranks' gradients are then averaged, as Lightning does): a rank with fewer target
      tokens weighs each of them more, as in HF Trainer without ``average_tokens_across_devices``.
    * ``observations=True`` also trains the OBSERVATION tokens (the env's own text, as ECHO's observation loss,
      :mod:`cope.algos.echo`) of the same rows, in the same token mean; HARNESS text and the chat scaffold (PROMPT)
      are never targets. Off by default: SFT imitates the actions.
    * ``invalid="skip"`` (the default) leaves out the action tokens of steps the env refused
      (``batch["invalid_mask"]``: ``Step.valid`` False, e.g. a move into a wall or a malformed call). A successful
      demonstration from a file (a stronger run's episodes) can hold such a step that the episode recovered from:
      imitating it teaches the mistake. The rest of the transcript stays (later actions are conditioned on the env's
      answer to it). An answer the env read out of free text (``env.action_parsing=project``) is valid and trained:
      the env accepted it, and a file of such a run's successes is all of that form (replay it under
      ``env.action_parsing=strict`` to have them refused). ``invalid="train"`` imitates every action, as behaviour
      cloning of whole trajectories does (AgentTuning, ETO). The experts here make no invalid steps.
    * Temperature: ``ForwardOut.logprobs`` at action tokens are taken under the sampling distribution
      ``softmax(logits / module.temperature)`` (:mod:`cope.train.logprobs`), which is right for a policy-gradient
      ratio but is not the model's own distribution. The cross-entropy of SFT is the model's own (untempered), so an
      SFT run scores at ``module.temperature=1``: the objective is told the module's temperature (``temperature:
      ${module.temperature}`` in ``conf/algo/sft.yaml``) and refuses any other at construction, before the model is
      built (``module.temperature`` follows ``data.sampling.temperature``, 1 by default, which SFT never samples
      with; a temperature <= 0, greedy, also scores at 1). Taking full untempered rows instead (``Needs.rows_at``)
      would cost a (P, V) fp32 tensor per action token: at a 152k vocabulary, 600 MB per thousand action tokens.
      ``tests/test_sft.py`` pins that the trained loss is the untempered cross-entropy.
    * An empty target set (every row aborted) gives a loss of exactly 0, still attached to the graph.
"""
from __future__ import annotations

import torch

from cope.episode import Role
from cope.train.objectives import ForwardOut, Metrics, Objective

INVALID = ("skip", "train")


def sft_targets(action_mask: torch.Tensor, roles: torch.Tensor, aborted: torch.Tensor, aux_row: torch.Tensor | None,
                observations: bool, invalid_mask: torch.Tensor | None = None) -> torch.Tensor:
    """(N, T) bool: the tokens SFT trains: ``action_mask`` (the ACTION tokens of non-aborted rows) minus
    ``invalid_mask`` when given (the actions of steps left out), plus, when ``observations``, the OBSERVATION tokens
    of the rows that are neither aborted nor auxiliary (``aux_row``)."""
    targets = action_mask.bool()  # (N, T)
    if invalid_mask is not None:
        targets = targets & ~invalid_mask.bool()
    if observations:
        rows = ~aborted.bool()  # (N,)
        if aux_row is not None:
            rows = rows & ~aux_row.bool()
        targets = targets | ((roles == int(Role.OBSERVATION)) & rows[:, None])  # (N, T)
    return targets


def sft_cross_entropy(logprobs: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, Metrics]:
    """Mean negative log-likelihood over the target tokens.

    Args:
        logprobs: (N, T) log p(token t | tokens < t), with grad (untempered: see the module docstring).
        targets: (N, T) bool, the tokens to imitate.

    Returns:
        (loss, metrics) with detached ``sft/nll`` (the loss) and ``sft/target_tokens`` (the target count).
    """
    targets = targets.bool()
    n = targets.sum()
    nll = torch.where(targets, -logprobs, torch.zeros_like(logprobs))  # (N, T), 0 off-target
    loss = nll.sum() / n if bool(n) else (logprobs * 0).sum()
    return loss, {"sft/nll": loss.detach(), "sft/target_tokens": n.float()}


class SFTLoss(Objective):
    """Cross-entropy on the demonstration's action tokens (``loss/sft``); see the module docstring.

    Reads ``batch["action_mask"]`` (and, with ``observations``, ``roles``, ``aborted`` and ``aux_row``) and
    ``out.logprobs``, which must be untempered (``module.temperature=1``, as ``algo=sft`` sets it).

    Args:
        weight: multiplier in the total loss.
        observations: also train the OBSERVATION tokens of the same rows (off: actions only).
        invalid: ``skip`` (leave out the actions of steps the env refused, ``batch["invalid_mask"]``) or ``train``
            (imitate them too); see the module docstring.
        temperature: the temperature the module scores action tokens at (``${module.temperature}``): 1, or <= 0
            (greedy, scored at 1); anything else is refused (the loss would be another cross-entropy).
        schedule, final_weight, schedule_steps: see :class:`cope.train.objectives.Objective`.
    """

    name = "sft"

    def __init__(self, weight: float = 1.0, observations: bool = False, temperature: float = 1.0,
                 invalid: str = "skip", schedule: str = "constant", final_weight: float = 0.0, schedule_steps: int = 0):
        super().__init__(weight=weight, schedule=schedule, final_weight=final_weight, schedule_steps=schedule_steps)
        if not isinstance(observations, bool):
            raise ValueError(f"algo.objectives.sft.observations (SFTLoss.observations) must be true or false, "
                             f"got {observations!r}")
        if temperature > 0 and temperature != 1:
            raise ValueError(f"module.temperature={temperature}: algo=sft trains the model's own cross-entropy, so "
                             f"action tokens must be scored at temperature 1 (module.temperature follows "
                             f"data.sampling.temperature, which SFT never samples with: set it to 1)")
        if invalid not in INVALID:
            raise ValueError(f"algo.objectives.sft.invalid (SFTLoss.invalid) must be one of {INVALID}, "
                             f"got {invalid!r}")
        self.observations, self.invalid = observations, invalid

    def __call__(self, out: ForwardOut, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, Metrics]:
        invalid = batch.get("invalid_mask") if self.invalid == "skip" else None
        targets = sft_targets(batch["action_mask"], batch["roles"], batch["aborted"], batch.get("aux_row"),
                              self.observations, invalid)
        loss, metrics = sft_cross_entropy(out.logprobs, targets)
        if invalid is not None:
            metrics["sft/invalid_tokens"] = (invalid.bool() & batch["action_mask"].bool()).sum().float()
        return loss, metrics
