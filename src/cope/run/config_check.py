"""A typed check of the composed run config, run before anything is seeded, instantiated or loaded.

Every component block mirrors its constructor (``_target_``), so the constructor's signature *is* the
schema. This pass walks the whole composed config (data, module with its optimizer and scheduler
partials, model with ``lora``, env, trainer, logger, ``callbacks.*``, ``algo.objectives.*``,
``algo.callbacks.*``, any ``_target_`` nested deeper), resolves each ``_target_``
(``hydra.utils.get_object``), reads ``inspect.signature`` and the type hints, and checks that every
key is a parameter (with ``**kwargs``: keys a base class declares are typed, others pass) and every
value, interpolations resolved, fits its annotation (ints are valid floats; bools are not numbers).
The plain root keys get a small schema, :class:`RunKeys`; knobs that only feed component blocks
through interpolation (``cope.*``, ``algo.advantage_mode``) are typed where they land, and the message
names the key the user set (``cope.weight = 'x': expected float (read as algo.objectives.forecast.weight ...)``).
A key nothing reads is refused (:mod:`cope.run.config_keys`). All problems go into one :class:`ConfigError`, one line
per full dotted key with its value and the expected type.

Why not Hydra structured configs: they need a dataclass per component that repeats (and drifts from)
each constructor, third-party ones included (Trainer, LoraConfig, AdamW); the signatures are one source
of truth and cover whatever ``_target_`` names. What types cannot say has one place each:

* value ranges of our own classes: their constructors (run next, still before the model build);
* value ranges third-party classes check late or with a bare assert, and those of classes built after the
  model (the LightningModule): :data:`RANGES`;
* rules between keys (``data.max_context`` against the model's positions, a GPU trainer on a machine without one,
  attention against CoPE's packed rows) and no-op settings (logged warnings): :mod:`cope.run.config_rules`.

Arguments ``cope.run.train.train`` passes when it builds a block (:data:`PASSED_AT_BUILD`) are not config
keys. Torch-free itself; importing the target classes is its only cost (no model build).
"""
from __future__ import annotations

import dataclasses
import difflib
import inspect
import logging
from typing import Any, Callable, Optional

from hydra.utils import get_object
from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import MissingMandatoryValue, OmegaConfBaseException

from cope.run.config_keys import TRAIN_READS, ConfigError, Reads, renamed, source_key, unread_keys
from cope.run.config_rules import cross_field
from cope.run.signatures import BUILT, UNSET, base_annotation, conforms, parameters, qualname, type_name

log = logging.getLogger(__name__)

HYDRA_KEYS = frozenset({"_target_", "_partial_", "_recursive_", "_convert_", "_args_"})
# what cope.run.train.train passes when it instantiates a root block (not config keys)
PASSED_AT_BUILD = {"data": ("env",), "trainer": ("callbacks", "logger"), "module": ("policy", "objectives"),
                   "model": ("env_factory",)}
