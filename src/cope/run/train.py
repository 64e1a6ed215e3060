"""Compose-instantiate-fit: what ``train.py`` runs (kept in the package so tests and tools can call it).

Every component is instantiated from config *before* the model is built, so a bad key or value
fails in seconds with its name, not after minutes of model loading.
"""
from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

from hydra.utils import instantiate
from omegaconf import DictConfig

from cope.capabilities import can
from cope.models.source import base_model_of
from cope.run.checkpoint_io import LAST, check_checkpoint_file, check_free_space, check_resume_matches
from cope.run.config_check import check_config
from cope.run.config_classes import strategy_class
from cope.run.config_keys import name_sources
from cope.run.context_limits import check_context_floor
from cope.run.preemption import SigtermGuard

log = logging.getLogger(__name__)
# What train() reads of the config besides component arguments and interpolations is declared in
# cope.run.config_keys.TRAIN_READS (the config check refuses every other key); keep it in step with the code below.


def instantiate_plain(node: Any, **kwargs: Any) -> Any:
    """``hydra.utils.instantiate`` with every config container turned into a plain ``dict``/``list``
    before it reaches a constructor (``_convert_="all"``): library classes (peft's ``LoraConfig``,
    Lightning, torch) then hold nothing OmegaConf-typed that they would fail to serialize later."""
    return instantiate(node, _convert_="all", **kwargs)


def build(node: DictConfig, key: str, **kwargs: Any) -> Any:
    """:func:`instantiate_plain` of the block at ``key``; a constructor's error about an argument whose value follows
    another key by interpolation names that key, the one the user set (``cope.layout``, not
    ``callbacks.probes.layout``)."""
    try:
        return instantiate_plain(node, **kwargs)
    except Exception as e:
        named = name_sources(str(e), node, key)
        if named == str(e):
            raise
        raise ValueError(f"could not build {key}: {named}") from e


def instantiate_named(section: DictConfig | None, what: str) -> list[Any]:
    """Each non-null entry of a named config section (``algo.objectives``, ``callbacks``), built; an entry that
    fails to build is named by its full key (``what.name``)."""
    out = []
    for name, node in (section or {}).items():
        if node is None:
            continue
        try:
            out.append(build(node, f"{what}.{name}"))
        except Exception as e:
            if str(e).startswith("could not build "):  # build named the key already
                raise
            raise ValueError(f"could not build {what}.{name}: {e}") from e
    return out


def resolve_ckpt_path(ckpt_path: str | None, checkpoint_dir: Path) -> str | None:
    """``ckpt_path`` as the fit gets it: ``None`` (fresh start), ``last`` (``<checkpoint_dir>/last.ckpt``, which
    must exist), ``auto`` (that file if it exists, else a fresh start) or a file path (must exist).

    The file is checked for damage here, before any model is built."""
    if ckpt_path is None:
        return None
    from cope.train.fsdp.checkpoint import complete_path

    last = complete_path(checkpoint_dir / LAST)  # a sharded save killed between its two renames left <last>.old
    if ckpt_path in ("last", "auto"):
        if not last.exists():
            if ckpt_path == "auto":
                log.info("ckpt_path=auto: no checkpoint at %s, starting a new run", last)
                return None
            raise FileNotFoundError(f"ckpt_path=last: there is no checkpoint at {last} (nothing to resume; use the same "
                                    "hydra.run.dir as the run to resume, ckpt_path=auto to resume only if one exists, "
                                    "or drop ckpt_path to start a new run)")
        path = last
    else:
        path = complete_path(ckpt_path)
        if not path.exists():
            raise FileNotFoundError(f"ckpt_path={ckpt_path!r}: no such checkpoint file (or sharded checkpoint folder)")
    check_checkpoint_file(path)
    return str(path)


def _lora_rank(model: DictConfig) -> int | None:
    """``model.lora.r`` where it is every adapter's rank (not with a per-module ``rank_pattern``)."""
    lora = model.get("lora") or {}
    return None if lora.get("rank_pattern") else lora.get("r")


