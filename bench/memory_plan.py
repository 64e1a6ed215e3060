"""Per-rank GPU memory and host RAM of a composed run config, term by term (:mod:`cope.train.fsdp.memory`).

    python -m bench.memory_plan experiment=cope_authors_alfworld
    python -m bench.memory_plan experiment=alfworld model=qwen2.5-14b trainer=gpu

Arithmetic, not a measurement: the terms are what the code holds (docs/sharding.md, "Memory per rank"); a GPU run's
measured peaks check them (docs/gpu.md). Upper bounds where the run's data decides: every episode of a step as long
as ``data.max_context`` (the step's tokens, hence its micro-batches) and every live episode at ``data.max_context``
tokens (the KV cache). The model's shape comes from :data:`cope.train.fsdp.memory.SHAPES` by ``model.path``.
"""
from __future__ import annotations

import sys

from omegaconf import DictConfig

from cope.capabilities import can
from cope.run.config_classes import strategy_class
from cope.train.fsdp.memory import GIB, SHAPES, MemoryPlan

CARD_GIB = {"H100": 78.0, "H200": 139.0}  # what the device tool reports usable on each card
OVERHEAD_GIB = 2.0  # CUDA's context and the allocator's fragmentation, on top of the terms


def fits(plan: MemoryPlan, card: str) -> bool:
    """The plan's peak plus :data:`OVERHEAD_GIB` within the card's usable memory."""
    return plan.peak() / GIB + OVERHEAD_GIB <= CARD_GIB[card]


def plan_from_config(cfg: DictConfig) -> MemoryPlan:
    """The :class:`MemoryPlan` of one rank of ``cfg`` (a composed run config)."""
    model, data, trainer, module = cfg.model, cfg.data, cfg.trainer, cfg.module
    path = model.get("path")
    if path not in SHAPES:
        raise ValueError(f"model.path={path!r}: no shape known for it (cope.train.fsdp.memory.SHAPES has "
                         f"{sorted(SHAPES)})")
    devices = trainer.get("devices", 1)
    world = (devices if isinstance(devices, int) else 1) * int(trainer.get("num_nodes", 1) or 1)
    node = trainer.get("strategy")
    shards = can(strategy_class(trainer), "shards_weights")
    kl = ((cfg.algo.get("objectives") or {}).get("kl") or {}).get("weight", 0) != 0
    dtype = model.get("dtype", "bf16")
    return MemoryPlan(
        shape=SHAPES[path], finetune=model.get("finetune", "lora"), world=world if shards else 1,
        lora_rank=int((model.get("lora") or {}).get("r", 16)),
        base_bytes={"bf16": 2.0, "fp16": 2.0, "fp32": 4.0}.get(dtype, 2.0) if model.get("quantization") is None else 0.5,
        kl=kl, bf16_compute=True, microbatch_tokens=module.get("max_tokens_per_microbatch"),
        step_tokens=int(data.minibatch_size) * int(data.max_context),
        sync_every_microbatch=bool(node.get("sync_every_microbatch", False)) if isinstance(node, DictConfig) else False,
        foreach=(module.get("optimizer") or {}).get("foreach", True) is not False,
        live_tokens=_live_episodes(data) * int(data.max_context),
        ranks_per_node=devices if isinstance(devices, int) else 1, held_versions=int(data.get("max_lag", 0)))


def _live_episodes(data: DictConfig) -> int:
    """Episodes generating at once: the epoch's (tasks x group), or ``data.env_runtime.max_live_episodes`` (waves)."""
    episodes = int(data.tasks_per_epoch) * int(data.group_size)
    cap = (data.get("env_runtime") or {}).get("max_live_episodes")
    return min(episodes, int(cap)) if cap else episodes


def main(argv: list[str] | None = None) -> MemoryPlan:
    from hydra import compose

    overrides = list(sys.argv[1:] if argv is None else argv)
    with _conf():
        cfg = compose("config", overrides=[*overrides, "paths.output_dir=/tmp/cope-memory-plan"])
    plan = plan_from_config(cfg)
    print(" ".join(overrides) or "(defaults)")
    print(plan.table())
    for card, usable in CARD_GIB.items():
        print(f"fits one {card} ({usable:.0f} GiB usable, {OVERHEAD_GIB:.0f} GiB kept for CUDA's context and "
              f"fragmentation): {'yes' if fits(plan, card) else 'NO'}")
    return plan


def _conf():
    from pathlib import Path

    from hydra import initialize_config_dir

    return initialize_config_dir(config_dir=str(Path(__file__).resolve().parents[1] / "conf"), version_base=None)


if __name__ == "__main__":
    main()