# value rules types cannot express, for classes (and their subclasses) that check them late or with a bare
# assert; keyed by "module.QualName" of the class as defined
RANGES: dict[str, dict[str, tuple[Callable[[Any], bool], str]]] = {
    "lightning.pytorch.trainer.trainer.Trainer": {
        "max_epochs": (lambda v: v == -1 or v >= 1, "-1 (no limit) or >= 1"),
        "min_epochs": (lambda v: v >= 0, ">= 0"),
        "max_steps": (lambda v: v == -1 or v >= 1, "-1 (no limit) or >= 1"),
        "check_val_every_n_epoch": (lambda v: v >= 1, ">= 1 or null"),
        "log_every_n_steps": (lambda v: v >= 1, ">= 1"),
        "accumulate_grad_batches": (lambda v: v == 1, "1 (the module accumulates micro-batches itself: "
                                                      "module.max_tokens_per_microbatch)"),
        "reload_dataloaders_every_n_epochs": (lambda v: v == 1, "1 (every epoch collects fresh on-policy rollouts)"),
        "num_sanity_val_steps": (lambda v: v >= -1, ">= -1"),
        "gradient_clip_val": (lambda v: False, "null (the module clips: module.gradient_clip_val)"),
    },
    # `_partial_` optimizers are finished in configure_optimizers, after the model load (torch checks there)
    "torch.optim.optimizer.Optimizer": {
        "lr": (lambda v: v >= 0, ">= 0"),
        "weight_decay": (lambda v: v >= 0, ">= 0"),
        "eps": (lambda v: v >= 0, ">= 0"),
    },
    # the adapter config is only read by get_peft_model, at the end of the model load
    "peft.tuners.lora.config.LoraConfig": {
        "r": (lambda v: v >= 1, ">= 1 (the LoRA rank)"),
        "lora_dropout": (lambda v: 0 <= v < 1, "in [0, 1) (1 drops every adapter input)"),
    },
    # its constructor checks it too; here the rules between keys (cope.run.config_rules) read only valid lags
    "cope.train.datamodule.RolloutDataModule": {
        "max_lag": (lambda v: v >= 0, ">= 0 (0: collect, then train)"),
    },
    # built after the policy (it wraps it): its own checks would come after the model load
    "cope.train.module.AgentRLModule": {
        "max_tokens_per_microbatch": (lambda v: v >= 1, "null or >= 1"),
        "gradient_clip_val": (lambda v: v > 0, "null or > 0"),
        "max_approx_kl": (lambda v: v > 0, "null or > 0"),
        "temperature": (lambda v: v >= 0, ">= 0"),
    },
}


@dataclasses.dataclass
class RunKeys:
    """The plain root keys of ``conf/config.yaml`` (component blocks are typed by their ``_target_``)."""

    seed: int
    paths: dict[str, str]
    ckpt_path: Optional[str] = None  # null, `last`, `auto` or a checkpoint file (meaning: cope.run.train)
    validate_before_fit: bool = True


def check_config(cfg: DictConfig, reads: Reads | None = None) -> None:
    """Check the composed run config; raise :class:`ConfigError` listing every bad key, log no-op warnings.

    Args:
        cfg: the composed config.
        reads: what the run code reads besides component arguments and interpolations (default: what
            ``cope.run.train.train`` reads, :data:`cope.run.config_keys.TRAIN_READS`); every other key is refused.
    """
    reads = TRAIN_READS if reads is None else reads
    c = _Checker()
    c.call(cfg, "", RunKeys, open_keys=True)
    c.errors += [p for p in unread_keys(cfg, reads) if p.split(" ")[0] not in c.bad]
    if not c.errors:
        cross_field(cfg, c.fail, c.warnings)
    if c.errors:
        raise ConfigError(c.errors)
    for w in c.warnings:
        log.warning(w)


