"""``data.max_context`` against what the model can take and what the first prompt needs, before the model is built.

* the model's positions (:func:`model_positions`): ``model.max_context`` of the tiny model, else
  ``max_position_embeddings`` of ``<model.path>/config.json`` when that file is on disk, or of a hub id's cached copy
  (checked by :func:`context_fits_model`, from :func:`cope.run.config_rules.cross_field`);
* the first prompt's rules plus an action (:func:`check_context_floor`, once the env class is built: called by
  :func:`cope.run.train.train` before the model build).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

from omegaconf import DictConfig

from cope.run.config_keys import ConfigError


def context_fits_model(data: DictConfig, model: DictConfig, fail: Callable[[str, str], None]) -> None:
    """``data.max_context`` must fit the model's positions, when they are known without loading the model."""
    limit = model_positions(model)
    ctx = data.get("max_context")
    if limit is not None and isinstance(ctx, int) and ctx > limit[0]:
        fail("data.max_context", f" = {ctx}: exceeds the model's {limit[0]} positions ({limit[1]})")


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
