"""Episode metrics as tallies: the same values as before in one process, and the global ratios when tallies of
several processes are summed (what the module logs under DDP)."""
from __future__ import annotations

import random

import pytest
import torch

from cope.envs.base import Task
from cope.episode import EndReason, Episode, Step
from cope.rollout.metrics import episode_metrics, episode_tally, tally_metrics
from cope.train.advantages import group_advantages
from cope.train.collect.experience import epoch_tally
from cope.train.dist import log_rollout_metrics, rollout_metrics


def _episodes(seed: int, n: int, max_steps: int) -> list[Episode]:
    """``n`` episodes with random steps (1..max_steps), validity, projection, caps, rewards and end reasons."""
    rng = random.Random(seed)
    eps = []
    for i in range(n):
        steps = [Step(action_start=0, action_end=1, closed=rng.random() < 0.8, valid=rng.random() < 0.6,
                      action_text="a", projected=rng.random() < 0.3) for _ in range(rng.randint(1, max_steps))]
        end = rng.choice([EndReason.DONE, EndReason.DONE, EndReason.CONTEXT, EndReason.ABORTED])
        eps.append(Episode(Task("maze", "train", i), group=i // 2, tokens=[1] * rng.randint(3, 40), steps=steps,
                           reward=rng.choice([0.0, 0.25, 1.0]), success=rng.random() < 0.4, score=rng.random(),
                           end_reason=end))
    return eps


def _reference(eps: list[Episode], prefix: str) -> dict[str, float]:
    """episode_metrics as it was written before the tally (means over the list), kept to pin its values."""
    ok = [e for e in eps if not e.aborted]
    n, steps = max(len(ok), 1), sum(e.num_steps for e in ok)
    per_step = {"invalid_rate": lambda s: not s.valid, "projected_actions": lambda s: s.projected,
                "strict_valid": lambda s: s.strict, "multi_action": lambda s: s.multi_action,
                "action_cap": lambda s: not s.closed}
    return {f"{prefix}/success": sum(e.success for e in ok) / n, f"{prefix}/reward": sum(e.reward for e in ok) / n,
            f"{prefix}/score": sum(e.score for e in ok) / n, f"{prefix}/len": steps / n,
            f"{prefix}/tokens": sum(len(e.tokens) for e in ok) / n,
            **{f"{prefix}/{k}": sum(f(s) for e in ok for s in e.steps) / max(steps, 1) for k, f in per_step.items()},
            f"{prefix}/truncated": sum(e.truncated for e in eps) / max(len(eps), 1),
            f"{prefix}/aborted": sum(e.aborted for e in eps) / max(len(eps), 1)}


@pytest.mark.parametrize("seed", range(5))
def test_episode_metrics_unchanged_bit_for_bit(seed):
    eps = _episodes(seed, 7, 6)
    assert episode_metrics(eps, "val") == _reference(eps, "val")  # exact: same sums, same divisions
    assert episode_metrics([], "rollout") == _reference([], "rollout")


def test_summed_tallies_give_the_ratios_of_all_episodes_not_a_mean_of_ratios():
    a, b = _episodes(1, 2, 2), _episodes(2, 9, 8)  # different step counts per "rank"
    summed = {k: episode_tally(a)[k] + episode_tally(b)[k] for k in episode_tally(a)}
    pooled, whole = tally_metrics(summed, "rollout"), _reference(a + b, "rollout")
    assert pooled == pytest.approx(whole, rel=1e-12)
    mean_of_ratios = {k: (episode_metrics(a, "rollout")[k] + episode_metrics(b, "rollout")[k]) / 2 for k in whole}
    assert abs(mean_of_ratios["rollout/invalid_rate"] - whole["rollout/invalid_rate"]) > 1e-3  # the premise


def test_epoch_tally_gives_the_epoch_metrics_of_one_process():
    eps = _episodes(3, 12, 5)
    groups = [e.group for e in eps]
    _, adv = group_advantages(torch.tensor([e.reward for e in eps]), torch.tensor(groups),
                              valid=torch.tensor([not e.aborted for e in eps]))
    metrics = {**episode_metrics(eps, "rollout"), **adv, "env/errors": 2.0, "env/restarts": 1.0, "perf/x": 3.0}
    got = rollout_metrics(epoch_tally(eps, groups, metrics))
    assert set(got) == set(metrics) - {"perf/x"}
    for k, v in got.items():  # zero_signal_groups: float32 mean vs exact share, equal once logged (float32)
        assert torch.tensor(v, dtype=torch.float32) == torch.tensor(metrics[k], dtype=torch.float32), k
    assert 0.0 < got["rollout/zero_signal_groups"] < 1.0  # both kinds of group present


def test_log_rollout_metrics_reduces_a_maximum_with_max_and_the_rest_with_the_mean():
    logged = []

    class Module:  # what log_rollout_metrics calls of a LightningModule (no tally: nothing to pool)
        def log_dict(self, metrics, **kw):
            logged.append((dict(metrics), kw.get("reduce_fx", "mean"), kw["sync_dist"]))

    metrics = {"rollout/logprob_gap": 0.1, "rollout/logprob_gap_max": 0.4, "perf/rollout_seconds": 2.0}
    log_rollout_metrics(Module(), metrics, {})
    by_fx = {fx: m for m, fx, sync in logged if m and sync}
    assert by_fx == {"mean": {"rollout/logprob_gap": 0.1, "perf/rollout_seconds": 2.0},
                     "max": {"rollout/logprob_gap_max": 0.4}}
