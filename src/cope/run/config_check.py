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
* cross-field: ``data.max_context`` must fit the model's positions (``model.max_context`` of the tiny
  model, else ``max_position_embeddings`` of ``<model.path>/config.json`` when that file is on disk, or of a
  hub id's cached copy); flash attention cannot take CoPE's packed forecast layout (a 4D mask);
* settings that make training a no-op are logged warnings (``data.group_size=1``, all weights 0,
  ``module.optimizer.lr=0``).

Arguments ``cope.run.train.train`` passes when it builds a block (:data:`PASSED_AT_BUILD`) are not config
keys. Torch-free itself; importing the target classes is its only cost (no model build).
"""
from __future__ import annotations

import dataclasses
import inspect
import json
import logging
from pathlib import Path
from typing import Any, Callable, Optional

from hydra.utils import get_object
from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import MissingMandatoryValue, OmegaConfBaseException

from cope.run.config_keys import Reads, renamed, source_key, unread_keys
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


class ConfigError(ValueError):
    """One or more config keys are wrong; the message has one line per key."""

    def __init__(self, problems: list[str]):
        self.problems = problems
        super().__init__("invalid config:\n  " + "\n  ".join(problems))


def check_config(cfg: DictConfig, reads: Reads | None = None) -> None:
    """Check the composed run config; raise :class:`ConfigError` listing every bad key, log no-op warnings.

    Args:
        cfg: the composed config.
        reads: what the run code reads besides component arguments and interpolations (default: what
            ``cope.run.train.train`` declares, :data:`cope.run.train.READS`); every other key is refused.
    """
    if reads is None:
        from cope.run.train import READS as reads  # declared beside the code that reads them
    c = _Checker()
    c.call(cfg, "", RunKeys, open_keys=True)
    c.errors += [p for p in unread_keys(cfg, reads) if p.split(" ")[0] not in c.bad]
    if not c.errors:
        c.cross_field(cfg)
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
                self.fail(full, renamed(full) or f": not an argument of {where} (it takes: {', '.join(params) or 'nothing'})")
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

    # -- cross-field rules and no-op warnings ---------------------------------------------------------
    def cross_field(self, cfg: DictConfig) -> None:
        data, model = cfg.get("data"), cfg.get("model")
        if isinstance(data, DictConfig) and isinstance(model, DictConfig):
            limit = model_positions(model)
            ctx = data.get("max_context")
            if limit is not None and isinstance(ctx, int) and ctx > limit[0]:
                self.fail("data.max_context", f" = {ctx}: exceeds the model's {limit[0]} positions ({limit[1]})")
            if data.get("group_size") == 1:
                self.warnings.append("data.group_size=1: one episode per group, so every group-relative advantage is 0 "
                                     "and the policy gradient is 0 (only auxiliary objectives train)")
            self.attention_fits_layout(model, cfg)
        accelerator = (cfg.get("trainer") or {}).get("accelerator")
        if accelerator in ("gpu", "cuda") and not _cuda_available():
            self.fail("trainer.accelerator", f" = {accelerator!r} (as trainer=gpu sets it): this machine has no CUDA GPU "
                      "(torch.cuda.is_available() is False); use trainer=cpu, or trainer.accelerator=cpu")
        optimizer = (cfg.get("module") or {}).get("optimizer") or {}
        if optimizer.get("lr") == 0:
            self.warnings.append("module.optimizer.lr=0: the adapter never changes (rollouts and validation run, "
                                 "nothing is learned)")
        objectives = [o for o in ((cfg.get("algo") or {}).get("objectives") or {}).values() if o is not None]
        if objectives and all(o.get("weight", 1.0) == 0 and o.get("final_weight", 0.0) == 0 for o in objectives):
            self.warnings.append("every algo.objectives.*.weight is 0: training changes nothing")

    def attention_fits_layout(self, model: DictConfig, cfg: DictConfig) -> None:
        """What CoPE's forecast layouts need of ``model.attn_implementation``, checked before any work:
        * flash attention takes no (N, 1, T, T) mask, and CoPE's packed rows (prefix trees) without sharing are
          attended through one (built per forward): the pairing would fail, or be wrong, at the first training forward;
        * ``data.share_prefix`` (every shared-prefix batch) switches the model to tree attention ("cope_tree"), which is
          SDPA without a tree: a model configured with anything else (eager, flash) would not get what it was
          configured with."""
        attn = model.get("attn_implementation", "sdpa")
        groups = bool((cfg.get("data") or {}).get("share_prefix", False))
        if groups and attn not in (None, "sdpa"):
            self.fail("model.attn_implementation", f" = {attn!r}: data.share_prefix=true forwards each GRPO group's prefix "
                      "once through tree attention ('cope_tree'), which runs as sdpa without a layout; use "
                      "model.attn_implementation=sdpa, or data.share_prefix=false")
        for name, node in ((cfg.get("algo") or {}).get("callbacks") or {}).items():
            cls = _callback_class(node)
            key = _packed_key(cls, node)
            if key is not None and isinstance(attn, str) and attn.startswith("flash_attention"):
                self.fail("model.attn_implementation", f" = {attn!r}: cannot take CoPE's packed forecast layout "
                          f"(algo.callbacks.{name}.{key}: prefix trees, attended through a (N, 1, T, T) mask per forward); "
                          f"use {'cope.update=separate or cope.packing=plain' if key.startswith('packing') else 'cope.packing=plain'} "
                          "(2D masks only) or model.attn_implementation=sdpa")


def check_context_floor(env_factory: Callable[[], Any], data: DictConfig) -> None:
    """``data.max_context`` against what the first prompt needs at least, known before the model and its tokenizer:
    the rules (``data.instructions``, or the env's own) take at least one token per word (every tokenizer here splits
    at whitespace before merging), and an action ``data.sampling.max_action_tokens`` plus its end-of-turn id.

    The exact count (with the first observation) comes at the first rollout; this catches a context that cannot fit
    even the rules, before the model build. An env that cannot be built here (its packages live in another
    interpreter) is not checked."""
    ctx, rules = data.get("max_context"), data.get("instructions")
    action = (data.get("sampling") or {}).get("max_action_tokens")
    if not isinstance(ctx, int) or not isinstance(action, int):
        return
    if rules is None:
        try:
            env = env_factory()
            try:
                rules = env.instructions
            finally:
                env.close()
        except Exception:
            return
    floor = len(str(rules).split())
    if floor + action + 1 > ctx:
        raise ConfigError([f"data.max_context = {ctx}: too small for the first prompt: its rules alone take at least "
                           f"{floor} tokens ({floor} words), and an action data.sampling.max_action_tokens={action} more "
                           f"plus its end-of-turn id; raise data.max_context well above {floor + action + 1} (the first "
                           "observation comes on top)"])


def _cuda_available() -> bool:
    import torch  # only for a GPU trainer: the check stays torch-free otherwise

    return torch.cuda.is_available()


def _callback_class(node: Any) -> type | None:
    """The class a callback node's ``_target_`` names, or None (not a node with a class target; a bad one is reported
    by the walk)."""
    if not isinstance(node, DictConfig) or not isinstance(node.get("_target_"), str):
        return None
    try:
        cls = get_object(node.get("_target_"))
    except Exception:
        return None
    return cls if isinstance(cls, type) else None


def _packed_key(cls: type | None, node: Any) -> str | None:
    """The key that puts CoPE's forecasts in packed segments (``layout=packed`` of the continuation targets,
    ``packing=packed`` of the authors' samples with ``update=joint``), or None."""
    from cope.algos.cope.forecast_targets import ForecastTargets
    from cope.algos.cope.forecasts import CopeForecasts

    if cls is not None and issubclass(cls, ForecastTargets) and node.get("packing") == "packed":
        return "packing=packed"
    if cls is not None and issubclass(cls, CopeForecasts) and node.get("update") == "joint" and node.get("packing") == "packed":
        return "packing=packed (update=joint)"
    return None


def model_positions(model: DictConfig) -> tuple[int, str] | None:
    """The model's position limit and where it comes from, when known without loading the model."""
    if isinstance(model.get("max_context"), int):
        return model.max_context, "model.max_context"
    path = model.get("path")
    if not isinstance(path, str):
        return None
    file = Path(path).expanduser() / "config.json"
    if not file.is_file():
        try:  # a hub id already in the local HF cache (no network)
            from huggingface_hub import try_to_load_from_cache

            hit = try_to_load_from_cache(path, "config.json")
            file = Path(hit) if isinstance(hit, str) else None
        except Exception:
            file = None
    if file is None:
        return None
    try:
        spec = json.loads(file.read_text())
    except (OSError, ValueError):
        return None  # the model loader reports a damaged folder
    n = spec.get("max_position_embeddings", (spec.get("text_config") or {}).get("max_position_embeddings"))
    return (n, f"max_position_embeddings in {file}") if isinstance(n, int) else None
