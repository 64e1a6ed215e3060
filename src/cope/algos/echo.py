"""ECHO observation loss: next-token NLL on the environment's own output (arXiv 2605.24517).

Follows ECHO section 3.1: ``L = L_GRPO(action tokens) + lambda * L_env`` with, per sequence,
``L_env = sum of -log p over the selected observation tokens O' / |O|``. O' is the environment's
output only (``Role.OBSERVATION``); harness text our adapters insert (``Role.HARNESS``: parse
warnings, truncation notices) is excluded from the numerator but counted in the denominator |O|,
the sequence's whole observation length. The per-sequence values are averaged over sequences.

As in the paper: it shares the policy's forward pass; the importance ratio, clipping and KL stay on
action tokens (this term has none of them); it applies to every non-aborted rollout, failed ones too.
lambda defaults to 0.05 (the published Qwen3-8B config); it can be scheduled because another lab
reported collapse at 0.05 on a larger model and stability at 0.005.

Without a verifier (``algo=echo_only``, ECHO's section on training past the verifier): the observation loss alone,
every other objective at weight 0 (``alone``, checked before any work by :mod:`cope.run.config_rules`), so action
tokens get exactly zero gradient and the env's reward is never read; optionally only clean rollouts (``clean_only``:
no action the env refused, the paper's "no malformed tool calls"), on any split (``data.train_split=test``: the
paper trains on held-out tasks). The paper starts it from its best ECHO checkpoint (``model.adapter=...``).

Deliberate choices:
    * Aborted episodes (env crash or timeout) and packed CoPE forecast rows are left out: their
      observations are not a faithful transcript of an env turn.
    * Sequences with no observation or harness token are left out of the mean; when none is left
      the loss is exactly 0, still attached to the graph.
    * Every OBSERVATION token counts, including the reset observation inside the first prompt turn;
      the chat scaffold around observations is PROMPT and is never a target.
"""
from __future__ import annotations

import torch

from cope.episode import Role
from cope.train.objectives import ForwardOut, Metrics, Objective


def observation_nll(logprobs: torch.Tensor, roles: torch.Tensor, valid_rows: torch.Tensor) -> tuple[torch.Tensor, Metrics]:
    """ECHO's L_env averaged over valid sequences.

    Args:
        logprobs: (N, T) log p(token t | tokens < t) (with grad).
        roles: (N, T) long :class:`cope.episode.Role` values.
        valid_rows: (N,) bool, rows that may contribute.

    Returns:
        (loss, metrics) with detached ``echo/obs_tokens``, ``echo/harness_tokens`` (counts over valid
        rows) and ``echo/nll_per_token`` (numerator / number of OBSERVATION tokens).
    """
    valid = valid_rows.bool()[:, None]  # (N, 1)
    obs = (roles == int(Role.OBSERVATION)) & valid  # (N, T)
    harness = (roles == int(Role.HARNESS)) & valid  # (N, T)
    nll = torch.where(obs, -logprobs, torch.zeros_like(logprobs))  # (N, T), 0 off-target
    num = nll.sum(-1)  # (N,)
    den = (obs | harness).sum(-1)  # (N,) the whole observation length |O|
    rows = den > 0  # (N,)
    if bool(rows.any()):
        loss = (num[rows] / den[rows]).mean()
    else:
        loss = (logprobs * 0).sum()
    n_obs = obs.sum()
    metrics: Metrics = {
        "echo/obs_tokens": n_obs.float(),
        "echo/harness_tokens": harness.sum().float(),
        "echo/nll_per_token": num.detach().sum() / n_obs.clamp(min=1),
    }
    return loss, metrics


class ObservationLoss(Objective):
    """ECHO's environment-modelling term (``loss/echo``).

    Rows used: ``~batch["aborted"]``, minus rows that are not transcripts (``batch["aux_row"]``, when present), and
    with ``clean_only`` minus rows with an action not in the env's strict format (``batch["unclean_steps"] > 0``: refused,
    or read out of free text by the action projection, ``env.action_parsing=project``).

    Args:
        weight: lambda, the multiplier in the total loss (>= 0; ECHO's published value 0.05).
        schedule: ``constant`` or ``linear`` from ``weight`` to ``final_weight``.
        final_weight: end point of the linear schedule (>= 0).
        schedule_steps: length of the linear schedule in optimizer steps.
        clean_only: only rollouts whose every action was in the strict format (ECHO's verifier-free run trains on
            clean rollouts: no malformed tool call).
        alone: the run's only objective (ECHO without a verifier, ``algo=echo_only``): every other objective of
            ``algo.objectives`` must have weight 0 (and final weight 0), refused before any work otherwise.
    """

    name = "echo"

    def __init__(self, weight: float = 0.05, schedule: str = "constant", final_weight: float = 0.0, schedule_steps: int = 0,
                 clean_only: bool = False, alone: bool = False):
        super().__init__(weight=weight, schedule=schedule, final_weight=final_weight, schedule_steps=schedule_steps)
        self.clean_only, self.alone = bool(clean_only), bool(alone)

    def __call__(self, out: ForwardOut, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, Metrics]:
        valid = ~batch["aborted"].bool()  # (N,)
        if "aux_row" in batch:
            valid = valid & ~batch["aux_row"].bool()  # (N,)
        if self.clean_only:
            valid = valid & (batch["unclean_steps"] == 0)  # (N,)
        loss, metrics = observation_nll(out.logprobs, batch["roles"], valid)
        if self.clean_only:
            metrics["echo/clean_rows"] = valid.sum().float()
        return loss, metrics
