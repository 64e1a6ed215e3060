"""Sharded training (``trainer=fsdp``): Lightning's FSDP2 path (``ModelParallelStrategy``, torch ``fully_shard``).

Each rank holds a 1/world shard of every sharded parameter, its gradient and its optimizer moments; a group's
parameters are all-gathered just before the group's forward (and backward) and freed after it. Groups:

* **each decoder layer** (the classes the HF model names in ``_no_split_modules``), one group per layer;
* **the causal LM** (embeddings, final norm, output head, and every parameter left over), the FSDP root. Tied
  embeddings are one parameter in this one group. The fused log-prob head (:mod:`cope.train.logprobs`) runs as the
  output head inside the LM's forward, so the root's parameters are gathered where they are read; the root keeps
  them gathered from its forward to the end of its backward (FSDP's default for the root), when its gradients are
  reduce-scattered. The head may be trained (full fine-tuning).

**LoRA adapters are sharded, inside their layer's group.** They ride the all-gather that gathers the layer's frozen
weights anyway and their gradients the layer's reduce-scatter, so there is no second collective path (a replicated
adapter would need its own all-reduce, and the frozen weights around it would still be sharded); their AdamW moments
are sharded with them. Their share of each collective is the adapter's size, small next to the frozen
weights', and it is the layout full fine-tuning needs.

**Full fine-tuning** (``model.finetune=full``, fp32 master weights: the config check refuses bf16 weights, whose small
updates round away): every parameter, its gradient and both AdamW moments are sharded (1/world of each per rank),
and under bf16 mixed precision the forward gathers bf16 copies. The KL reference is a frozen copy of the starting
weights (stored in bf16 under bf16 mixed precision: it only ever computes in bf16)
(:meth:`cope.models.policy.Policy.freeze_reference`), sharded in groups of its own; the scoring pass gathers the
policy for the old log-probs, then shards it and gathers the reference for the reference log-probs
(:class:`SwappedWeights`), so one whole model is held at a time. Under LoRA the reference is the same sharded model
with the adapter switched off (``disable_adapter()``): nothing changes for FSDP.

**The optimizer step.** Gradients are DTensors (``Shard(0)``). :func:`total_grad_norm` is the global norm (torch's
``get_total_norm`` sums the shards' squares over the mesh); Lightning's ``clip_gradients`` (torch's
``clip_grad_norm_``) scales every shard by the same global coefficient. Micro-batches: :meth:`FSDPStrategy.
block_backward_sync` switches FSDP's gradient reduce-scatter off for all but the last micro-batch
(``set_requires_gradient_sync``), as DDP's ``no_sync``: the micro-batches accumulate *unsharded* gradients of the
trainable parameters (small under LoRA; a whole gradient copy per rank under full fine-tuning, where
``sync_every_microbatch=True`` trades the collectives back for that memory).

**Which phase is sharded.** The in-process rollout engine runs the model on each rank independently (ranks generate
different numbers of tokens), and so do the scoring pass (a token budget cuts each rank's rows into its own number of
micro-batches) and the callbacks' probes: per-forward all-gathers would deadlock there. So the groups are gathered
once (:class:`WholeWeights`, ``set_reshard_after_forward(False)``) for everything but the optimizer steps, and
sharded for the steps: the module shards at each training batch's start and gathers at its end, and the DataModule
enters :attr:`cope.models.policy.Policy.full_weights` around collection and validation rollouts (a no-op when
already gathered). A step whose ranks cut different numbers of micro-batches runs gathered too (:func:`step_weights`;
its gradients are still reduce-scattered once). The gathered weights are bit-identical to the unsharded model's.
Memory per rank is therefore: whole weights (plus the KV cache) during rollouts, as DDP; shards (plus one gathered
layer, activations, the trainable parameters' gradients and moments, all sharded) during the optimizer steps.

**Checkpoints** (:class:`cope.train.fsdp.strategy.FSDPStrategy`): by default the trainable tensors and the optimizer
state are gathered into one ordinary checkpoint file on rank zero, written through the trainer's (atomic)
``CheckpointIO``, with the DDP checkpoint's layout except that the optimizer state is keyed by parameter name; resume
loads each rank's shard of it, exactly, at any world size. ``distributed_checkpoint=true``: a torch distributed
checkpoint folder, each rank writing its shards (:mod:`cope.train.fsdp.checkpoint`). A DDP checkpoint (optimizer
state keyed by index) is refused with the file and the fix, and the reverse.

Mixed precision: fp32 on CPU (the tests); on CUDA, bf16 compute with fp32 gradient reduction
(``MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32)``), ``mixed_precision="auto"``; the CUDA
path has not run on a GPU yet.
"""
from __future__ import annotations

