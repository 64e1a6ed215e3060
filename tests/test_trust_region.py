"""module.max_approx_kl: once a minibatch measures the policy further than the limit from the one that sampled the
epoch, that policy step and the epoch's later ones are not taken (the later ones not even forwarded); the next epoch
starts afresh (its first step always runs: its rollouts come from the policy as it is). CoPE's separate forecast steps
are not policy-gradient steps and run."""
from __future__ import annotations

import csv

import pytest
import torch

from cope.run.config_check import ConfigError

LIMIT, STEPS_PER_EPOCH, EPOCHS = 1e-4, 4, 3
RUN = [f"module.max_approx_kl={LIMIT}", "data.tasks_per_epoch=4", "data.minibatch_size=4", f"trainer.max_epochs={EPOCHS}",
       "validate_before_fit=false", "module.optimizer.lr=1e-2",
       "model.warm_start_steps=150", "env.sizes=[5]", "env.min_distance=1"]  # a reward spread: the policy moves
SKIPPED_KEYS = {"train/kl_stopped", "train/kl_stopped_steps", "train/skipped_steps", "epoch", "step"}


def test_a_bad_limit_names_the_key(compose, tmp_path):
    from cope.run.train import train

    with pytest.raises((ConfigError, ValueError), match=r"module\.max_approx_kl"):
        train(compose(["module.max_approx_kl=0", "trainer.max_epochs=1", "validate_before_fit=false"], tmp_path))


def test_the_region_drops_the_rest_of_the_epoch_that_tripped_it_and_counts_each_dropped_step():
    from cope.train.step.trust_region import TrustRegion

    region = TrustRegion(0.1)
    region.measure(0.1, epoch=0, step=0)  # at the limit: inside
    assert not region.stops(0) and region.open(0)
    region.measure(0.2, epoch=0, step=1)
    assert [region.stops(0) for _ in range(3)] == [True] * 3 and region.stopped_steps == 3
    region.measure(0.0, epoch=0, step=2)  # a later measure does not reopen the epoch
    assert region.stops(0) and not region.stops(1) and region.stopped_steps == 4  # the next epoch starts afresh
    off = TrustRegion(None)
    off.measure(1e9, epoch=0, step=0)
    assert not off.on and not off.stops(0) and off.stopped_steps == 0
    for bad in (0, -1.0, float("nan")):
        with pytest.raises(ValueError, match=r"module\.max_approx_kl"):
            TrustRegion(bad)


@pytest.mark.long
def test_steps_past_the_limit_are_not_taken_and_every_epoch_starts_afresh(run_train, read_metrics, tmp_path):
    run_train(RUN, tmp_path / "on")
    cols = read_metrics(tmp_path / "on" / "csv" / "metrics.csv")
    kl, stopped = cols["policy/approx_kl"], cols["train/kl_stopped"]
    assert len(stopped) == EPOCHS * STEPS_PER_EPOCH
    expected, taken, at = [], 0, 0
    for e in range(EPOCHS):
        epoch_stopped = stopped[e * STEPS_PER_EPOCH:(e + 1) * STEPS_PER_EPOCH]
        first = epoch_stopped.index(1.0) if 1.0 in epoch_stopped else STEPS_PER_EPOCH
        measured = kl[at:at + min(first + 1, STEPS_PER_EPOCH)]  # the steps taken and the one that tripped: forwarded
        at += len(measured)
        assert measured[0] < LIMIT  # an epoch's first step: the policy is the rollouts' (its KL is 0 up to rounding)
        assert all(v <= LIMIT for v in measured[:first]) and (first == STEPS_PER_EPOCH or measured[first] > LIMIT), measured
        expected += [0.0] * first + [1.0] * (STEPS_PER_EPOCH - first)
        taken += first
    assert at == len(kl), "a step past the trip logged a KL: it was forwarded"
    assert stopped == expected, (kl, stopped)
    assert 0 < sum(expected) and 0.0 in expected[STEPS_PER_EPOCH:], "the premise: the limit stopped steps and an epoch after it stepped"
    assert cols["train/kl_stopped_steps"][-1] == sum(expected)
    ckpt = torch.load(tmp_path / "on" / "checkpoints" / "last.ckpt", weights_only=False)
    assert ckpt["global_step"] == taken and ckpt["kl_stopped_steps"] == sum(expected)  # a stopped step is no optimizer step
    # CoPE's separate forecast steps (no importance ratio) still run after a trip: every one of them is an optimizer step
    run_train(["algo=cope", *RUN], tmp_path / "cope")
    cope = read_metrics(tmp_path / "cope" / "csv" / "metrics.csv")
    forecast_steps, policy_taken = len(cope["forecast/grad_norm"]), cope["train/kl_stopped"].count(0.0)
    assert forecast_steps > 0 and 1.0 in cope["train/kl_stopped"], cope["train/kl_stopped"]
    assert torch.load(tmp_path / "cope" / "checkpoints" / "last.ckpt", weights_only=False)["global_step"] == policy_taken + forecast_steps