def train(cfg: DictConfig) -> dict[str, float]:
    """Run one training job from a composed config; returns the final metrics."""
    check_config(cfg)  # every key typed against its `_target_`, before any seeding, instantiation or model load
    import lightning.pytorch as pl
    from lightning.pytorch.utilities.exceptions import SIGTERMException

    t_start = time.perf_counter()
    output_dir = Path(cfg.paths.output_dir)
    ckpt_dir = Path(cfg.callbacks.checkpoint.dirpath) if cfg.get("callbacks") and cfg.callbacks.get("checkpoint") \
        else output_dir / "checkpoints"
    ckpt_path = resolve_ckpt_path(cfg.ckpt_path, ckpt_dir)
    pl.seed_everything(cfg.seed, workers=True)
    env_factory = build(cfg.env, "env")
    check_context_floor(env_factory, cfg.data)  # the rules must fit data.max_context: known before the model build
    model_factory = build(cfg.model, "model")  # a partial: nothing is loaded yet
    if ckpt_path is not None:  # the checkpoint's base model and LoRA rank against this config's, before the build
        check_resume_matches(ckpt_path, base_model_of(model_factory, env_factory), _lora_rank(cfg.model),
                             sharded=can(strategy_class(cfg.trainer), "shards_weights"),
                             finetune=cfg.model.get("finetune", "lora"))
    if cfg.model.get("adapter"):  # the adapter to start from against this config's base and rank, before the build
        from cope.models.policy import check_adapter

        base = base_model_of(model_factory, env_factory)
        check_adapter(cfg.model.adapter, base.source if base else "", model_factory.keywords.get("lora"),
                      bool(base and base.keyed))
    datamodule = build(cfg.data, "data", env=env_factory)
    objectives = instantiate_named(cfg.algo.objectives, "algo.objectives")
    callbacks = instantiate_named(cfg.callbacks, "callbacks") + instantiate_named(cfg.algo.get("callbacks"), "algo.callbacks")
    logger = instantiate_plain(cfg.logger) if cfg.get("logger") else False
    trainer = build(cfg.trainer, "trainer", callbacks=callbacks, logger=logger)
    policy = model_factory(env_factory=env_factory)
    datamodule.connect(policy, rank=trainer.global_rank)
    module = instantiate_plain(cfg.module, _partial_=True)(policy=policy, objectives=objectives)  # no config conversion of objects
    if trainer.is_global_zero:
        check_free_space(output_dir, policy)
    before: dict[str, float] = {}
    status = "failed"
    guard = SigtermGuard()  # a SIGTERM from here on ends the run as interrupted (exit 143), in any stage
    try:
        with guard:
            if cfg.validate_before_fit and ckpt_path is None:
                before = {k: float(v) for k, v in trainer.validate(module, datamodule=datamodule, verbose=False)[0].items()}
            fitted = False
            if not guard.received:  # a SIGTERM during the pre-fit validation: do not start training
                trainer.fit(module, datamodule=datamodule, ckpt_path=ckpt_path)
                fitted = True  # fit returned: it trained its last epoch (a SIGTERM after that changes nothing)
        status = "ok" if fitted else "interrupted"
    except SIGTERMException:
        status = "interrupted"
    finally:
        for lg in trainer.loggers:
            if hasattr(lg, "experiment") and type(lg).__name__ == "WandbLogger":
                lg.experiment.finish()
        result = _result(before, trainer, datamodule, module, t_start)
        if trainer.is_global_zero:
            _summary(result, trainer, status)
    if status == "interrupted":
        raise guard.stop(trainer.current_epoch, ckpt_dir / LAST)
    return result


def _result(before: dict, trainer, datamodule, module, t_start: float) -> dict[str, float]:
    after = {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith(("rollout/", "perf/"))}
    after.update(module.last_validation)  # the newest validation during fit, with the epoch it ran after
    result = {**{f"start/{k}": v for k, v in before.items()}, **after, "wall_seconds": time.perf_counter() - t_start}
    result.update({f"counters/{k}": float(v) for k, v in datamodule.counters.items()})
    return result


_STATUS_TITLE = {"ok": "", "failed": " (the run FAILED: see the error below)",
                 "interrupted": " (INTERRUPTED by SIGTERM: resume with ckpt_path=auto)"}


def _summary(r: dict[str, float], trainer, status: str = "ok") -> None:
    lines = ["", f"=== cope-trainer run summary{_STATUS_TITLE[status]} ==="]
    if "val/success" in r or "start/val/success" in r:
        start = f"{r['start/val/success']:.3f} at start -> " if "start/val/success" in r else ""
        end = (f"{r['val/success']:.3f} after epoch {int(r['val/epoch'])}" if "val/success" in r and "val/epoch" in r
               else "not validated since")
        lines.append(f"held-out success: {start}{end}")
    lines.append(f"episodes {int(r.get('counters/episodes', 0))}, env steps {int(r.get('counters/env_steps', 0))}, "
                 f"epochs {trainer.current_epoch}, wall {r['wall_seconds']:.0f}s")
    if "perf/tokens_per_s" in r:
        lines.append(f"rollout generation {r['perf/tokens_per_s']:.0f} tokens/s")
    lines.append(f"outputs in {trainer.default_root_dir}")
    print("\n".join(lines), flush=True)
