"""Early stops of branched rollouts (``branch.stop_loops``, ``branch.stop_duplicates``): a child that repeats stops.

Follows TreePO (arXiv 2508.17445), which stops a branch early once it repeats, to spend no more tokens and env steps
on it. Checked by the slot that runs a child (:class:`~cope.train.collect.branching.forks.TracingEnv` in process,
:class:`~cope.train.collect.branching.tracing_batch.TracingBatch` over env workers) after each of the child's own
steps (never a shared one, never a root's, never the step that ends the episode anyway):

* ``loop``: the env answered with an observation text it already gave on this trajectory (the reset's or an earlier
  step's, the shared steps included): the branch is back in a state it has seen. An empty observation (a malformed
  action's) says nothing about the state and is never a loop;
* ``duplicate``: the trajectory so far (every action sent and observation received, the shared steps included)
  equals, at the same length, that of another leaf of the same parent: a sibling not stopped itself, or the parent
  (a child that re-samples the parent's next steps is its parent's sibling on the path the parent took). Siblings run
  in lock step in one wave, so the one checked second stops (slot order: the same in process and with workers).

A stopped child's slot answers ``done`` to the rollout loop, which ends the episode there; the tree then drops it: it
is no leaf (no reward, no advantage, not trained, never forked), its steps count in the trees' cost
(``rollout/branch_env_steps``, ``rollout/branch_generated_tokens``) and the stop in ``rollout/branch_stop_loop`` or
``rollout/branch_stop_duplicate``. Its slot is not handed to another fork: the steps it did not take are the saving
TreePO stops for, and a refill could loop again (the group trains fewer leaves; the epoch's minibatch count does not
change, :func:`cope.train.collect.experience.cut_minibatches`).

Where it differs from TreePO: its branches are segments of one generation compared by their text; here a branch is a
sequence of env steps compared by the actions sent and the env's observations.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Protocol

from cope.envs.base import EnvReset, EnvStep


class Trace(Protocol):
    """What a slot's env said (:class:`cope.train.collect.branching.forks.Trace`, which imports this module)."""

    first: EnvReset
    actions: list[str]
    results: list[EnvStep]

LOOP, DUPLICATE = "loop", "duplicate"
REASONS = (LOOP, DUPLICATE)


@dataclass(frozen=True)
class StopRule:
    """Which early stops are on (see the module doc)."""

    loops: bool = False
    duplicates: bool = False

    @property
    def on(self) -> bool:
        return self.loops or self.duplicates

    def reason(self, trace: Trace, k: int, others: Iterable[Trace]) -> str | None:
        """Why the child with ``trace`` (``k`` shared steps), whose env has just answered its newest step, stops
        (:data:`LOOP`, :data:`DUPLICATE`), or None. ``others``: the traces of the parent and of its other children."""
        n = len(trace.results)
        last = trace.results[-1] if n else None
        if n <= k or last is None or last.done:
            return None
        if self.loops and last.observation and last.observation in (
                trace.first.observation, *(r.observation for r in trace.results[:-1])):
            return LOOP
        if self.duplicates and any(_same_prefix(trace, o, n) for o in others):
            return DUPLICATE
        return None


def _same_prefix(a: Trace, b: Trace, n: int) -> bool:
    """The first ``n`` steps of ``a`` and ``b`` sent the same actions and got the same observations."""
    if b is a or len(b.results) < n:
        return False
    return a.actions[:n] == b.actions[:n] and all(
        x.observation == y.observation for x, y in zip(a.results[:n], b.results[:n]))


def link_kin(slots: list[Any]) -> None:
    """Sets each slot's ``kin``: the slots of ``slots`` forked from the same parent trace, in order (a root: itself)."""
    families: dict[int, list[Any]] = {}
    for s in slots:
        s.kin = [s] if s.parent is None else families.setdefault(id(s.parent), [])
        if s.parent is not None:
            s.kin.append(s)


def kin_traces(slot: Any) -> list[Trace]:
    """The traces a child's duplicate check compares with: its parent's and its siblings' (the slots of ``slot.kin``
    with a trace, not stopped, other than ``slot``)."""
    return [slot.parent] + [s.trace for s in slot.kin if s is not slot and s.trace is not None and s.stop is None]


def check(slot: Any, rule: StopRule | None) -> str | None:
    """Sets and returns ``slot.stop`` after its newest step: the stop reason of a child slot (``parent``, ``k``,
    ``trace``, ``kin``, ``stop``), None for a root or with no rule on."""
    if rule is None or not rule.on or slot.parent is None or slot.stop is not None:
        return slot.stop
    slot.stop = rule.reason(slot.trace, slot.k, kin_traces(slot) if rule.duplicates else ())
    return slot.stop