def _rows(path) -> list[dict[str, float]]:
    """metrics.csv as its rows, each with its non-empty values."""
    with open(path, newline="") as f:
        return [{k: float(v) for k, v in r.items() if v not in (None, "")} for r in csv.DictReader(f)]


@pytest.mark.long
def test_a_stopped_epoch_forwards_no_more_policy_minibatches_and_trains_as_before(run_train, tmp_path, monkeypatch):
    """CoPE with its separate forecast steps: past an epoch's trip, its policy minibatches are not forwarded (its forecast
    steps are), and the run ends where forwarding them and dropping their gradients ended: the same adapter, optimizer
    moments and counts, bit for bit, after later epochs that stepped; every logged value the same, the skipped steps'
    rows holding only the trust region's counts."""
    from cope.train.module import AgentRLModule
    from cope.train.objectives import ROLLOUT, batch_kind
    from cope.train.step.trust_region import kl_stop

    forwarded, backward = [], AgentRLModule._backward

    def counting(self, batch):
        forwarded.append(batch_kind(batch))
        return backward(self, batch)

    monkeypatch.setattr(AgentRLModule, "_backward", counting)
    runs = {}
    for name in ("skip", "forward_and_drop"):
        if name == "forward_and_drop":  # the path before the skip: a stopped step is forwarded, then its gradient dropped
            monkeypatch.setattr("cope.train.module.kl_stop",
                                lambda module, kind, metrics=None: metrics is not None and kl_stop(module, kind, metrics))
        forwarded.clear()
        run_train(["algo=cope", *RUN], tmp_path / name)
        ckpt = torch.load(tmp_path / name / "checkpoints" / "last.ckpt", weights_only=False)
        runs[name] = list(forwarded), _rows(tmp_path / name / "csv" / "metrics.csv"), ckpt
    (fwd, rows, ckpt), (fwd_old, rows_old, ckpt_old) = runs["skip"], runs["forward_and_drop"]

    policy = [r for r in rows if "train/kl_stopped" in r]
    skipped = [r for r in policy if "loss/total" not in r]
    assert len(policy) == EPOCHS * STEPS_PER_EPOCH and skipped and all(r["train/kl_stopped"] == 1.0 for r in skipped)
    assert [r["epoch"] for r in policy if r["train/kl_stopped"] == 0.0][-1] > skipped[0]["epoch"], "premise: a later epoch stepped"
    assert fwd.count(ROLLOUT) == len(policy) - len(skipped) and fwd_old.count(ROLLOUT) == len(policy)  # skipped: not forwarded
    assert 0 < fwd.count("forecast") == fwd_old.count("forecast")  # the forecast steps all ran

    assert len(rows) == len(rows_old)
    for i, (new, old) in enumerate(zip(rows, rows_old)):
        old = {k: v for k, v in old.items() if not k.startswith("perf/")}  # timings
        new = {k: v for k, v in new.items() if not k.startswith("perf/")}
        if "train/kl_stopped" in new and "loss/total" not in new:  # a skipped step
            assert set(new) == SKIPPED_KEYS and old["train/kl_stopped"] == 1.0, (i, new)
            old = {k: old[k] for k in SKIPPED_KEYS}
        assert new == old, i

    for key in ("global_step", "kl_stopped_steps", "skipped_steps"):
        assert ckpt[key] == ckpt_old[key], key
    assert ckpt["state_dict"].keys() == ckpt_old["state_dict"].keys()
    for k, w in ckpt_old["state_dict"].items():
        assert torch.equal(ckpt["state_dict"][k], w), k
    moments, moments_old = ckpt["optimizer_states"][0]["state"], ckpt_old["optimizer_states"][0]["state"]
    assert moments.keys() == moments_old.keys() and moments
    for i, state in moments_old.items():
        assert all(torch.equal(torch.as_tensor(moments[i][k]), torch.as_tensor(v)) for k, v in state.items()), i
