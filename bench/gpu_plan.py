"""The prepared GPU checks' shared parts: phases chosen by name, the card each needs, estimated minutes, the plan
printed first, the refusal of a phase the GPU is too small for, and the checkout's packages importable without an
install.

Used by ``bench/gpu_check.py``, ``bench/gpu_fsdp_check.py`` and ``bench/gpu_overlap_check.py``; docs/gpu.md lists
their commands in order. Standard library only: the plan is printed before torch is imported (``--dry-run`` and
``--list`` need no GPU), and the runs of ``gpu_overlap_check`` import this module at their start (its finder).

**Estimates.** Every phase states minutes on the card it names, from a small table in its script: the shapes and the
number of steps, turned into time by stated arithmetic (FLOPs at an assumed sustained rate, bytes at an assumed
bandwidth). No GPU has run these checks yet, so each is printed as ``est.``; when a GPU run measures a phase, its
``measured`` field takes the minutes seen and the plan prints that instead.

**Cards.** The lent machines have one NVIDIA H100 (80 GB; ``torch.cuda.get_device_properties`` reports 79.6 GiB) or
one H200 (141 GB; 140.4 GiB). A phase names the smaller card it fits by its script's memory arithmetic: ``80GB``
(either card) or ``141GB`` (the H200 only). A check refuses, before it builds anything, a selection holding a phase
whose card is larger than the GPU it finds (``torch.cuda.get_device_properties``), naming the phases that fit.
"""
from __future__ import annotations

import argparse
import importlib.abc
import importlib.util
import sys
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# total memory a card must report for a phase that names it (GiB): an 80 GB H100 reports 79.6, a 141 GB H200 140.4
CARD_MIN_GIB = {"80GB": 75.0, "141GB": 130.0}
CARD_NAME = {"80GB": "the 80 GB card (an H100; an H200 too)", "141GB": "the 141 GB card (an H200)"}
EXIT_CARD_TOO_SMALL = 4


@dataclass(frozen=True)
class PhaseSpec:
    """One phase of a check: ``card`` the smaller lent card it fits (``80GB`` or ``141GB``), ``minutes`` the estimate
    on that card (``basis``: how it was made), ``default`` whether the plan without ``--phase`` runs it,
    ``measured`` the minutes a GPU run took (None until one has)."""

    name: str
    what: str
    card: str
    minutes: float
    basis: str
    default: bool = True
    measured: float | None = None

    def __post_init__(self) -> None:
        if self.card not in CARD_MIN_GIB:
            raise ValueError(f"{self.name}: card must be one of {sorted(CARD_MIN_GIB)}, got {self.card!r}")


def add_plan_args(ap: argparse.ArgumentParser, phases: dict[str, PhaseSpec]) -> None:
    """``--phase`` (one or several by name, in order; default: the phases marked default), ``--list``, ``--dry-run``."""
    default = [n for n, p in phases.items() if p.default]
    ap.add_argument("--phase", nargs="+", choices=list(phases), metavar="PHASE",
                    help=f"one or more of {', '.join(phases)}, run in the order given (default: {' '.join(default)})")
    ap.add_argument("--list", action="store_true", help="print every phase with its card and estimate, and exit")
    ap.add_argument("--dry-run", action="store_true", help="print the plan of the selected phases, and exit (no GPU needed)")


def selected(args: argparse.Namespace, phases: dict[str, PhaseSpec]) -> list[str]:
    """The phases to run, in order: ``--phase`` as given (duplicates dropped), else the default ones."""
    names = args.phase or [n for n, p in phases.items() if p.default]
    return list(dict.fromkeys(names))


def plan_text(tool: str, phases: dict[str, PhaseSpec], names: list[str], setup: PhaseSpec | None = None,
              everything: bool = False) -> str:
    """The plan as a table: each phase's card and minutes (``est.`` or ``measured``), the total, the largest card.
    ``everything``: every phase, with the default ones marked (``--list``)."""
    rows = list(phases) if everything else names
    lines = [f"{tool}: {'phases' if everything else 'plan'} (minutes on the card named; est. = an estimate, no GPU run yet)",
             "| phase | card | minutes | default | what |", "|---|---|---|---|---|"]
    shown = ([setup] if setup is not None else []) + [phases[n] for n in rows]
    for p in shown:
        m = f"{p.measured:.2f} measured" if p.measured is not None else f"{p.minutes:.2f} est."
        lines.append(f"| {p.name} | {p.card} | {m} | {'yes' if p.default or p is setup else ''} | {p.what} |")
    if not everything:
        chosen = ([setup] if setup is not None else []) + [phases[n] for n in names]
        total = sum(p.measured if p.measured is not None else p.minutes for p in chosen)
        card = max((phases[n].card for n in names), key=CARD_MIN_GIB.get, default="80GB")
        lines.append(f"total: {total:.1f} min estimated, on {CARD_NAME[card]}")
    lines.append("how each estimate was made: " + "; ".join(f"{p.name}: {p.basis}" for p in shown))
    return "\n".join(lines)


