"""``trainer=fsdp``'s strategy: Lightning's ``ModelParallelStrategy`` as data-parallel FSDP2 only, with the config
rules of what cannot be sharded. How the policy is sharded and when its weights are whole: :mod:`cope.train.sharding`;
sharded checkpoints: :mod:`cope.train.sharded_checkpoint`.
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

import torch
from lightning.pytorch.strategies import ModelParallelStrategy

from cope.run.checkpoint_io import optimizer_keying
from cope.train.sharding import _roots

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
