"""Constructor signatures as a schema: typed parameters of a callable and whether a config value fits one.

Used by :mod:`cope.run.config_check`. Annotation forms this does not read make no claim (they pass).
"""
from __future__ import annotations

import collections.abc as cabc
import dataclasses
import enum
import inspect
import sys
import types
import typing
from pathlib import PurePath
from typing import Any

UNSET = type("_Unset", (), {"__repr__": lambda self: "<unreadable>"})()  # a value already reported
BUILT = type("_Built", (), {"__repr__": lambda self: "<component>"})()  # a component block, checked on its own


def qualname(fn: Any) -> str:
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"


def parameters(fn: Any) -> tuple[dict[str, inspect.Parameter], inspect.Parameter | None]:
    """Named parameters with resolved annotations, and the ``**kwargs`` parameter if any."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return {}, inspect.Parameter("kwargs", inspect.Parameter.VAR_KEYWORD)  # unreadable: accept anything
    hints = _hints(fn, sig)
    params = {n: p.replace(annotation=hints.get(n, Any)) for n, p in sig.parameters.items()
              if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}
    var_kw = next((p for p in sig.parameters.values() if p.kind is p.VAR_KEYWORD), None)
    return params, var_kw


def _hints(fn: Any, sig: inspect.Signature) -> dict[str, Any]:
    init = fn.__init__ if inspect.isclass(fn) else fn
    for obj in (init, fn if dataclasses.is_dataclass(fn) else None):
        if obj is not None:
            try:
                return typing.get_type_hints(obj)
            except Exception:
                pass
    # some names are not importable (TYPE_CHECKING-only): evaluate each annotation alone, the rest is Any
    module = sys.modules.get(getattr(fn, "__module__", ""), None)
    globs = getattr(inspect.unwrap(init), "__globals__", None) or (vars(module) if module else {})
    out = {}
    for name, p in sig.parameters.items():
        ann = p.annotation
        if isinstance(ann, str):
            try:
                ann = eval(ann, dict(globs))  # noqa: S307 (annotations of installed code)
            except Exception:
                ann = Any
        out[name] = Any if ann is inspect.Parameter.empty else ann
    return out


def base_annotation(fn: Any, name: str) -> Any:
    """The annotation of ``name`` in the first base class ``__init__`` that declares it (for ``**kwargs``)."""
    for cls in (fn.__mro__[1:] if inspect.isclass(fn) else ()):
        if "__init__" in vars(cls) and cls is not object:
            params, _ = parameters(cls)
            if name in params:
                return params[name].annotation
    return None


_SEQUENCES = (list, tuple, cabc.Sequence, cabc.MutableSequence, cabc.Iterable, cabc.Collection, set, frozenset)
_MAPPINGS = (dict, cabc.Mapping, cabc.MutableMapping)


def conforms(v: Any, ann: Any) -> bool:
    """Whether a plain config value fits ``ann``; annotation forms this does not read are no claim (True)."""
    if v is BUILT or ann is Any or isinstance(ann, (str, typing.TypeVar, typing.ForwardRef)):
        return True
    if ann is None or ann is type(None):
        return v is None
    origin, args = typing.get_origin(ann), typing.get_args(ann)
    if origin in (typing.Union, types.UnionType):
        return any(conforms(v, a) for a in args)
    if origin is typing.Literal:
        return any(v == a and type(v) is type(a) for a in args)
    if origin is typing.Annotated:
        return conforms(v, args[0])
    if ann is bool:
        return isinstance(v, bool)
    if ann is int:
        return isinstance(v, int) and not isinstance(v, bool)
    if ann is float:
        return isinstance(v, (int, float)) and not isinstance(v, bool)
    if ann is str:
        return isinstance(v, str)
    if isinstance(ann, type) and issubclass(ann, PurePath):
        return isinstance(v, (str, PurePath))
    if isinstance(ann, type) and issubclass(ann, enum.Enum):
        return isinstance(v, ann) or (isinstance(v, str) and v in ann.__members__) or any(v == m.value for m in ann)
    if (origin or ann) in _SEQUENCES:
        if not isinstance(v, (list, tuple)):
            return False
        if (origin or ann) is tuple and args and args[-1] is not Ellipsis:
            return len(v) == len(args) and all(conforms(x, a) for x, a in zip(v, args))
        return not args or all(conforms(x, args[0]) for x in v)
    if (origin or ann) in _MAPPINGS:
        return isinstance(v, dict) and (len(args) != 2 or all(conforms(k, args[0]) and conforms(x, args[1])
                                                               for k, x in v.items()))
    if (origin or ann) is cabc.Callable:
        return callable(v)
    if isinstance(ann, type):
        try:
            return isinstance(v, ann)
        except TypeError:
            return True
    return True


def type_name(ann: Any) -> str:
    origin, args = typing.get_origin(ann), typing.get_args(ann)
    if ann is None or ann is type(None):
        return "null"
    if origin in (typing.Union, types.UnionType) or origin is typing.Literal:
        literals = [repr(x) for a in args if typing.get_origin(a) is typing.Literal for x in typing.get_args(a)]
        literals += [repr(a) for a in args] if origin is typing.Literal else []
        rest = [type_name(a) for a in args if origin is not typing.Literal and typing.get_origin(a) is not typing.Literal]
        return " | ".join(([f"one of {', '.join(literals)}"] if literals else []) + rest)
    if origin is not None:
        inner = ", ".join("..." if a is Ellipsis else type_name(a) for a in args)
        return f"{getattr(origin, '__name__', str(origin))}[{inner}]" if inner else getattr(origin, "__name__", str(origin))
    return getattr(ann, "__name__", str(ann).replace("typing.", ""))
