"""The classes a composed config names, resolved without building anything: what the config rules read.

``_target_`` strings go through Hydra's ``get_object``; a ``trainer.strategy`` string (``ddp``, ``fsdp``, ...)
through Lightning's ``StrategyRegistry``. The rules then ask the classes what they can do
(:mod:`cope.capabilities`), never their names (:mod:`cope.run.config_rules`).
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, Iterator

from hydra.utils import get_object
from omegaconf import DictConfig

DEFAULT_ENGINE = "cope.rollout.engine.HFEngine"  # the DataModule's engine when data.engine is not set


def resolve(target: Any) -> Any:
    """What a ``_target_`` string names (Hydra's ``get_object``), or None when it names nothing importable (the typed
    check reports that)."""
    try:
        return get_object(target) if isinstance(target, str) else None
    except Exception:
        return None


def engine_class(data: Any) -> Any:
    """The engine ``data.engine`` builds (its ``_target_``; the DataModule's default when unset)."""
    engine = (data or {}).get("engine")
    return resolve(engine.get("_target_") if isinstance(engine, DictConfig) else DEFAULT_ENGINE)


def strategy_class(trainer: Any) -> type | None:
    """The class ``trainer.strategy`` names: a block's ``_target_``, or a name in Lightning's ``StrategyRegistry``
    (``ddp``, ``fsdp``, ...). None: ``auto`` or unset (Lightning picks a single-device or DDP strategy), or a name
    Lightning does not know (the Trainer refuses it)."""
    strategy = (trainer or {}).get("strategy")
    if isinstance(strategy, DictConfig):
        return resolve(strategy.get("_target_"))
    if not isinstance(strategy, str):
        return None
    from lightning.pytorch.strategies import StrategyRegistry

    return StrategyRegistry[strategy]["strategy"] if strategy in StrategyRegistry else None


def argument_default(cls: Any, name: str, fallback: Any) -> Any:
    """The default of argument ``name`` of ``cls`` (its constructor; ``fallback`` when it has none): the value a block that
    does not set the key gets."""
    try:
        p = inspect.signature(cls).parameters.get(name)
    except (TypeError, ValueError):
        return fallback
    return fallback if p is None or p.default is inspect.Parameter.empty else p.default


@dataclass
class Resolved:
    """A composed config with the classes its rules read resolved once (nothing is built).

    Attributes:
        model, data: the blocks (empty when absent).
        engine, engine_target: what ``data.engine`` builds (:func:`engine_class`) and its ``_target_``.
        strategy, strategy_value: the class of ``trainer.strategy`` (:func:`strategy_class`) and its value as written.
        finetune: ``model.finetune``. lag: ``data.max_lag`` when >= 1, else 0.
        callbacks: ``(key, node, class)`` of each entry of ``callbacks`` and ``algo.callbacks`` (class None when its
            ``_target_`` names nothing importable).
    """

    cfg: DictConfig

    def __post_init__(self):
        cfg = self.cfg
        self.model, self.data = cfg.get("model") or {}, cfg.get("data") or {}
        self.engine, self.strategy = engine_class(self.data), strategy_class(cfg.get("trainer"))
        self.engine_target = str((self.data.get("engine") or {}).get("_target_", DEFAULT_ENGINE))
        strategy = (cfg.get("trainer") or {}).get("strategy")
        self.strategy_value = strategy.get("_target_") if isinstance(strategy, DictConfig) else strategy
        self.finetune = self.model.get("finetune", "lora")
        lag = self.data.get("max_lag", 0)
        self.lag = lag if isinstance(lag, int) and not isinstance(lag, bool) and lag >= 1 else 0
        sections = {"callbacks": cfg.get("callbacks"), "algo.callbacks": (cfg.get("algo") or {}).get("callbacks")}
        self.callbacks = [(f"{section}.{name}", node, resolve(node.get("_target_")))
                          for section, entries in sections.items() for name, node in (entries or {}).items()
                          if isinstance(node, DictConfig)]

    def entries(self, owner: str) -> Iterator[tuple[str, DictConfig, type]]:
        """The callback entries (``callbacks.*``, ``algo.callbacks.*``) whose class is, or derives from, ``owner`` (a
        ``module.Class`` path): each with its key, node and class."""
        base = resolve(owner)
        for key, node, cls in self.callbacks:
            if isinstance(cls, type) and isinstance(base, type) and issubclass(cls, base):
                yield key, node, cls
