"""The config rules between keys, checked before any work (the per-key check is :mod:`cope.run.config_check`).

* ``data.max_context`` must fit the model's positions (``model.max_context`` of the tiny model, else
  ``max_position_embeddings`` of ``<model.path>/config.json`` when that file is on disk, or of a hub id's cached
  copy), and the first prompt's rules plus an action (:func:`check_context_floor`, once the env class is built);
* a GPU trainer needs a GPU (``trainer=gpu`` on a machine without CUDA names ``trainer=cpu``);
* ``trainer.num_nodes`` x ``trainer.devices`` against the launcher's world, and a multi-node run needs a launcher
  (:func:`cope.run.launch.check_launch`);
* ``trainer=fsdp`` refuses what cannot be sharded (:func:`cope.train.fsdp_strategy.check_sharding`);
* ``data.max_lag >= 1`` needs an engine that overlaps and reports its log-probs, and no top-p
  (:func:`lag_fits_engine`);
* flash attention cannot take CoPE's packed forecast rows (a 4D mask); shared prefixes need SDPA;
* settings that make training a no-op are logged warnings (``data.group_size=1``, all weights 0,
  ``module.optimizer.lr=0``).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

from hydra.utils import get_object
from omegaconf import DictConfig

from cope.run.config_keys import ConfigError
from cope.run.launch import check_launch
from cope.train.fsdp_strategy import check_sharding


def cross_field(cfg: DictConfig, fail: Callable[[str, str], None], warnings: list[str]) -> None:
    """The rules between keys (``fail(key, message)``) and the settings that make training a no-op (``warnings``)."""
    data, model = cfg.get("data"), cfg.get("model")
    if isinstance(data, DictConfig) and isinstance(model, DictConfig):
        limit = model_positions(model)
        ctx = data.get("max_context")
        if limit is not None and isinstance(ctx, int) and ctx > limit[0]:
            fail("data.max_context", f" = {ctx}: exceeds the model's {limit[0]} positions ({limit[1]})")
        if data.get("group_size") == 1:
            warnings.append("data.group_size=1: one episode per group, so every group-relative advantage is 0 "
                        "and the policy gradient is 0 (only auxiliary objectives train)")
        attention_fits_layout(model, cfg, fail)
    accelerator = (cfg.get("trainer") or {}).get("accelerator")
    if accelerator in ("gpu", "cuda") and not _cuda_available():
        fail("trainer.accelerator", f" = {accelerator!r}: this machine has no CUDA GPU (torch.cuda.is_available() is "
             "False); use trainer=cpu in place of trainer=gpu, or trainer.accelerator=cpu")
    if isinstance(cfg.get("trainer"), DictConfig):
        check_launch(cfg.trainer, fail)
    check_sharding(cfg, fail)  # trainer=fsdp: what cannot be sharded (quantized weights, a server engine, ...)
    if isinstance(data, DictConfig):
        lag_fits_engine(data, fail, cfg)
    if isinstance(model, DictConfig):
        full_finetuning_fits(model, data, fail)
        export = ((cfg.get("callbacks") or {}).get("adapter_export") or {})
        if model.get("finetune") == "full" and export.get("merged"):
            fail("callbacks.adapter_export.merged", " = true with model.finetune=full: there is no adapter to merge; the "
                 "export (<run>/csv/model) is already the whole trained model. Set it to false")
    optimizer = (cfg.get("module") or {}).get("optimizer") or {}
    if optimizer.get("lr") == 0:
        warnings.append("module.optimizer.lr=0: the adapter never changes (rollouts and validation run, "
                             "nothing is learned)")
    objectives = [o for o in ((cfg.get("algo") or {}).get("objectives") or {}).values() if o is not None]
    if objectives and all(o.get("weight", 1.0) == 0 and o.get("final_weight", 0.0) == 0 for o in objectives):
        warnings.append("every algo.objectives.*.weight is 0: training changes nothing")


def full_finetuning_fits(model: DictConfig, data: DictConfig | None, fail: Callable[[str, str], None]) -> None:
    """``model.finetune=full`` against what it cannot take: quantized or half-precision weights, a LoRA adapter to start
    from (:func:`cope.models.policy.finetune_problem`), and a server rollout engine (the vLLM engine serves each policy
    version as a LoRA adapter; full weights would have to be pushed into the server every epoch, which is not built)."""
    from cope.models.policy import finetune_problem

    finetune = model.get("finetune", "lora")
    problem = finetune_problem(finetune, model.get("quantization"), model.get("adapter"), model.get("dtype", "fp32"))
    if problem is not None:
        fail(problem[0], f": {problem[1]}")
        return
    engine = str(((data or {}).get("engine") or {}).get("_target_", ""))
    if finetune == "full" and engine and not engine.endswith(".HFEngine"):
        fail("data.engine", f" = {engine}: model.finetune=full needs the in-process engine (rollout=hf): the vLLM server "
             "engine loads each policy version as a LoRA adapter, and pushing full weights into the server every epoch "
             "is not built. Use rollout=hf, or model.finetune=lora to keep the server")


def lag_fits_engine(data: DictConfig, fail: Callable[[str, str], None], cfg: DictConfig | None = None) -> None:
    """``data.max_lag``: >= 0; >= 1 needs an engine that overlaps and reports its log-probs, and no top-p
    (:func:`cope.train.lagged_rollouts.lag_problem`, read from the engine class's attributes: nothing is built)."""
    lag = data.get("max_lag", 0)
    if not isinstance(lag, int) or lag == 0:
        return
    if lag < 0:
        fail("data.max_lag", f" = {lag}: must be >= 0 (0: collect, then train)")
        return
    from cope.train.lagged_rollouts import lag_problem

    target = str((data.get("engine") or {}).get("_target_", "cope.rollout.engine.HFEngine"))
    problem = lag_problem(lag, get_object(target), float((data.get("sampling") or {}).get("top_p", 1.0)))
    if problem is not None:
        fail(problem[0], f" = {lag if problem[0] == 'data.max_lag' else data.sampling.top_p}: {problem[1]}")
    elif target.endswith(".HFEngine"):  # a sampler copy per held version: the adapter only
        from cope.rollout.sampler_copy import copy_problem

        strategy = (cfg.get("trainer") or {}).get("strategy") if cfg is not None else None
        strategy = str(strategy.get("_target_", "")) if isinstance(strategy, DictConfig) else str(strategy or "")
        problem = copy_problem((cfg.get("model") or {}).get("finetune") if cfg is not None else None, strategy)
        if problem is not None:
            fail(problem[0], f" {problem[1]}")
    elif target.endswith(".VLLMEngine"):
        from cope.rollout.vllm.versions import loras_problem

        loras = int(data.engine.get("max_loras", 1))
        problem = None if data.engine.get("url") else loras_problem(lag, loras)  # an attached server is its operator's
        if problem is not None:
            fail("data.engine.max_loras", f" = {loras}: {problem}")


def attention_fits_layout(model: DictConfig, cfg: DictConfig, fail: Callable[[str, str], None]) -> None:
    """What CoPE's forecast batches need of ``model.attn_implementation``, checked before any work:
    * flash attention takes no (N, 1, T, T) mask, and CoPE's packed rows (prefix trees) without sharing are
      attended through one (built per forward): the pairing would fail, or be wrong, at the first training forward;
    * ``data.share_prefix`` (every shared-prefix batch) switches the model to tree attention ("cope_tree"), which is
      SDPA without a tree: a model configured with anything else (eager, flash) would not get what it was
      configured with."""
    attn = model.get("attn_implementation", "sdpa")
    groups = bool((cfg.get("data") or {}).get("share_prefix", False))
    if groups and attn not in (None, "sdpa"):
        fail("model.attn_implementation", f" = {attn!r}: data.share_prefix=true forwards each GRPO group's prefix "
             "once through tree attention ('cope_tree'), which runs as sdpa without a layout; use "
             "model.attn_implementation=sdpa, or data.share_prefix=false")
    for name, node in ((cfg.get("algo") or {}).get("callbacks") or {}).items():
        cls = _callback_class(node)
        key = _packed_key(cls, node)
        if key is not None and isinstance(attn, str) and attn.startswith("flash_attention"):
            fail("model.attn_implementation", f" = {attn!r}: cannot take CoPE's packed forecast layout "
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
