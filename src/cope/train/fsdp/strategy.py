"""``trainer=fsdp``'s strategy: Lightning's ``ModelParallelStrategy`` as data-parallel FSDP2 only. How the policy is
sharded and when its weights are whole: :mod:`cope.train.fsdp.sharding`; sharded checkpoints:
:mod:`cope.train.fsdp.checkpoint`. What cannot run under it is refused by the config rules
(:data:`cope.run.config_rules.RULES`), which read its capabilities (:mod:`cope.capabilities`), never its name.
"""
from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch
from lightning.pytorch.strategies import ModelParallelStrategy

from cope.train.fsdp.checkpoint import optimizer_keying
from cope.train.fsdp.sharding import fsdp_roots

MIXED_PRECISION = ("auto", "bf16", "none")


class FSDPStrategy(ModelParallelStrategy):
    """``ModelParallelStrategy`` as data-parallel FSDP2 only: every process in one data-parallel (sharding) group,
    tensor parallelism 1 (the parent's ``"auto"`` would put a node's devices into tensor parallelism).

    Args:
        mixed_precision: ``auto`` (bf16 compute and fp32 gradient reduction on CUDA, fp32 elsewhere), ``bf16`` or
            ``none``.
        sync_every_microbatch: reduce-scatter gradients after every micro-batch (less memory: no unsharded gradient
            accumulates) instead of once per optimizer step, at the last micro-batch (fewer collectives).
        distributed_checkpoint: write checkpoints as torch distributed checkpoints, each rank its own shards
            (:mod:`cope.train.fsdp.checkpoint`: nothing gathered; for full fine-tuning of large models) instead of
            one file gathered on rank zero. Either kind resumes, at any world size.
        **kwargs: the parent's (``timeout``, ``process_group_backend``).
    """

    shards_weights = True  # cope.capabilities: each rank holds 1/world of every sharded parameter
    gathers_for_rollouts = True  # whole weights outside the optimizer steps (cope.train.fsdp.sharding.WholeWeights)

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
        """Backward without FSDP's gradient reduce-scatter (micro-batches before the last one accumulate locally);
        with ``sync_every_microbatch`` a no-op (every micro-batch reduce-scatters: in a step whose ranks cut different
        numbers, the ranks with fewer pad theirs, :func:`cope.train.fsdp.sharding.step_weights`)."""
        roots = [] if self.sync_every_microbatch else fsdp_roots(self.lightning_module)
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
        (:func:`cope.train.fsdp.checkpoint.save`: atomic too, every rank writing)."""
        if not self.distributed_checkpoint:
            return super().save_checkpoint(checkpoint, filepath, storage_options)
        from cope.train.fsdp import checkpoint as sharded_checkpoint

        sharded_checkpoint.save(self, checkpoint, self.broadcast(filepath))

    def load_checkpoint(self, checkpoint_path, weights_only: bool | None = None) -> dict[str, Any]:
        """Reads the checkpoint on every rank and loads this rank's shards of its trainable tensors and optimizer state:
        from one file (the returned checkpoint keeps its ``state_dict``: the module's ``on_load_checkpoint`` checks
        it), or from a sharded folder (:func:`cope.train.fsdp.checkpoint.load`), whichever the path holds."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict, set_optimizer_state_dict

        from cope.train.fsdp import checkpoint as sharded_checkpoint

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
