"""Compose-instantiate-fit: what ``train.py`` runs (kept in the package so tests and tools can call it).

Every component is instantiated from config *before* the model is built, so a bad key or value
fails in seconds with its name, not after minutes of model loading.
"""
from __future__ import annotations

import logging
import time
from typing import Any

from hydra.utils import instantiate
from omegaconf import DictConfig

from cope.config_check import check_config

log = logging.getLogger(__name__)


def _instantiate_named(section: DictConfig | None, what: str) -> list[Any]:
    out = []
    for name, node in (section or {}).items():
        if node is None:
            continue
        try:
            out.append(instantiate(node))
        except Exception as e:
            raise ValueError(f"could not build {what}.{name}: {e}") from e
    return out


def train(cfg: DictConfig) -> dict[str, float]:
    """Run one training job from a composed config; returns the final metrics."""
    check_config(cfg)  # every key typed against its `_target_`, before any seeding, instantiation or model load
    import lightning.pytorch as pl

    t_start = time.perf_counter()
    pl.seed_everything(cfg.seed, workers=True)
    env_factory = instantiate(cfg.env)
    datamodule = instantiate(cfg.data, env=env_factory)
    objectives = _instantiate_named(cfg.algo.objectives, "algo.objectives")
    callbacks = _instantiate_named(cfg.callbacks, "callbacks") + _instantiate_named(cfg.algo.get("callbacks"), "algo.callbacks")
    logger = instantiate(cfg.logger) if cfg.get("logger") else False
    trainer = instantiate(cfg.trainer, callbacks=callbacks, logger=logger)
    policy = instantiate(cfg.model)(env_factory=env_factory)
    datamodule.connect(policy.tokenizer, policy.chat)
    module = instantiate(cfg.module, _partial_=True)(policy=policy, objectives=objectives)  # no config conversion of objects
    before: dict[str, float] = {}
    try:
        if cfg.validate_before_fit and cfg.ckpt_path is None:
            before = {k: float(v) for k, v in trainer.validate(module, datamodule=datamodule, verbose=False)[0].items()}
        trainer.fit(module, datamodule=datamodule, ckpt_path=cfg.ckpt_path)
    finally:
        for lg in trainer.loggers:
            if hasattr(lg, "experiment") and type(lg).__name__ == "WandbLogger":
                lg.experiment.finish()
    after = {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith(("val/", "rollout/", "perf/"))}
    result = {**{f"start/{k}": v for k, v in before.items()}, **after, "wall_seconds": time.perf_counter() - t_start}
    result.update({f"counters/{k}": float(v) for k, v in datamodule.counters.items()})
    if trainer.is_global_zero:
        _summary(result, trainer)
    return result


def _summary(r: dict[str, float], trainer) -> None:
    lines = ["", "=== cope-trainer run summary ==="]
    if "start/val/success" in r:
        lines.append(f"held-out success: {r['start/val/success']:.3f} at start -> {r.get('val/success', float('nan')):.3f} at end")
    lines.append(f"episodes {int(r.get('counters/episodes', 0))}, env steps {int(r.get('counters/env_steps', 0))}, "
                 f"epochs {trainer.current_epoch}, wall {r['wall_seconds']:.0f}s")
    if "perf/tokens_per_s" in r:
        lines.append(f"rollout generation {r['perf/tokens_per_s']:.0f} tokens/s")
    lines.append(f"outputs in {trainer.default_root_dir}")
    print("\n".join(lines), flush=True)