import contextlib
import logging
from typing import Iterator

import torch

from cope.capabilities import can

log = logging.getLogger(__name__)
_logged_uneven: list[bool] = []  # the uneven-step note is logged once per process


def configure_sharding(module) -> WholeWeights | None:
    """What ``AgentRLModule.configure_model`` does: under a strategy that shards the weights and gathers them for
    rollouts (:class:`cope.train.fsdp.strategy.FSDPStrategy`, or a subclass), shard ``module.model``
    (:func:`shard_policy`) and set the policy's ``full_weights``; returns the :class:`WholeWeights` switch (None under
    a strategy that shards nothing: nothing happens). Another sharding strategy is refused (the config rules refuse it
    first; this is for a direct ``Trainer`` user)."""
    strategy = module.trainer.strategy
    if not can(strategy, "shards_weights"):
        return None
    if not can(strategy, "gathers_for_rollouts"):
        raise TypeError(f"{type(strategy).__name__}: shards the weights but does not gather them for rollouts; the "
                        "policy is sharded by cope.train.fsdp.strategy.FSDPStrategy (trainer=fsdp) only")
    mesh, policy = strategy.device_mesh["data_parallel"], module.policy
    counts = shard_policy(module.model, mesh, strategy.mp_policy())
    if counts is not None:  # sharded now (not again for a fit after a validation)
        log.info("trainer=fsdp: rank %d holds %d of %d parameters (%d whole on every rank)",
                 strategy.global_rank, counts["local"], counts["full"], counts["replicated"])
    if not isinstance(policy.full_weights, WholeWeights):
        policy.full_weights = WholeWeights(module.model)
    if policy.reference_model is not None and not isinstance(policy.reference_weights, SwappedWeights):
        mp = strategy.mp_policy()
        if mp is not None:  # it only ever computes in bf16 (never trained): its shards are stored so, 2 B per weight
            for p in policy.reference_model.parameters():  # parameters only: Module.to would round the rotary
                p.data = p.data.to(mp.param_dtype)  # inv_freq buffer too (Qwen2.5-7B's: angles off by 4.7 rad at 4k)
        shard_policy(policy.reference_model, mesh, mp)  # full fine-tuning's frozen reference
        policy.reference_weights = SwappedWeights(policy.full_weights, WholeWeights(policy.reference_model))
    return policy.full_weights


class StepWeights(contextlib.ExitStack):
    """The context of one optimizer step's forwards and backwards (:func:`step_weights`); ``pad_to``: the number of
    backward passes every rank must run (None: its own micro-batches)."""

    pad_to: int | None = None


