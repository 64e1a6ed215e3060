"""Which base model a model config builds, known without building it: what a resume compares with the
checkpoint's ``base_model`` (``Policy.source``, recorded by the module at every save).

Each factory records its own kind of source, so each gets its own rule here, computed from the same arguments:

* ``load_pretrained``: ``model.path`` as given (a local folder or a hub id);
* ``tiny_policy``: the cache folder ``<cache_dir>/<hash of the model settings and the env>``;
* ``gguf_policy``: the converted folder ``<cache_dir>/<hash of the GGUF file>-v<converter>``.

The last two are *content-keyed*: the folder's name says what was built, and the cache root only where it was
built, so the same name under another root (another machine, another ``COPE_CACHE``) is the same model. A
factory not listed here (a user's own ``_target_``) gives None: nothing to compare.
"""
from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable


@dataclass(frozen=True)
class BaseModel:
    """The base model a config builds: ``source`` as ``Policy.source`` will hold it, ``named_by`` the config keys
    that choose it (for messages), ``keyed`` whether ``source`` is a content-keyed cache folder."""

    source: str
    named_by: str
    keyed: bool = False

    def matches(self, recorded: str) -> bool:
        """Whether a checkpoint's ``base_model`` is this model."""
        if recorded == self.source:
            return True
        if self.keyed:
            return Path(recorded).name == Path(self.source).name
        mine, theirs = Path(self.source).expanduser(), Path(recorded).expanduser()
        return mine.exists() and theirs.exists() and mine.resolve() == theirs.resolve()  # one folder, two spellings


def _accepted(fn: Callable, settings: dict[str, Any]) -> dict[str, Any]:
    params = inspect.signature(fn).parameters
    return {k: v for k, v in settings.items() if k in params and k != "env_factory"}


def _pretrained(settings: dict[str, Any], env_factory: Callable | None) -> BaseModel | None:
    return BaseModel(str(settings["path"]), "model.path") if "path" in settings else None


def _tiny(settings: dict[str, Any], env_factory: Callable | None) -> BaseModel:
    from cope.models.tiny import tiny_base_folder

    folder, _ = tiny_base_folder(env_factory, **_accepted(tiny_base_folder, settings))
    return BaseModel(str(folder), "the tiny model's model.* settings and the env", keyed=True)


def _gguf(settings: dict[str, Any], env_factory: Callable | None) -> BaseModel:
    from cope.models.gguf import gguf_base_folder

    return BaseModel(str(gguf_base_folder(**_accepted(gguf_base_folder, settings))), "model.package and model.filename",
                     keyed=True)


# the factory as Hydra's `_target_` names it -> its rule
_RULES: dict[str, Callable[[dict[str, Any], Callable | None], BaseModel | None]] = {
    "cope.models.policy.load_pretrained": _pretrained,
    "cope.models.tiny.tiny_policy": _tiny,
    "cope.models.gguf.gguf_policy": _gguf,
}


def base_model_of(factory: functools.partial, env_factory: Callable | None) -> BaseModel | None:
    """The base model ``factory`` (the instantiated ``model`` config, a partial) will build, or None when unknown."""
    fn = getattr(factory, "func", None)
    rule = _RULES.get(f"{getattr(fn, '__module__', '')}.{getattr(fn, '__qualname__', '')}")
    return rule(dict(factory.keywords), env_factory) if rule is not None else None