class _Checker:
    def __init__(self):
        self.errors: list[str] = []
        self.warnings: list[str] = []
        self.bad: set[str] = set()  # keys reported: values interpolated from them are not reported again

    def fail(self, key: str, msg: str) -> None:
        self.errors.append(f"{key}{msg}")
        self.bad.add(key)

    # -- walking ------------------------------------------------------------------------------------
    def get(self, parent, name, key: str) -> Any:
        try:
            return parent[name]
        except MissingMandatoryValue:
            self.fail(key, ": no value given (???)")
        except OmegaConfBaseException as e:
            self.fail(key, f": {type(e).__name__}: {str(e).splitlines()[0]}")
        return UNSET

    def target(self, node: DictConfig, key: str) -> None:
        path = node.get("_target_")
        try:
            fn = get_object(path)
        except Exception as e:
            why = " ".join(str(e).split())
            self.fail(f"{key}._target_", f" = {path!r}: cannot be imported ({type(e).__name__}: {why})")
            return
        self.call(node, key, fn, open_keys=False)

    def call(self, node: DictConfig, key: str, fn: Any, open_keys: bool) -> None:
        """``node``'s keys against the parameters of ``fn`` (a callable, or a dataclass schema).

        ``open_keys``: keys ``fn`` does not name are walked, not rejected (the root schema)."""
        params, var_kw = parameters(fn)
        where = "the root schema cope.run.config_check.RunKeys" if fn is RunKeys else qualname(fn)
        names = list(node.keys())
        if open_keys:  # the schema's own keys first: blocks interpolate them (${seed}), and a bad source is named once
            names.sort(key=lambda n: n not in params)
        for name in names:
            if name in HYDRA_KEYS:
                continue
            full = f"{key}.{name}" if key else str(name)
            if name in PASSED_AT_BUILD.get(key, ()):
                self.fail(full, f": set by cope.run.train.train when it builds `{key}`; not a config key")
            elif name in params:
                self.value(node, name, full, params[name].annotation, where)
            elif var_kw is not None:
                ann = base_annotation(fn, name)  # **kwargs: typed where a base class declares the key
                if ann is None:
                    self.plain(self.get(node, name, full), full)
                else:
                    self.value(node, name, full, ann, where)
            elif open_keys:
                self.plain(self.get(node, name, full), full)
            else:
                close = difflib.get_close_matches(str(name), list(params), n=1, cutoff=0.75)
                hint = f"; did you mean {key}.{close[0]}?" if close else ""
                self.fail(full, renamed(full) or f": not an argument of {where} (it takes: {', '.join(params) or 'nothing'}){hint}")
        if not node.get("_partial_", False):
            for name, p in params.items():
                if p.default is inspect.Parameter.empty and name not in node and name not in PASSED_AT_BUILD.get(key, ()):
                    self.fail(f"{key}.{name}" if key else name, f": missing (required by {where})")
        self.ranges(node, key, fn)

    def value(self, parent: DictConfig, name, key: str, ann: Any, where: str) -> None:
        v = self.plain(self.get(parent, name, key), key)  # a nested component (lora, optimizer) is checked here
        origin, src = "", None
        if OmegaConf.is_interpolation(parent, name):
            raw = str(parent._get_node(name)._value())
            src = source_key(raw)
            if src in self.bad:
                return  # its source is already reported
            if src is None or OmegaConf.select(parent._get_root(), src, throw_on_resolution_failure=False) is None:
                src, origin = None, f" (from {raw})"  # not one key the user set (a default of oc.select, a formula)
        if v is not UNSET and not conforms(v, ann):
            if src is not None:  # the key the user set, once for all the blocks that read it
                self.fail(src, f" = {v!r}: expected {type_name(ann)} (read as {key} by {where})")
            else:
                self.fail(key, f" = {v!r}{origin}: expected {type_name(ann)} ({where})")

    def plain(self, v: Any, key: str) -> Any:
        """``v`` as plain data; each component block in it is checked and stands as :data:`BUILT`."""
        if isinstance(v, DictConfig):
            if "_target_" in v:
                self.target(v, key)
                return BUILT
            return {k: self.plain(self.get(v, k, f"{key}.{k}"), f"{key}.{k}") for k in v.keys()}
        if isinstance(v, ListConfig):
            return [self.plain(self.get(v, i, f"{key}[{i}]"), f"{key}[{i}]") for i in range(len(v))]
        return v

    def ranges(self, node: DictConfig, key: str, fn: Any) -> None:
        for cls in (fn.__mro__ if inspect.isclass(fn) else ()):
            for name, (ok, rule) in RANGES.get(f"{cls.__module__}.{cls.__qualname__}", {}).items():
                v = node.get(name) if f"{key}.{name}" not in self.bad else None
                if isinstance(v, (int, float)) and not isinstance(v, bool) and not ok(v):
                    origin = f" (from {node._get_node(name)._value()})" if OmegaConf.is_interpolation(node, name) else ""
                    self.fail(f"{key}.{name}", f" = {v!r}{origin}: must be {rule} ({qualname(cls)})")