def step_weights(module, batch: dict) -> StepWeights:
    """The context of one optimizer step's forwards and backwards on ``batch`` under :class:`FSDPStrategy`: sharded
    (per-layer all-gathers) when every rank cuts its batch into as many micro-batches, else gathered (no collective
    per forward, which ranks with different micro-batch counts could not match). Other strategies: an empty context.
    One small collective under FSDP when a token budget is set.

    Gradient reduce-scatters must match too. By default one runs per step, at the last micro-batch, on every rank
    alike. With ``sync_every_microbatch`` one runs per backward pass, so in a step whose ranks cut different numbers
    ``pad_to`` says how many passes each rank runs: the largest count; a rank with fewer adds passes that contribute
    zero gradient (:func:`cope.train.step.backward.backward_microbatched`). Holding the sync to the last micro-batch
    instead would bring back the whole unsharded gradient the flag exists to avoid (4 B a trained weight)."""
    step = StepWeights()
    whole = getattr(module.policy, "full_weights", None)
    if not isinstance(whole, WholeWeights) or module.max_tokens_per_microbatch is None:
        return step  # one forward per step on every rank
    n_parts = len(module.micro_batches(batch))
    strategy = module.trainer.strategy
    n = torch.tensor([n_parts, -n_parts], dtype=torch.float64, device=module.device)
    n = strategy.reduce(n, reduce_op="max")
    most, fewest = int(n[0]), -int(n[1])
    if most == fewest:
        return step
    if not _logged_uneven:
        _logged_uneven.append(True)
        log.info("trainer=fsdp: the ranks cut one step's minibatch into %d to %d micro-batches: such steps run on "
                 "gathered weights%s (logged once)", fewest, most,
                 ", every rank running as many backward passes (sync_every_microbatch)"
                 if getattr(strategy, "sync_every_microbatch", False) else "")
    step.enter_context(whole())
    if getattr(strategy, "sync_every_microbatch", False):
        step.pad_to = most
    return step


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's decoder layers: modules whose class the HF model lists in ``_no_split_modules``."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    names = set(getattr(base, "_no_split_modules", None) or [])
    layers = [m for m in base.modules() if type(m).__name__ in names]
    if not layers:
        raise ValueError(f"trainer=fsdp: {type(base).__name__} names no decoder layer class (_no_split_modules="
                         f"{sorted(names)}); it cannot be sharded by layer. Use trainer=ddp")
    return layers


def shard_policy(model: torch.nn.Module, mesh, mp_policy=None) -> dict[str, int] | None:
    """``fully_shard`` on each decoder layer, then on the causal LM (the root: embeddings, norm, head); idempotent (a
    second call, as a validation before fit makes, does nothing and returns None). Returns parameter counts: ``full``,
    ``local`` (what this rank holds), ``replicated`` (whole on every rank: none once sharded)."""
    from torch.distributed.fsdp import FSDPModule, fully_shard

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    kw = {"mp_policy": mp_policy} if mp_policy is not None else {}
    if isinstance(base, FSDPModule):
        return None
    for layer in decoder_layers(model):
        fully_shard(layer, mesh=mesh, **kw)
    fully_shard(base, mesh=mesh, **kw)
    return parameter_counts(model)


def parameter_counts(model: torch.nn.Module) -> dict[str, int]:
    """``full`` (every parameter once), ``local`` (held by this rank: its shards plus whole tensors) and
    ``replicated`` (whole tensors, not sharded)."""
    from torch.distributed.tensor import DTensor

    full = local = replicated = 0
    for p in model.parameters():
        full += p.numel()
        if isinstance(p, DTensor):
            local += p.to_local().numel()
        else:
            local += p.numel()
            replicated += p.numel()
    return {"full": full, "local": local, "replicated": replicated}


def fsdp_roots(model: torch.nn.Module | None) -> list:
    """The outermost FSDP modules under ``model`` (each a group whose gradient reduce-scatter can be switched off)."""
    from torch.distributed.fsdp import FSDPModule

    out, inner = [], set()
    for m in (model.modules() if model is not None else []):
        if isinstance(m, FSDPModule) and m not in inner:
            out.append(m)
            inner.update(x for x in m.modules() if x is not m)
    return out


