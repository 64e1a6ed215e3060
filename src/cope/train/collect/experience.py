"""One epoch's episodes -> training experience: advantages, minibatches, collate transforms.

Plain functions the epoch builder (:mod:`cope.train.collect.epoch_builder`) calls on a collector's episodes (the
epoch's task stream, whose RNG orders the minibatches, comes with them; these own nothing). The order is fixed and
part of what makes a run reproducible:

1. :func:`assign_advantages`: group-relative advantages from the episodes' rewards
   (:func:`cope.train.advantages.group_advantages`; aborted episodes get 0 and leave their group's
   statistics), written to ``Episode.advantage``;
2. :func:`keep_trained`: where the collector trains only some of them (``Collected.trained``: the branching
   collector's dedup and J_max cap), those, with their tree links renumbered;
3. :func:`cut_minibatches`: the episodes shuffled with the caller's RNG, cut into minibatches of
   ``minibatch_size`` (or spread over the count the full epoch would give, ``Collected.nominal``), each collated
   (:func:`cope.batch.collate`) and passed through the collate transforms in registration order (CoPE's forecast
   targets; a transform may widen or extend a batch).

:func:`epoch_metrics` gives the epoch's ``rollout/*``, ``env/*``, ``perf/*`` and ``data/*`` values on this rank, and
:func:`epoch_tally` counts what its ``rollout/*`` and ``env/*`` metrics are ratios or sums of, for the module to pool
over ranks (:attr:`cope.records.EpochRecord.tally`).
"""
from __future__ import annotations

import dataclasses
import random
from collections.abc import Callable, Sequence
from typing import Protocol

import torch

from cope.batch import RolloutBatch, collate
from cope.episode import EndReason, Episode
from cope.rollout.loop import RolloutStats
from cope.rollout.metrics import episode_metrics, episode_tally
from cope.train.advantages import Metrics, group_advantages, zero_signal_groups
from cope.train.collect.branching.node_values import NODE_VALUE, node_value_advantages

CollateTransform = Callable[[RolloutBatch, list[Episode]], RolloutBatch]


class BatchSource(Protocol):
    """Extra training batches of an epoch, trained after its minibatches in optimizer steps of their own (CoPE's
    separate forecast update). Under DDP every rank must take the same number of steps: the DataModule pads a
    rank that has fewer with :meth:`empty` batches (a forward and a zero-gradient backward, so the gradient
    all-reduce of every step still meets on every rank)."""

    def batches(self, episodes: list[Episode]) -> list[RolloutBatch]:
        """This rank's extra batches for the epoch's episodes (possibly none)."""
        ...

    def empty(self) -> RolloutBatch:
        """A batch of the same kind that trains nothing."""
        ...


def assign_advantages(episodes: list[Episode], groups: Sequence[int], mode: str) -> Metrics:
    """Sets ``Episode.advantage`` of every episode from its group's rewards; returns the
    ``rollout/zero_signal_groups`` metric (this rank's share; :func:`epoch_tally` counts it for pooling).
    ``mode="node_value"``: each step its own, ``Episode.step_advantages``, from the group's tree
    (:mod:`cope.train.collect.branching.node_values`; ``Episode.advantage`` then Dr.GRPO's, for the record)."""
    tree = mode == NODE_VALUE
    adv, metrics = group_advantages(
        torch.tensor([e.reward for e in episodes]), torch.tensor(list(groups)), mode="drgrpo" if tree else mode,
        valid=torch.tensor([not e.aborted for e in episodes]),
    )
    steps = node_value_advantages(episodes, groups) if tree else [None] * len(episodes)
    for e, a, s in zip(episodes, adv.tolist(), steps):
        e.advantage, e.step_advantages = a, s
    return metrics


def epoch_metrics(episodes: list[Episode], stats: RolloutStats, seconds: float, env_events: dict[str, int],
                  packed: Sequence[RolloutBatch] = ()) -> dict[str, float]:
    """This rank's metrics of an epoch's rollouts: ``rollout/*`` (:func:`cope.rollout.metrics.episode_metrics`), the env
    runtime's health (``env/errors``, aborted episodes, shrunk groups, and ``env_events``: restarts, timeouts, ... since
    the last epoch), the timings (``perf/*``; ``seconds``: the whole collection) and, for minibatches carrying packed
    rows (``packed``: ``data.share_prefix``), what their rows forward against the rows they stand for (``data/*``)."""
    m = episode_metrics(episodes, prefix="rollout")
    m.update({
        "env/errors": float(stats.env_errors),
        "env/tool_call_errors": float(stats.tool_call_errors),  # native tool calls the loop refused (invalid steps)
        # failures only (Episode.failed): an episode its collector skipped on purpose (SFT) is no env error
        "env/aborted_episodes": float(sum(e.failed for e in episodes)),
        "env/groups_shrunk": float(len({e.group for e in episodes if e.failed})),
        **{f"env/{k}": float(v) for k, v in env_events.items()},
        "perf/rollout_seconds": seconds,
        "perf/tokens_per_s": stats.generated_tokens / max(stats.gen_seconds, 1e-9),
        "perf/env_seconds": stats.env_seconds,
        "perf/adapter_sync_seconds": stats.sync_seconds,
    })
    if packed:  # per pass over the minibatches
        rows = sum(int(mb["attention_mask"].ne(0).sum()) for mb in packed)
        forwarded = sum(mb["packed"].tokens for mb in packed)
        m.update({"data/tokens_forwarded": float(forwarded), "data/shared_fraction": 1.0 - forwarded / max(rows, 1)})
    return m


