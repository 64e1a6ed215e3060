"""The training module's part of a Lightning checkpoint: what it writes beside Lightning's own state, and checks on load.

A checkpoint holds only the trainable weights (the adapter; every weight under full fine-tuning), plus the optimizer,
scheduler and counters (in the DataModule's state), the objectives' state (its only copy) and the dropped-step counts
of the step guard and the trust region; no RNG state (each epoch's generators are derived from the seed, the rank and
the epoch); the frozen base is never written. Loading refuses a checkpoint that lacks a trainable tensor (another LoRA
config or ``model.finetune``) and warns when the world size changed (the weights carry over, the task streams do not).
"""
from __future__ import annotations

import logging

log = logging.getLogger(__name__)


def save_state(module, checkpoint: dict) -> None:
    """``on_save_checkpoint`` of ``module`` (an :class:`~cope.train.module.AgentRLModule`): trims ``state_dict`` to
    the trainable tensors and adds the module's own entries."""
    trainable = {n for n, p in module.named_parameters() if p.requires_grad}
    checkpoint["state_dict"] = {k: v for k, v in checkpoint["state_dict"].items() if k in trainable}
    checkpoint["objectives"] = {o.name: o.state_dict() for o in module.objectives}  # their only copy
    checkpoint["base_model"] = module.policy.source
    checkpoint["finetune"] = module.policy.finetune
    checkpoint["skipped_steps"] = module.step_guard.skipped
    checkpoint["zero_grad_steps"] = module.step_guard.zero_skipped
    checkpoint["kl_stopped_steps"] = module.trust_region.stopped_steps
    checkpoint["world_size"] = module.trainer.world_size


def load_state(module, checkpoint: dict) -> None:
    """``on_load_checkpoint`` of ``module``: checks the trainable tensors are there and restores what
    :func:`save_state` added."""
    trainable = {n for n, p in module.named_parameters() if p.requires_grad}
    # (a sharded checkpoint's tensors were loaded by the strategy, which asked for every trained one)
    missing = trainable - set(checkpoint["state_dict"]) if "state_dict" in checkpoint else set()
    if missing:
        raise KeyError(f"checkpoint lacks {len(missing)} trainable tensors, e.g. {sorted(missing)[:3]}: another LoRA "
                       "config, or written with another model.finetune?")
    for o in module.objectives:
        o.load_state_dict(checkpoint.get("objectives", {}).get(o.name, {}))
    module.step_guard.skipped = int(checkpoint.get("skipped_steps", 0))
    module.step_guard.zero_skipped = int(checkpoint.get("zero_grad_steps", 0))
    module.trust_region.stopped_steps = int(checkpoint.get("kl_stopped_steps", 0))
    written, world = checkpoint.get("world_size"), module.trainer.world_size
    if written is not None and int(written) != world:  # weights, moments and counters are whole
        log.warning("resuming a checkpoint written by %d processes on %d: the weights, optimizer state and counters "
                    "carry over, but each rank's task stream derives from (seed, rank, epoch), so the episodes "
                    "from here on are not the ones the %d-process run would have drawn", int(written), world, int(written))
