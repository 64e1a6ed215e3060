"""Which logged metric families docs/metrics.md describes (conftest's ``read_metrics`` checks every metrics.csv a
test reads against it). A module of its own name: ``conftest`` is two modules in this tree (tests/vllm has one)."""
from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def documented_metric_families() -> set[str]:
    """The metric families docs/metrics.md has a row for (``rollout`` from ```rollout/*```; ``*`` stands for the
    ``<objective>/...`` and ``.../<objective>`` rows' placeholder)."""
    names = set()
    for line in (REPO / "docs/metrics.md").read_text().splitlines():
        if line.startswith("| `"):
            names.update(re.findall(r"`([^`]+/[^`]*)`", line.split("|")[1]))
    return {"*" if n.startswith("<") else n.split("/")[0] for n in names}


def undocumented_metrics(keys) -> list[str]:
    """The metric keys (``family/name``) whose family has no row in docs/metrics.md (``<objective>/scale`` matches any
    family's ``scale``)."""
    families = documented_metric_families()
    return sorted(k for k in keys if "/" in k and k.split("/")[0] not in families and not k.endswith("/scale"))
