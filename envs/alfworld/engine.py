"""ALFWorld's text engine for `cope.envs.alfworld.env`: textworld's ``PddlEnv`` with alfworld's wrappers, a per-process
pool of engines, and an optional memo of fast-downward's PDDL -> SAS translation.

* Engine: ``AlfredInfos(AlfredDemangler(PddlEnv(infos), shuffle=False))``, the stack ``AlfredTWEnv.init_env``
  builds (without textworld.gym's batching), so names ("cabinet 3"), intro, feedback and admissible commands
  are ALFWorld's.
* Pool: each ``PddlEnv`` loads a private copy of fast-downward's library (33 MB, copied through ``$TMPDIR``)
  so that engines share no C state. Unloading a copy (``fast_downward.close_lib``: dlclose) makes later
  loads crash, so a closed env parks its engine here and the next env takes it: copies = peak live envs.
* Memo (``memo=True`` inside :func:`engine_call`): two pure text -> structure conversions of the engine
  are served from per-process LRU memos, so the engine computes exactly what it would without them:
  fast-downward's PDDL -> SAS translation (textworld builds a ``PddlState``, two translations, on ``load`` and
  again on every ``reset``: ~85% of a reset's time; a reset to a game translated before costs ~0.05 s) and
  the grammar's parse of a template string (``textgen._parse_and_convert``, run for every admissible command
  on every step: a fresh deep copy is handed out each time, since the engine writes into the symbols;
  ~1.9x steps/s). Outside :func:`engine_call` (any other user of textworld or fast-downward in the
  process) nothing changes.
* ``fast_downward.pddl2sas`` overwrites ``sys.argv``; :func:`engine_call` puts it back.
"""
from __future__ import annotations

import contextlib
import copy
import hashlib
import sys
import threading
from collections import OrderedDict
from typing import Any

INSTALL_HINT = "install the extra: pip install 'cope-trainer[alfworld]'"
MEMO_SIZE = 32  # translated games kept per process (a GRPO group shares its game; a wave has a few games)
PARSE_MEMO_SIZE = 4096  # parsed grammar strings (command templates and feedback rules; one task sentence per game)

_IDLE: list[tuple[Any, str | None]] = []
_LOCK = threading.Lock()
_MEMO: OrderedDict[tuple[str, bool], Any] = OrderedDict()
_PARSES: OrderedDict[tuple, Any] = OrderedDict()
_STATE = threading.local()


def import_engine():
    """The engine's classes; an ImportError naming the extra when the package is missing."""
    try:
        import fast_downward
        import textworld
        from alfworld.agents.environment.alfred_tw_env import AlfredDemangler, AlfredInfos
        from textworld.envs.pddl import PddlEnv
    except ImportError as e:
        raise ImportError(f"env=alfworld needs the alfworld package ({e}); {INSTALL_HINT}") from e
    return fast_downward, textworld, PddlEnv, AlfredDemangler, AlfredInfos


def take_engine() -> tuple[Any, str | None]:
    """(engine, the game file it has loaded or None): an idle engine of this process, else a new one."""
    with _LOCK:
        if _IDLE:
            return _IDLE.pop()
    fast_downward, textworld, PddlEnv, AlfredDemangler, AlfredInfos = import_engine()
    _install_memo(fast_downward)
    _install_parse_memo()
    infos = textworld.EnvInfos(won=True, admissible_commands=True, extras=["gamefile"])
    return AlfredInfos(AlfredDemangler(PddlEnv(infos), shuffle=False)), None


def park_engine(engine: Any, loaded: str | None) -> None:
    with _LOCK:
        _IDLE.append((engine, loaded))


@contextlib.contextmanager
def engine_call(memo: bool):
    """Around ``load``/``reset``/``step``: restores ``sys.argv``; with ``memo`` serves repeated conversions."""
    argv, before = sys.argv, getattr(_STATE, "memo", False)
    _STATE.memo = memo
    try:
        yield
    finally:
        _STATE.memo = before
        sys.argv = argv


def _install_memo(fast_downward) -> None:
    with _LOCK:
        if getattr(fast_downward.pddl2sas, "_cope_memo", False):
            return
        original = fast_downward.pddl2sas

        def pddl2sas(domain, problem, verbose=False, optimize=False):
            if not getattr(_STATE, "memo", False) or verbose:
                return original(domain, problem, verbose=verbose, optimize=optimize)
            key = (hashlib.sha256(f"{domain}\0{problem}".encode()).hexdigest(), bool(optimize))
            with _LOCK:
                hit = _MEMO.get(key)
                if hit is not None:
                    _MEMO.move_to_end(key)
                    return hit
            result = original(domain, problem, verbose=verbose, optimize=optimize)
            with _LOCK:
                _MEMO[key] = result
                while len(_MEMO) > MEMO_SIZE:
                    _MEMO.popitem(last=False)
            return result

        pddl2sas._cope_memo = True
        fast_downward.pddl2sas = pddl2sas


def _install_parse_memo() -> None:
    import textworld.envs.pddl.textgen as textgen

    with _LOCK:
        if getattr(textgen._parse_and_convert, "_cope_memo", False):
            return
        original = textgen._parse_and_convert

        def parse_and_convert(*args, **kwargs):
            if not getattr(_STATE, "memo", False) or kwargs.get("trace"):
                return original(*args, **kwargs)
            key = (args, tuple(sorted(kwargs.items())))
            with _LOCK:
                hit = _PARSES.get(key)
                if hit is not None:
                    _PARSES.move_to_end(key)
            if hit is None:
                hit = original(*args, **kwargs)
                with _LOCK:
                    _PARSES[key] = hit
                    while len(_PARSES) > PARSE_MEMO_SIZE:
                        _PARSES.popitem(last=False)
            return copy.deepcopy(hit)  # the engine sets .context on the symbols it gets

        parse_and_convert._cope_memo = True
        textgen._parse_and_convert = parse_and_convert
