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

**Checkpoints.** ``save_distributed_checkpoint=False``: the trainable tensors and the optimizer state are gathered
into one ordinary checkpoint file on rank zero, written through the trainer's ``CheckpointIO`` (the atomic one), with
the DDP checkpoint's layout except that the optimizer state is keyed by parameter name (torch's full optimizer state
dict), not by index. Resume reads that file on every rank and loads each rank's shard of it
(:meth:`FSDPStrategy.load_checkpoint`), exactly. A DDP checkpoint (optimizer state keyed by index) is refused with
the file and the fix. Not built yet: a torch distributed (sharded) checkpoint; untested: an FSDP checkpoint resumed
under DDP, or at another world size.

Mixed precision: fp32 on CPU (the tests); on CUDA, bf16 compute with fp32 gradient reduction
(``MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32)``), ``mixed_precision="auto"``; the CUDA
path has not run on a GPU yet.
"""
from __future__ import annotations

import contextlib
import logging
from typing import Any, Callable, Iterator

import torch
from lightning.pytorch.strategies import ModelParallelStrategy

from cope.run.checkpoint_io import optimizer_keying

log = logging.getLogger(__name__)

MIXED_PRECISION = ("auto", "bf16", "none")


def uses_fsdp(trainer) -> bool:
    """Whether a ``trainer`` config block runs :class:`FSDPStrategy` (``trainer=fsdp``)."""
    strategy = (trainer or {}).get("strategy")
    return hasattr(strategy, "get") and strategy.get("_target_") == f"{__name__}.FSDPStrategy"


def check_sharding(cfg, fail: Callable[[str, str], None]) -> None:
    """What ``trainer=fsdp`` cannot take, refused before any work (``fail(key, message)``; called by
    :func:`cope.run.config_rules.cross_field`): quantized weights, the vLLM engine, the merged export, the gradient
    probes. Nothing under any other strategy."""
    if not uses_fsdp(cfg.get("trainer")):
        return
    model, data = cfg.get("model") or {}, cfg.get("data") or {}
    quant = model.get("quantization")
    if quant is not None:
        fail("model.quantization", f" = {quant!r}: trainer=fsdp cannot shard quantized weights (bitsandbytes packs them "
             "into its own storage, which fully_shard cannot split or gather); use model.quantization=null (the bf16 "
             "weights are sharded instead, about 1/world of them per rank) or trainer=ddp for QLoRA")
    engine = str((data.get("engine") or {}).get("_target_", ""))
    if engine and not engine.endswith(".HFEngine"):
        fail("data.engine", f" = {engine}: trainer=fsdp rolls out in-process only (rollout=hf, on the gathered "
             "weights); a server engine would be handed an adapter written from shards. Use rollout=hf, or trainer=ddp")
    callbacks = cfg.get("callbacks") or {}
    if (callbacks.get("adapter_export") or {}).get("merged"):
        fail("callbacks.adapter_export.merged", " = true: trainer=fsdp does not write the merged model yet (the frozen "
             "base is sharded): set it to false and merge the exported adapter on one process (peft's merge_and_unload), or "
             "use trainer=ddp")
    if ((callbacks.get("grad_stats") or {}).get("every_n_steps") or 0) > 0:
        fail("callbacks.grad_stats.every_n_steps", ": the gradient probes are not built for trainer=fsdp (their extra "
             "backward would run on sharded weights outside the step); set it to 0, or use trainer=ddp")


class FSDPStrategy(ModelParallelStrategy):
    """``ModelParallelStrategy`` as data-parallel FSDP2 only: every process in one data-parallel (sharding) group,
    tensor parallelism 1 (the parent's ``"auto"`` would put a node's devices into tensor parallelism).

    Args:
        mixed_precision: ``auto`` (bf16 compute and fp32 gradient reduction on CUDA, fp32 elsewhere), ``bf16`` or
            ``none``.
        sync_every_microbatch: reduce-scatter gradients after every micro-batch (less memory: no unsharded gradient
            accumulates) instead of once per optimizer step, at the last micro-batch (fewer collectives).
        distributed_checkpoint: write checkpoints as torch distributed checkpoints, each rank its own shards
            (:mod:`cope.train.sharded_checkpoint`: nothing gathered; for full fine-tuning of large models) instead of
            one file gathered on rank zero. Either kind resumes, at any world size.
        **kwargs: the parent's (``timeout``, ``process_group_backend``).
    """

    def __init__(self, mixed_precision: str = "auto", sync_every_microbatch: bool = False,
                 distributed_checkpoint: bool = False, **kwargs: Any):
        if mixed_precision not in MIXED_PRECISION:
            raise ValueError(f"trainer.strategy.mixed_precision must be one of {MIXED_PRECISION}, got {mixed_precision!r}")
        super().__init__(data_parallel_size="auto", tensor_parallel_size=1, save_distributed_checkpoint=False, **kwargs)
        self.mixed_precision = mixed_precision
        self.sync_every_microbatch = bool(sync_every_microbatch)
        self.distributed_checkpoint = bool(distributed_checkpoint)

    def setup_environment(self) -> None:
        self._data_parallel_size = self.num_nodes * self.num_processes  # every rank shards; the mesh's other axis is 1
        super().setup_environment()

    def mp_policy(self):
        """FSDP's ``MixedPrecisionPolicy`` for this device, or None (fp32)."""
        from torch.distributed.fsdp import MixedPrecisionPolicy

        bf16 = self.mixed_precision == "bf16" or (self.mixed_precision == "auto" and self.root_device.type == "cuda")
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else None

    @contextlib.contextmanager
    def block_backward_sync(self) -> Iterator[None]:
        """Backward without FSDP's gradient reduce-scatter (micro-batches before the last one accumulate locally)."""
        roots = [] if self.sync_every_microbatch else _roots(self.lightning_module)
        for m in roots:
            m.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            for m in roots:
                m.set_requires_gradient_sync(True)

    def lightning_module_state_dict(self) -> dict[str, Any]:
        """The trainable tensors, whole, on rank zero (empty elsewhere); with ``distributed_checkpoint`` each rank's
        shards. The frozen base is never gathered."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        whole = not self.distributed_checkpoint
        opts = StateDictOptions(full_state_dict=whole, cpu_offload=whole, ignore_frozen_params=True)
        return get_model_state_dict(self.model, options=opts)

    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """The optimizer state keyed by parameter name: whole on rank zero (empty elsewhere), or with
        ``distributed_checkpoint`` each rank's shards."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        whole = not self.distributed_checkpoint
        return get_optimizer_state_dict(self.model, optimizer, options=StateDictOptions(full_state_dict=whole, cpu_offload=whole))

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath, storage_options: Any = None) -> None:
        """One file through the trainer's (atomic) ``CheckpointIO``, or with ``distributed_checkpoint`` a sharded folder
        (:func:`cope.train.sharded_checkpoint.save`: atomic too, every rank writing)."""
        if not self.distributed_checkpoint:
            return super().save_checkpoint(checkpoint, filepath, storage_options)
        from cope.train import sharded_checkpoint

        sharded_checkpoint.save(self, checkpoint, self.broadcast(filepath))

    def load_checkpoint(self, checkpoint_path, weights_only: bool | None = None) -> dict[str, Any]:
        """Reads the checkpoint on every rank and loads this rank's shards of its trainable tensors and optimizer state:
        from one file (the returned checkpoint keeps its ``state_dict``: the module's ``on_load_checkpoint`` checks
        it), or from a sharded folder (:func:`cope.train.sharded_checkpoint.load`), whichever the path holds."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict, set_optimizer_state_dict

        from cope.train import sharded_checkpoint

        path = self.broadcast(checkpoint_path)
        if sharded_checkpoint.complete_path(path).is_dir():
            return sharded_checkpoint.load(path, self.model, self.optimizers)
        checkpoint = self.checkpoint_io.load_checkpoint(path, weights_only=weights_only)
        if optimizer_keying(checkpoint) == "index":  # train.py refuses this before the build; a direct Trainer user here
            raise ValueError(f"ckpt_path={path}: written under trainer=ddp (its optimizer state is keyed by index); "
                             "trainer=fsdp resumes its own checkpoints only (keyed by parameter name): resume it "
                             "with trainer=ddp")
        opts = StateDictOptions(full_state_dict=True, strict=False)
        set_model_state_dict(self.model, checkpoint["state_dict"], options=opts)
        for opt, state in zip(self.optimizers, checkpoint.get("optimizer_states", [])):
            set_optimizer_state_dict(self.model, opt, optim_state_dict=state, options=StateDictOptions(full_state_dict=True))
        return checkpoint


def configure_sharding(module) -> WholeWeights | None:
    """What ``AgentRLModule.configure_model`` does: under :class:`FSDPStrategy`, shard ``module.model``
    (:func:`shard_policy`) and set the policy's ``full_weights``; returns the :class:`WholeWeights` switch (None under
    any other strategy: nothing happens)."""
    strategy = module.trainer.strategy
    if not isinstance(strategy, ModelParallelStrategy):
        return None
    if not isinstance(strategy, FSDPStrategy):
        raise TypeError(f"{type(strategy).__name__}: the policy is sharded by cope.train.sharding.FSDPStrategy "
                        "(trainer=fsdp) only")
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


def step_weights(module, batch: dict):
    """The context of one optimizer step's forwards and backwards on ``batch`` under :class:`FSDPStrategy`: sharded
    (per-layer all-gathers) when every rank cuts its batch into as many micro-batches, else gathered (no collective
    per forward, which ranks with different micro-batch counts could not match). Other strategies: a null context.
    One small collective under FSDP when a token budget is set."""
    whole = getattr(module.policy, "full_weights", None)
    if not isinstance(whole, WholeWeights) or module.max_tokens_per_microbatch is None:
        return contextlib.nullcontext()  # one forward per step on every rank
    n_parts = len(module.micro_batches(batch))
    n = torch.tensor([n_parts, -n_parts], dtype=torch.float64, device=module.device)
    n = module.trainer.strategy.reduce(n, reduce_op="max")
    return whole() if int(n[0]) != -int(n[1]) else contextlib.nullcontext()


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


def _roots(model: torch.nn.Module | None) -> list:
    """The outermost FSDP modules under ``model``."""
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
    restores the state it found: :attr:`cope.models.policy.Policy.full_weights` under this strategy."""

    def __init__(self, model: torch.nn.Module):
        from torch.distributed.fsdp import FSDPModule

        self.groups = [m for m in model.modules() if isinstance(m, FSDPModule)]
        self.roots = set(_roots(model))  # gathered from forward to backward's end when sharded (FSDP's root default)
        self.whole = False

    def gather(self) -> None:
        if self.whole:
            return
        for m in self.groups:
            m.set_reshard_after_forward(False, recurse=False)
            m.set_reshard_after_backward(False, recurse=False)
            m.unshard()
        self.whole = True

    def shard(self) -> None:
        if not self.whole:
            return
        for m in self.groups:
            m.reshard()
            m.set_reshard_after_forward(m not in self.roots, recurse=False)
            m.set_reshard_after_backward(True, recurse=False)
        self.whole = False

    @contextlib.contextmanager
    def __call__(self) -> Iterator[None]:
        was = self.whole
        self.gather()
        try:
            yield
        finally:
            if not was:
                self.shard()


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
