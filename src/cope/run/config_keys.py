"""Every key of the composed run config is read by something, or the run is refused before any work.

A key is read when it sits in a component block that ``cope.run.train.train`` builds (the block's keys are its
constructor's arguments: :mod:`cope.run.config_check` checks them against the signature), when an interpolation
in something read names it (``${cope.weight}``, ``${oc.select:cope.layout,list}``, nested resolvers too), or when
the code that reads the config declares it (:data:`TRAIN_READS`, what ``cope.run.train.train`` reads). Anything else (a
``+foo=1``, a knob nobody interpolates such as ``+cope.weigth=0.02``, a ``+rollout.max_lag=1`` that no engine
takes) would run silently as if it were set; it is refused naming the key, the group it sits in and the closest
key that is read (difflib).

Keys renamed or removed in a release stay in :data:`RENAMED` with their replacement: an old command line (with or
without ``+``) fails naming the new key, here for a composed config and in :func:`check_overrides` for the
command line itself (Hydra refuses an unknown key without ``+`` as "not in struct", before any code of ours runs).
"""
from __future__ import annotations

import difflib
import re
from dataclasses import dataclass
from typing import Any, Iterator

from omegaconf import DictConfig, OmegaConf

# old key -> what replaces it (one table for the command line and the composed config)
RENAMED = {
    "cope.coef": "cope.weight",
    "cope.final_coef": "cope.final_weight",
    "cope.mask_invalid": "cope.invalid (mask | cut | keep)",
    "cope.cut_at_invalid": "cope.invalid (mask | cut | keep)",
    "cope.share_prefix": "data.share_prefix (one switch for every user of shared prefixes)",
    "data.packed_row_tokens": "module.max_tokens_per_microbatch (the one token budget)",
    "callbacks.forecast_targets.layout": "cope.packing (packed | plain)",
    "algo.callbacks.forecast_targets.layout": "cope.packing (packed | plain)",
    "algo.callbacks.forecast_targets.mask_invalid": "cope.invalid (mask | cut | keep)",
    "algo.callbacks.forecast_targets.cut_at_invalid": "cope.invalid (mask | cut | keep)",
    "algo.callbacks.forecast_targets.share_prefix": "data.share_prefix (one switch for every user of shared prefixes)",
    # one success gate for both CoPE variants (cope.algos.cope.gate): a win's reward exceeds cope.success_threshold
    "cope.min_score": "cope.success_threshold (a win: reward > it, as in algo=cope; null: the env's success flag) "
                      "and cope.gate=all to admit every episode",
    "algo.callbacks.forecast_targets.min_score": "cope.success_threshold (a win: reward > it; null: the env's success flag)",
    "algo.callbacks.forecast_targets.success_only": "cope.gate (wins | all | mixed)",
    "algo.objectives.forecast.adaptive_target": "cope.adaptive_ratio (one name for the balanced modes' ratio)",
}
# resolvers whose first argument is a config key (the others, oc.env, hydra, now, take no key)
_KEY_RESOLVERS = ("oc.select", "oc.dict.keys", "oc.dict.values")
_KEY = re.compile(r"^\.*[\w-]+(?:\.[\w-]+)*$|^\.+$")


class ConfigError(ValueError):
    """One or more config keys are wrong; the message has one line per key."""

    def __init__(self, problems: list[str]):
        self.problems = problems
        super().__init__("invalid config:\n  " + "\n  ".join(problems))


@dataclass(frozen=True)
class Reads:
    """What the run code reads of the config besides component arguments and interpolations.

    Attributes:
        components: root component blocks it builds (``data``, ``module``, ...); their keys are constructor
            arguments.
        sections: named sections whose every entry is a component block, or null (switched off).
        keys: plain keys it reads itself (a group name covers the whole group).
    """

    components: tuple[str, ...] = ()
    sections: tuple[str, ...] = ()
    keys: tuple[str, ...] = ()


# What cope.run.train.train reads of the config besides component arguments and interpolations (declared here, not
# beside train(), so that the config check, which train() runs first, reads it without importing train()); the
# config check refuses every other key. `paths` are the run's folders, there for components to interpolate.
TRAIN_READS = Reads(components=("env", "model", "data", "module", "trainer", "logger"),
                    sections=("callbacks", "algo.objectives", "algo.callbacks"),
                    keys=("seed", "ckpt_path", "validate_before_fit", "paths", "hydra"))


