"""A frozen sampler copy of the policy at one version, for the in-process engine's overlapped rollouts.

With ``data.max_lag >= 1`` a background thread samples epoch e + L with the weights of epoch e while the main thread
trains them on. The in-process engine cannot sample from the training model itself then; it samples from a
snapshot taken when the version was synced (:func:`snapshot`). Only the trainable tensors are copied (the LoRA
adapter: a few MB at 7B); every frozen tensor (the base weights, quantized or not, and the buffers) is shared with the
training model, which never writes them, so a snapshot costs the adapter's memory, not the model's. Under full
fine-tuning every weight trains, so a snapshot would be a whole second model per held version, and under sharded
weights a snapshot would need them gathered while the shards train: both are refused before any work (the config
rules, :data:`cope.run.config_rules.RULES`, for an engine that samples in process).
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
