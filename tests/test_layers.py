"""The package's architecture as a test: layers import downward only, no module imports itself back, and
``train/`` stays a few files plus subpackages by concern.

Every ``import cope...`` in the installed package (``src/cope``, ``callbacks/`` as ``cope.callbacks``, ``envs/`` as
``cope.envs``) counts, function-local and ``TYPE_CHECKING`` imports included: a circle hidden in a function is still a
circle in the design. Read from the source with ``ast`` (nothing is imported).
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TREES = {"cope": ROOT / "src" / "cope", "cope.callbacks": ROOT / "callbacks", "cope.envs": ROOT / "envs"}

# Lowest first; a module may import its own layer and the ones before it. The base holds the records that flow
# through every layer (episodes, batches) and what needs no model: envs, the chat scaffold, hub paths, extras, the
# capability reader every layer may ask.
LAYERS = (
    ("extras", "capabilities", "hub", "chat", "envs", "episode", "batch"),
    ("rollout",),  # env -> rollout engine -> episodes
    ("models", "records"),  # the policy and its warm starts (they play episodes); the trainer's published records
    ("train",),  # episodes -> batches -> objectives -> optimizer
    ("algos",),  # one place per method, on the train layer's seams
    ("run",),  # config check, launch, checkpoints, loggers: composes everything below
    ("callbacks",),  # cross-cutting, on public records
)
TRAIN_TOP_LEVEL_MAX = 12


def modules() -> dict[str, Path]:
    out = {}
    for pkg, root in TREES.items():
        for f in root.rglob("*.py"):
            parts = [p for p in f.relative_to(root).with_suffix("").parts if p != "__init__"]
            out[".".join([pkg, *parts])] = f
    return out


def _resolve(name: str, known: dict[str, Path]) -> str | None:
    while name and name not in known:
        name = name.rpartition(".")[0]
    return name or None


def import_graph(known: dict[str, Path]) -> dict[str, set[str]]:
    """module -> the package modules it imports (``from cope.x import y`` counts ``cope.x.y`` when that is a module)."""
    graph: dict[str, set[str]] = {}
    for name, path in known.items():
        deps: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets = []
            if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("cope"):
                targets = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in known else node.module
                           for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level:
                raise AssertionError(f"{path}: relative import; the package uses absolute imports only")
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names if a.name.startswith("cope")]
            deps |= {t for t in (_resolve(t, known) for t in targets) if t and t != name and not name.startswith(t + ".")}
        graph[name] = deps
    return graph


def layer_of(module: str) -> int:
    top = module.split(".")[1] if "." in module else module
    for i, names in enumerate(LAYERS):
        if top in names:
            return i
    raise AssertionError(f"{module}: its top-level name {top!r} is in no layer of tests/test_layers.py: place it")


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            for w in it:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(graph.get(w, ())))))
                    break
                if w in on:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    comp = []
                    while True:
                        w = stack.pop()
                        on.discard(w)
                        comp.append(w)
                        if w == v:
                            break
                    if len(comp) > 1:
                        out.append(sorted(comp))
    return out


@pytest.fixture(scope="module")
def graph():
    return import_graph(modules())


def test_no_import_circle(graph):
    assert circles(graph) == []


def test_layers_import_downward_only(graph):
    upward = sorted(f"{a} -> {b}" for a, deps in graph.items() for b in deps if layer_of(b) > layer_of(a))
    assert upward == [], "imports from a lower layer into a higher one (tests/test_layers.py LAYERS):\n" + "\n".join(upward)


def test_train_top_level_is_small():
    top = sorted(p.name for p in (TREES["cope"] / "train").glob("*.py"))
    assert len(top) <= TRAIN_TOP_LEVEL_MAX, top


def test_checks_catch_what_they_claim():
    """The checks themselves: a two-module circle, a longer one and an upward import are found."""
    assert circles({"a": {"b"}, "b": {"a"}, "c": set()}) == [["a", "b"]]
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert layer_of("cope.train.module") > layer_of("cope.models.policy") > layer_of("cope.rollout.engine")
    assert layer_of("cope.run.train") > layer_of("cope.algos.grpo") > layer_of("cope.batch")