def renamed(key: str) -> str | None:
    """The replacement of a renamed or removed key, as a message suffix, or None."""
    new = RENAMED.get(key)
    return None if new is None else f": renamed; use {new}"


def check_overrides(args: list[str]) -> list[str]:
    """Problems of a command line (Hydra's override syntax): each renamed or removed key, naming its replacement."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    problems = []
    for arg in args:
        if arg.startswith("-"):
            continue
        try:
            (override,) = OverridesParser.create().parse_overrides([arg])
        except Exception:
            continue  # Hydra reports a malformed override itself
        key = override.key_or_group
        if key in RENAMED:
            problems.append(f"{key} (on the command line: {arg}){renamed(key)}")
    return problems


def refuse_renamed(args: list[str]) -> None:
    """Exit (status 1) naming each renamed or removed key of a command line and its replacement: what an entry
    point runs before Hydra composes (Hydra would refuse the old key as "not in struct", or suggest ``+``)."""
    problems = check_overrides(args)
    if problems:
        raise SystemExit("invalid command line:\n  " + "\n  ".join(problems))


def unread_keys(cfg: DictConfig, reads: Reads) -> list[str]:
    """One problem per key of ``cfg`` that nothing reads (see the module docstring), with a suggestion."""
    tree = OmegaConf.to_container(cfg, resolve=False)
    read: set[str] = set()
    problems: list[str] = []
    todo = [k for k in (*reads.components, *reads.keys) if _get(tree, k) is not _ABSENT]
    for section in reads.sections:
        read.add(section)  # an empty section (no callbacks) is read too
        for name, node in (_get(tree, section) if isinstance(_get(tree, section), dict) else {}).items():
            if node is None or (isinstance(node, dict) and "_target_" in node):
                todo.append(f"{section}.{name}")
            else:
                read.add(f"{section}.{name}")  # reported here, not again as unread
                problems.append(f"{section}.{name} = {node!r}: an entry of {section} is a component block "
                                "(`_target_`) or null (off)")
    while todo:  # read keys, and the keys their values interpolate, transitively
        key = todo.pop()
        if key in read:
            continue
        read.add(key)
        for where, text in _strings(_get(tree, key), key):
            todo.extend(k for k in references(text, where) if _get(tree, k) is not _ABSENT)
    known = [k for k, _ in _leaves(tree, "") if _covered(k, read)]
    for key, value in _leaves(tree, ""):
        if not _covered(key, read):
            problems.append(f"{key} = {value!r}{renamed(key) or ': ' + _unread(key, known)}")
    return problems


def _unread(key: str, known: list[str]) -> str:
    group = f"in `{key.rsplit('.', 1)[0]}`" if "." in key else "at the root"
    parent, name = key.rsplit(".", 1) if "." in key else ("", key)
    siblings = {k.rsplit(".", 1)[-1]: k for k in known if k.rsplit(".", 1)[0] == parent or (not parent and "." not in k)}
    close = [siblings[n] for n in difflib.get_close_matches(name, list(siblings), n=1, cutoff=0.75)]
    close = close or difflib.get_close_matches(key, known, n=1, cutoff=0.75)
    if not close:  # the same name in another group (a key typed in the wrong place)
        by_name = {k.rsplit(".", 1)[-1]: k for k in known}
        close = [by_name[n] for n in difflib.get_close_matches(name, list(by_name), n=1, cutoff=0.8)]
    hint = f"did you mean {close[0]}?" if close else "no key that is read is close to it"
    return (f"read by nothing ({group}: no component argument, interpolation or run-level reader uses it; the run "
            f"would ignore it); {hint}")


def references(text: str, where: str = "") -> set[str]:
    """The config keys the interpolations in ``text`` name (absolute; ``where`` is the node holding ``text``)."""
    out: set[str] = set()
    for body in _interpolations(text):
        head, colon, args = body.partition(":")
        if not colon and _KEY.match(body):
            out.add(_absolute(body, where))
            continue
        if head in _KEY_RESOLVERS:
            first = _split_args(args)[0].strip() if args else ""
            if _KEY.match(first):
                out.add(_absolute(first, where))
        out |= references(args, where)  # nested interpolations in any resolver's arguments
    return out


def source_key(raw: Any) -> str | None:
    """The one key a value that is a single interpolation follows (``${cope.layout}``,
    ``${oc.select:cope.layout,list}``), or None."""
    if not isinstance(raw, str):
        return None
    bodies = _interpolations(raw)
    if len(bodies) != 1 or raw.strip() != "${" + bodies[0] + "}":
        return None
    keys = references(raw)
    return next(iter(keys)) if len(keys) == 1 else None


def name_sources(text: str, node: DictConfig, key: str) -> str:
    """``text`` (a constructor's error about block ``key``) with each argument key it names whose value follows
    another key by interpolation renamed to that key, the one the user set: ``cope.layout (read as
    callbacks.probes.layout)``, not ``callbacks.probes.layout``."""
    root = node._get_root()
    for arg in sorted(node.keys(), key=lambda a: -len(str(a))):  # a longer argument name first (layout_x before layout)
        full = f"{key}.{arg}"
        if full not in text or not OmegaConf.is_interpolation(node, arg):
            continue
        src = source_key(node._get_node(arg)._value())
        if src is not None and OmegaConf.select(root, src, default=_ABSENT, throw_on_resolution_failure=False) is not _ABSENT:
            text = re.sub(rf"{re.escape(full)}(?![\w.])", f"{src} (read as {full})", text)
    return text


# -- the plain container --------------------------------------------------------------------------------
_ABSENT = object()


def _get(tree: Any, key: str) -> Any:
    for part in key.split("."):
        if not isinstance(tree, dict) or part not in tree:
            return _ABSENT
        tree = tree[part]
    return tree


def _covered(key: str, read: set[str]) -> bool:
    parts = key.split(".")
    return any(".".join(parts[:i]) in read for i in range(1, len(parts) + 1))


def _leaves(node: Any, key: str) -> Iterator[tuple[str, Any]]:
    """Scalars and lists by dotted key; a dict ends the walk when empty or a component block (one entry)."""
    if isinstance(node, dict) and node and "_target_" not in node:
        for name, child in node.items():
            yield from _leaves(child, f"{key}.{name}" if key else str(name))
    elif key:
        yield key, node


def _strings(node: Any, key: str) -> Iterator[tuple[str, str]]:
    """Each string in ``node`` with the key of the dict that holds it (relative interpolations start there)."""
    if isinstance(node, dict):
        for name, child in node.items():
            yield from _strings(child, f"{key}.{name}")
    elif isinstance(node, list):
        for child in node:
            yield from _strings(child, f"{key}.0")  # held by the list
    elif isinstance(node, str) and "${" in node:
        yield key.rsplit(".", 1)[0], node


def _interpolations(text: str) -> list[str]:
    """The bodies of the top-level ``${...}`` in ``text`` (braces balanced)."""
    out, i = [], text.find("${")
    while i >= 0:
        depth, j = 0, i
        while j < len(text):
            if text.startswith("${", j):
                depth, j = depth + 1, j + 2
                continue
            if text[j] == "}":
                depth -= 1
                if depth == 0:
                    break
            j += 1
        out.append(text[i + 2: j])
        i = text.find("${", j + 1)
    return out


def _split_args(args: str) -> list[str]:
    """Resolver arguments split at top-level commas."""
    parts, depth, cur = [], 0, ""
    for ch in args:
        depth += ch == "{"
        depth -= ch == "}"
        if ch == "," and depth == 0:
            parts.append(cur)
            cur = ""
        else:
            cur += ch
    return [*parts, cur]


def _absolute(key: str, where: str) -> str:
    """``key`` from the root; a relative key (``.x``: beside the value, ``..x``: one level up) from ``where``."""
    dots = len(key) - len(key.lstrip("."))
    if not dots:
        return key
    base = where.split(".") if where else []
    base = base[: len(base) - (dots - 1)] if dots > 1 else base
    return ".".join([*base, key[dots:]] if key[dots:] else base)
