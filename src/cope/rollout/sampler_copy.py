"""A frozen sampler copy of the policy at one version, for the in-process engine's overlapped rollouts.

With ``data.max_lag >= 1`` a background thread samples epoch e + L with the weights of epoch e while the main thread
trains them on. The in-process engine cannot sample from the training model itself then; it samples from a
snapshot taken when the version was synced (:func:`snapshot`). Only the trainable tensors are copied (the LoRA
adapter: a few MB at 7B); every frozen tensor (the base weights, quantized or not, and the buffers) is shared with the
training model, which never writes them, so a snapshot costs the adapter's memory, not the model's. Under full
fine-tuning every weight trains, so a snapshot would be a whole second model per held version: that combination is
refused (:func:`copy_problem`).
"""
from __future__ import annotations

import copy

import torch


def snapshot(model: torch.nn.Module) -> torch.nn.Module:
    """An eval-mode copy of ``model`` whose trainable parameters are copies (frozen: ``requires_grad`` False) and whose
    frozen parameters and buffers are the model's own tensors, shared."""
    shared = {id(t): t for t in model.parameters() if not t.requires_grad}
    shared.update({id(b): b for b in model.buffers()})
    with torch.no_grad():
        twin = copy.deepcopy(model, memo=dict(shared))
    twin.eval()
    for p in twin.parameters():
        p.requires_grad_(False)
    return twin


def copy_problem(finetune: str | None, strategy: str | None) -> tuple[str, str] | None:
    """Why the in-process engine cannot take ``data.max_lag >= 1`` with these settings, as (key, message); None: it can."""
    if finetune == "full":
        return "model.finetune", ("= full with data.max_lag >= 1 and rollout=hf: each held version would be a whole copy "
                                  "of the model (every weight trains). Use model.finetune=lora, or data.max_lag=0")
    if strategy and "FSDP" in strategy:
        return "trainer.strategy", ("is sharded (trainer=fsdp) with data.max_lag >= 1 and rollout=hf: a sampler copy would "
                                    "need the whole weights gathered while the shards train. Use rollout=vllm, or "
                                    "data.max_lag=0")
    return None
