"""What a class can do, as attributes it declares: the one way a rule asks whether two parts can run together.

Style rule 15, "capabilities, not names": a rule about what can run with what never matches a class name. It
resolves the class (the config rules, :mod:`cope.run.config_rules`, from a block's ``_target_`` with Hydra's
``get_object``, or from a Lightning registry name with Lightning's ``StrategyRegistry``; the runtime from the object
it holds) and asks :func:`can`, so a subclass, or a class under another name, follows the same rules (Lightning's
accelerator registry works so). This module imports nothing of the project: every layer may ask it.

Rollout engines (``data.engine``; the protocol :class:`cope.rollout.engine.RolloutEngine`):

* ``overlaps``: serves an older policy version while the weights train on (``data.max_lag >= 1`` needs it);
* ``reports_logprobs``: every sampled action carries the sampler's own log-probs (``Step.sampler_logprobs``);
* ``samples_in_process``: samples from the training model's own weights, in this process; a held version is a
  sampler copy of the trainable tensors (:mod:`cope.rollout.sampler_copy`). Full fine-tuning and sharded weights
  need such an engine;
* ``serves_adapters``: a server samples each policy version as a LoRA adapter loaded into it, in a limited number of
  slots (the engine's ``max_loras`` argument);
* ``completes``: samples plain continuations of token contexts, no env (``engine.complete``: RWML's world-model
  predictions);
* ``lends_actor``: lends a sampling actor on a policy version for a block of calls
  (``engine.actor(sampling, seed, version=None, logprobs=False)``; None: the newest, else a held one): the branching
  collector grows its trees with it, in the background on a held version with ``data.max_lag >= 1``.

Strategies (``trainer.strategy``):

* ``shards_weights``: each rank holds a shard of the weights;
* ``gathers_for_rollouts``: a sharding strategy that gathers the weights whole on every rank outside the optimizer
  steps (rollouts, the scoring pass, callbacks' probes: :class:`cope.train.fsdp.sharding.WholeWeights`). The
  project's sharded training needs it: a strategy that shards without it is refused (use ``trainer=fsdp``).

A class that declares a capability is taken at its word. One that declares nothing gets ``False``, except classes
this project does not own, whose capability follows from what they are (:data:`DEFAULTS`: Lightning's FSDP,
model-parallel and DeepSpeed strategies shard the weights).
"""
from __future__ import annotations

from typing import Any, Callable

ENGINE = ("overlaps", "reports_logprobs", "samples_in_process", "serves_adapters", "completes", "lends_actor")
STRATEGY = ("shards_weights", "gathers_for_rollouts")


def _lightning_shards(cls: type) -> bool:
    """Lightning's strategies that shard the weights (parameters, gradients, optimizer state) over ranks."""
    from lightning.pytorch.strategies import DeepSpeedStrategy, FSDPStrategy, ModelParallelStrategy

    return issubclass(cls, (FSDPStrategy, ModelParallelStrategy, DeepSpeedStrategy))


# the capability of a class that does not declare it (classes of other projects), from what the class is
DEFAULTS: dict[str, Callable[[type], bool]] = {"shards_weights": _lightning_shards}


def can(what: Any, capability: str) -> bool:
    """Whether ``what`` (a class, or an object: its class) has ``capability`` (one of :data:`ENGINE` or
    :data:`STRATEGY`): the attribute its class declares, else the :data:`DEFAULTS` entry, else False. ``None`` (no
    class: ``trainer.strategy=auto``) can nothing."""
    if capability not in ENGINE + STRATEGY:
        raise KeyError(f"unknown capability {capability!r}; known: {', '.join(ENGINE + STRATEGY)}")
    if what is None:
        return False
    cls = what if isinstance(what, type) else type(what)
    declared = getattr(cls, capability, None)
    if declared is not None:
        return bool(declared)
    default = DEFAULTS.get(capability)
    return bool(default(cls)) if default is not None else False