def epoch_tally(episodes: list[Episode], groups: Sequence[int], metrics: dict[str, float]) -> dict[str, float]:
    """The sums and counts of an epoch that :func:`cope.train.dist.rollout_metrics` turns into its ``rollout/*``
    and ``env/*`` values: ``rollout/<key>`` the episodes' :func:`cope.rollout.metrics.episode_tally`,
    ``adv/zero_signal_groups`` and ``adv/groups`` the groups of :func:`assign_advantages` (same arguments), and
    the ``env/*`` counts of ``metrics`` (the epoch's own, already counts)."""
    zero, total = zero_signal_groups(torch.tensor([e.reward for e in episodes]), torch.tensor(list(groups)),
                                     torch.tensor([not e.aborted for e in episodes], dtype=torch.bool))
    return {**{f"rollout/{k}": v for k, v in episode_tally(episodes).items()},
            "adv/zero_signal_groups": float(zero), "adv/groups": float(total),
            **{k: float(v) for k, v in metrics.items() if k.startswith("env/")}}


def cut_minibatches(episodes: list[Episode], minibatch_size: int, pad_id: int, rng: random.Random,
                    transforms: Sequence[CollateTransform] = (), behaviour: bool = False,
                    count: int | None = None, keep_groups: bool = False) -> list[RolloutBatch]:
    """The episodes in an order drawn from ``rng`` (one shuffle), cut into collated minibatches of at most
    ``minibatch_size`` episodes; every minibatch passes through ``transforms`` in order. ``behaviour``: each
    minibatch carries the sampler's log-probs (``behaviour_logprobs``, :func:`cope.batch.collate`).

    ``count``: exactly that many minibatches instead (a collector that dropped episodes, ``Collected.nominal``: every
    rank takes the optimizer steps of the full epoch, whatever it dropped), the shuffled episodes spread over them in
    runs whose sizes differ by at most one. Where there are fewer episodes than ``count``, each minibatch left over
    holds one row that trains nothing (:func:`idle_row`).

    ``keep_groups``: each GRPO group's episodes kept together in their collection order (the groups in the order the
    shuffle draws them), for the group packing (``data.share_prefix``): a branched group's tree then sits in one
    minibatch, where the packing forwards its shared turns once (a group straddles two minibatches only where dropped
    episodes or the cuts shift it). Otherwise episodes are mixed across groups as in any epoch: a minibatch of whole
    groups sees fewer tasks per optimizer step (on the default demo, 2 of the epoch's 8 with 16 episodes a step)."""
    order = list(range(len(episodes)))
    rng.shuffle(order)
    if keep_groups:
        members: dict[int, list[int]] = {}
        for i in range(len(episodes)):
            members.setdefault(episodes[i].group, []).append(i)
        order = [i for g in dict.fromkeys(episodes[j].group for j in order) for i in members[g]]
    if count is None:
        cuts = [order[s: s + minibatch_size] for s in range(0, len(order), minibatch_size)]
    else:
        if count < 1 or not episodes:
            raise ValueError(f"cut_minibatches: {len(episodes)} episodes cannot fill {count} minibatches")
        q, r = divmod(len(order), count)
        starts = [j * q + min(j, r) for j in range(count + 1)]
        cuts = [order[starts[j]: starts[j + 1]] for j in range(count)]
    minibatches = []
    for idx in cuts:
        if idx:
            mb = collate([episodes[i] for i in idx], pad_id, indices=idx, behaviour=behaviour)
        else:
            mb = collate([idle_row(episodes[order[0]])], pad_id, indices=[-1], behaviour=behaviour)
            mb["aux_row"][:] = True
        for fn in transforms:
            mb = fn(mb, episodes)
        minibatches.append(mb)
    return minibatches


def idle_row(e: Episode) -> Episode:
    """A row that trains nothing, for a minibatch that must exist but has no episode (:func:`cut_minibatches`): ``e``'s
    first prompt only, skipped (``EndReason.SKIPPED``: aborted for every loss, no action, advantage or ECHO target, but
    no failure in the counts), collated as episode -1 and ``aux_row`` (no transcript: no transform or transcript
    objective reads it). Its step is a forward and a zero gradient, so the
    gradient all-reduce of every step still meets on every rank."""
    return Episode(task=e.task, group=e.group, tokens=e.tokens[: e.prompt_len], roles=e.roles[: e.prompt_len],
                   prompt_len=e.prompt_len, end_reason=EndReason.SKIPPED, sampled_epoch=e.sampled_epoch)


def keep_trained(episodes: list[Episode], trained: Sequence[int]) -> list[Episode]:
    """The episodes ``trained`` (ascending indices) as the epoch's episode list: a kept episode's
    ``branch_of`` renumbered into it, and where its parent was dropped, pointing to its nearest kept ancestor with
    ``shared_steps`` the steps it shares with that one (the fewest shared on the way). A renumbered episode is a copy;
    the others are the same objects."""
    new = {old: j for j, old in enumerate(trained)}
    out = []
    for i in trained:
        e = episodes[i]
        parent, shared = e.branch_of, e.shared_steps
        while parent >= 0 and parent not in new:
            up = episodes[parent]
            parent, shared = up.branch_of, min(shared, up.shared_steps)
        parent, shared = (new[parent], shared) if parent >= 0 else (-1, 0)
        if (parent, shared) != (e.branch_of, e.shared_steps):
            e = dataclasses.replace(e, branch_of=parent, shared_steps=shared)
        out.append(e)
    return out


def train_tokens(minibatches: Sequence[RolloutBatch], pad_id: int, passes: int = 1) -> int:
    """Tokens the epoch trains on: every non-pad token of every minibatch, times the passes over them."""
    return sum(int(mb["input_ids"].ne(pad_id).sum()) for mb in minibatches) * passes
