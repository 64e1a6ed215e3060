"""Where a branched rollout forks: the branch-point triggers (``branch.trigger``).

A fork point ``(parent, k)`` makes a child that shares the parent's first ``k`` steps (the transcript up to the end
of step ``k``'s feedback) and samples its own step ``k + 1`` onwards. The signal of a fork point is the parent's step
``k + 1``, the step the child re-samples: its text holds the tag, its tokens' entropy rose, ... Candidates are the
steps a parent took itself (after its own fork point), ``1 <= k < num_steps`` (the parent went on after step ``k``),
``k <= max_depth``.

Triggers (each decides the candidates of one wave's episodes, in order, until the task's slots are used):

* ``random``: each candidate forks with probability ``p`` (SPARK's random-branching ablation);
* ``uniform``: the task's free slots spread over its parents round-robin, each parent's children at evenly spaced
  depths of its candidates (deterministic: what the env-step saving is measured on);
* ``tag``: the parent's step ``k + 1`` contains the marker (SPARK, arXiv 2601.20209: ``<explore>``);
* ``entropy``: ARPO's rule (arXiv 2507.19849): ``random() - w * dH <= p`` with ``dH`` the normalized entropy of the
  first <= 20 tokens of step ``k + 1`` minus that of the episode's first step. Where ARPO reads the sampler's
  entropy, we estimate it from the sampled tokens' log-probs (``-mean log p / log |V|``, an unbiased estimate of the
  entropy of the distribution they were drawn from), which is what the in-process sampler reports.
"""
from __future__ import annotations

import math
import random
from typing import Callable

from cope.episode import Episode

TRIGGERS = ("random", "uniform", "tag", "entropy")
ENTROPY_TOKENS = 20  # ARPO: the first <= 20 tokens after an observation


def candidates(ep: Episode, max_depth: int | None) -> list[int]:
    """The fork depths ``k`` of ``ep`` (see the module doc); none for an aborted episode."""
    if ep.aborted:
        return []
    top = ep.num_steps - 1 if max_depth is None else min(ep.num_steps - 1, max_depth)
    return [k for k in range(max(ep.shared_steps, 0) + 1, top + 1) if ep.steps[k - 1].obs_end >= 0]


def step_entropy(ep: Episode, step: int, vocab: int) -> float:
    """The normalized entropy estimate of ``ep.steps[step]`` (0-based): ``-mean log p`` over its first
    :data:`ENTROPY_TOKENS` sampled tokens, over ``log vocab``. Needs the sampler's log-probs."""
    lps = ep.steps[step].sampler_logprobs
    if not lps:
        raise ValueError("branch.trigger=entropy: a step has no sampler log-probs (the rollout must record them)")
    head = lps[:ENTROPY_TOKENS]
    return -sum(head) / len(head) / math.log(max(vocab, 2))


def choose_forks(trigger: str, parents: list[tuple[int, Episode]], slots: int, rng: random.Random, *, p: float,
                 tag: str, max_depth: int | None, entropy_weight: float = 0.2, vocab: int = 2) -> list[tuple[int, int]]:
    """At most ``slots`` fork points ``(parent index, k)`` among ``parents`` (``(index, episode)`` of one task's
    newest wave), by ``trigger`` (see the module doc); ``rng`` draws every random decision."""
    if slots <= 0:
        return []
    if trigger == "uniform":
        return _uniform(parents, slots, max_depth)
    fires: Callable[[Episode, int], bool]
    if trigger == "random":
        fires = lambda ep, k: rng.random() < p  # noqa: E731
    elif trigger == "tag":
        fires = lambda ep, k: tag in ep.steps[k].action_text  # noqa: E731
    elif trigger == "entropy":
        def fires(ep: Episode, k: int) -> bool:
            dh = step_entropy(ep, k, vocab) - step_entropy(ep, 0, vocab)
            return rng.random() - entropy_weight * dh <= p
    else:
        raise ValueError(f"branch.trigger must be one of {TRIGGERS}, got {trigger!r}")
    out = []
    for i, ep in parents:
        for k in candidates(ep, max_depth):
            if fires(ep, k):
                out.append((i, k))
                if len(out) == slots:
                    return out
    return out


def _uniform(parents: list[tuple[int, Episode]], slots: int, max_depth: int | None) -> list[tuple[int, int]]:
    """``slots`` children over the parents with candidates, round-robin; a parent's ``c`` children at the depths
    ``j / (c + 1)`` (j = 1..c) of its candidate list."""
    able = [(i, candidates(ep, max_depth)) for i, ep in parents]
    able = [(i, ks) for i, ks in able if ks]
    if not able:
        return []
    count = [slots // len(able) + (j < slots % len(able)) for j in range(len(able))]
    out = []
    for (i, ks), c in zip(able, count):
        out += [(i, ks[min(len(ks) - 1, (j + 1) * len(ks) // (c + 1))]) for j in range(c)]
    return out