class WholeWeights:
    """Whether ``model``'s FSDP groups are gathered (whole weights on every rank), switched by :meth:`gather` and
    :meth:`shard` (each a collective on every rank, a no-op when already so). While gathered, a forward or backward
    runs no collective (ranks may run different numbers of forwards: rollouts, scoring, callbacks' probes); the
    gradient reduce-scatter still runs, once per optimizer step. Calling it gives a context that gathers and, on exit,
    restores the state it found: :attr:`cope.models.policy.Policy.full_weights` under this strategy.

    :attr:`whole` is read off the groups themselves, never remembered: FSDP2 registers a group's parameters as plain
    tensors while it is gathered and as sharded DTensors otherwise, and more than this class reshards (a checkpoint's
    or an export's ``get_model_state_dict`` does). A remembered flag stayed "gathered" after a save, so the next
    :meth:`gather` did nothing and the next forward all-gathered layer by layer: a rank with no forward right after a
    save (an empty validation shard) left the others waiting in that all-gather.
    """

    def __init__(self, model: torch.nn.Module):
        from torch.distributed.fsdp import FSDPModule

        self.groups = [m for m in model.modules() if isinstance(m, FSDPModule)]
        self.roots = set(fsdp_roots(model))  # gathered from forward to backward's end when sharded (FSDP's root default)
        # per group, where one parameter it manages itself sits (not a nested group's): (module, name), read afresh at
        # each check, since FSDP2 registers another tensor object there when it gathers or reshards
        self._probe = {m: _own_parameter(m) for m in self.groups}

    def _gathered(self, group) -> bool:
        from torch.distributed.tensor import DTensor

        owner, name = self._probe[group]
        return not isinstance(getattr(owner, name), DTensor)

    @property
    def whole(self) -> bool:
        """Every group gathered now (read off the groups: see the class docstring)."""
        return all(self._gathered(m) for m in self.groups)

    def gather(self) -> None:
        if self.whole:
            return
        for m in self.groups:
            m.set_reshard_after_forward(False, recurse=False)
            m.set_reshard_after_backward(False, recurse=False)
            if not self._gathered(m):
                m.unshard()

    def shard(self) -> None:
        for m in self.groups:
            if self._gathered(m):
                m.reshard()
            m.set_reshard_after_forward(m not in self.roots, recurse=False)
            m.set_reshard_after_backward(True, recurse=False)

    @contextlib.contextmanager
    def __call__(self) -> Iterator[None]:
        was = self.whole
        self.gather()
        try:
            yield
        finally:
            if not was:
                self.shard()


def _own_parameter(group: torch.nn.Module) -> tuple[torch.nn.Module, str]:
    """(module, name) of a parameter ``group`` manages itself: under ``group`` but under no nested FSDP group."""
    from torch.distributed.fsdp import FSDPModule

    todo = [group]
    while todo:
        m = todo.pop(0)
        for name, _ in m.named_parameters(recurse=False):
            return m, name
        todo += [c for c in m.children() if not isinstance(c, FSDPModule)]
    raise ValueError(f"FSDP group {type(group).__name__} manages no parameter of its own")


class SwappedWeights:
    """Calling it gives a context in which ``other``'s groups are gathered and ``whole``'s sharded (one whole model
    per rank at a time), both restored on exit: the full fine-tuning reference's
    :attr:`cope.models.policy.Policy.reference_weights` under this strategy."""

    def __init__(self, whole: WholeWeights, other: WholeWeights):
        self.whole, self.other = whole, other

    @contextlib.contextmanager
    def __call__(self) -> Iterator[None]:
        was = self.whole.whole
        self.whole.shard()
        try:
            with self.other():
                yield
        finally:
            if was:
                self.whole.gather()


def whole_trainable_state(policy) -> dict[str, torch.Tensor] | None:
    """Under ``trainer=fsdp``: the policy model's trainable tensors whole, keyed as in ``policy.model.state_dict()``,
    on rank zero (empty elsewhere; a collective: every rank calls it), for an adapter export. None otherwise (the
    model's own tensors are whole)."""
    if not isinstance(getattr(policy, "full_weights", None), WholeWeights):
        return None
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    opts = StateDictOptions(full_state_dict=True, cpu_offload=True, ignore_frozen_params=True)
    trainable = {n for n, p in policy.model.named_parameters() if p.requires_grad}
    # (a tied head shares the embedding's parameter and comes back under its own name too: kept once, as
    # named_parameters and the DDP checkpoint name it; save_pretrained ties it again)
    return {k: v for k, v in get_model_state_dict(policy.model, options=opts).items() if k in trainable}


def total_grad_norm(grads: list[torch.Tensor]) -> torch.Tensor:
    """The global 2-norm of ``grads`` as a plain tensor: sharded (DTensor) gradients' shards are summed over the mesh
    (a collective: every rank calls it), plain gradients as they are (DDP: already all-reduced)."""
    if not grads:
        return torch.zeros(())
    norm = torch.nn.utils.get_total_norm(grads)
    return norm.full_tensor() if hasattr(norm, "full_tensor") else norm