def card_refusal(tool: str, phases: dict[str, PhaseSpec], names: list[str], device_name: str, total_gib: float) -> str | None:
    """The message refusing ``names`` on a GPU of ``total_gib`` (None: every phase fits its card's class)."""
    too_big = [n for n in names if total_gib < CARD_MIN_GIB[phases[n].card]]
    if not too_big:
        return None
    fits = [n for n in names if n not in too_big]
    need = ", ".join(f"{n} needs {CARD_NAME[phases[n].card]} ({CARD_MIN_GIB[phases[n].card]:.0f} GiB or more)" for n in too_big)
    rest = f"; the others fit: --phase {' '.join(fits)}" if fits else ""
    return (f"{tool}: refused before building anything: {need}, and this GPU ({device_name}) has {total_gib:.1f} GiB "
            f"(torch.cuda.get_device_properties). Run it on an H200 (the device tool's kind nvidia-h200){rest}.")


def cuda_card() -> tuple[str, float] | None:
    """(name, total GiB) of CUDA device 0, None without CUDA."""
    import torch

    if not torch.cuda.is_available():
        return None
    props = torch.cuda.get_device_properties(0)
    return props.name, props.total_memory / 2**30


def check_card(tool: str, phases: dict[str, PhaseSpec], names: list[str]) -> int | None:
    """Refuses (prints the reason, returns the exit status) a selection the CUDA device is too small for; None when it
    fits or there is no CUDA device (the caller's own check says so)."""
    card = cuda_card()
    if card is None:
        return None
    msg = card_refusal(tool, phases, names, *card)
    if msg is None:
        return None
    print(msg, file=sys.stderr)
    return EXIT_CARD_TOO_SMALL


def plan_only(args: argparse.Namespace, tool: str, phases: dict[str, PhaseSpec], setup: PhaseSpec | None,
              names: list[str] | None = None) -> bool:
    """Prints the plan of ``names`` (default: :func:`selected`) first, on every run; True when ``--list`` or
    ``--dry-run`` asked for nothing more."""
    names = selected(args, phases) if names is None else names
    print(plan_text(tool, phases, names, setup, everything=args.list), flush=True)
    return bool(args.list or args.dry_run)


# -- a bare checkout: pyproject's package-dir as an import finder -----------------------------------
def package_dirs() -> dict[str, Path]:
    """pyproject.toml's ``[tool.setuptools] package-dir``: ``cope`` = src/cope, ``cope.envs`` = envs,
    ``cope.callbacks`` = callbacks."""
    try:
        import tomllib

        dirs = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    except (ImportError, KeyError, OSError):  # Python 3.10 has no tomllib: the same mapping, written out
        dirs = {"cope": "src/cope", "cope.callbacks": "callbacks", "cope.envs": "envs"}
    return {name: REPO / d for name, d in dirs.items()}


class CheckoutFinder(importlib.abc.MetaPathFinder):
    """Finds the mapped packages (``cope``, ``cope.envs``, ``cope.callbacks``) in this checkout, first; their
    subpackages resolve through the parent's ``__path__`` as usual."""

    def __init__(self, dirs: dict[str, Path]):
        self.dirs = dirs

    def find_spec(self, fullname, path=None, target=None):
        d = self.dirs.get(fullname)
        if d is None or not (d / "__init__.py").is_file():
            return None
        return importlib.util.spec_from_file_location(fullname, d / "__init__.py", submodule_search_locations=[str(d)])


def install_checkout_finder() -> None:
    """This checkout's packages importable in this process, ahead of any installed ``cope`` (idempotent)."""
    if not any(type(f).__name__ == "CheckoutFinder" for f in sys.meta_path):
        sys.meta_path.insert(0, CheckoutFinder(package_dirs()))
