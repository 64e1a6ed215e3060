"""Every algo config, and each CoPE ablation override, trains 2 epochs end to end and logs its objective.
`algo=echo` and plain `algo=cope` train inside `algo=cope_echo` (both objectives, each asserted), and plain
`algo=cope_continuation` inside `cont-invalid=mask` (its defaults plus every episode a source), so they get no run
of their own.

With debug=fast the cold-start policy makes only invalid moves and never succeeds, so plain `algo=cope`
has no forecast samples (`forecast/samples` is logged as 0) and takes no forecast step. The runs of the
authors' method that must train add a warm-started maze the policy sometimes solves and `cope.gate=all`; the
continuation ablations (`algo=cope_continuation`) add `cope.gate=all` (every episode counts as a target
source) so that the ablated code paths actually build and score forecast chunks."""
from __future__ import annotations

import math

import pytest
from safetensors.torch import load_file

# every episode a target source, and invalid actions kept as targets (the cold-start actions are all invalid)
FORCE_TARGETS = ["cope.gate=all", "cope.invalid=keep"]
COPE_KEYS = ("loss/forecast", "forecast/targets")
AUTHORS_KEYS = ("forecast/samples", "forecast/trajectories", "forecast/k_mean")
# a maze a 150-step warm start solves now and then: valid actions and wins, so the authors' samples exist
LEARNS = ["model.warm_start_steps=150", "env.sizes=[5]", "env.min_distance=1", "cope.gate=all"]
CONT = "algo=cope_continuation"
CASES = {
    # id: (overrides, keys that must be logged)
    "grpo": (["algo=grpo"], ("loss/pg",)),
    "empg": (["algo=empg"], ("loss/pg", "empg/scale_mean")),
    "cope_echo": (["algo=cope_echo"], ("loss/pg", *AUTHORS_KEYS, "loss/echo")),
    "cope-separate": (["algo=cope", *LEARNS], ("loss/pg", "loss/forecast", "forecast/grad_norm", *AUTHORS_KEYS)),
    "cope-joint": (["algo=cope", "cope.update=joint", *LEARNS], ("loss/pg", "loss/forecast", *AUTHORS_KEYS)),
    "cope-turns-mask": (["algo=cope", "cope.layout=turns", "cope.invalid=mask", *LEARNS], ("loss/forecast", *AUTHORS_KEYS)),
    "cope-te-cold": (["algo=cope", "cope.te.weight=0.1", "cope.te.warmup_steps=0"], AUTHORS_KEYS),  # no sample: no member
    "cope-te": (["algo=cope", "cope.te.weight=0.1", "cope.te.warmup_steps=0", *LEARNS],
                ("loss/te", "te/kl", "te/members_per_action", "te/positions", *AUTHORS_KEYS)),
    # invalid=mask (default) with every episode a source: all-invalid chunks give no targets
    "cont-invalid=mask": ([CONT, "cope.gate=all"], COPE_KEYS),
    "cont-invalid=keep": ([CONT, *FORCE_TARGETS], COPE_KEYS),
    "cont-normalize=none": ([CONT, "cope.normalize=none", *FORCE_TARGETS], COPE_KEYS),
    "cont-normalize=per_step": ([CONT, "cope.normalize=per_step", *FORCE_TARGETS], COPE_KEYS),
    "cont-K=1": ([CONT, "cope.K=1", *FORCE_TARGETS], COPE_KEYS),
    "cont-packing=plain": ([CONT, "cope.packing=plain", *FORCE_TARGETS], COPE_KEYS),
}
EPISODES = 2 * 2 * 4  # epochs * tasks_per_epoch * group_size (debug=fast)


PARAMS = list(CASES)


@pytest.mark.long
@pytest.mark.parametrize("case", PARAMS)
def test_algo_trains_and_logs(case, run_train, read_metrics, tmp_path):
    overrides, keys = CASES[case]
    result = run_train([*overrides, "trainer.max_epochs=2"], tmp_path)
    assert result["counters/episodes"] == EPISODES
    cols = read_metrics(tmp_path / "csv" / "metrics.csv")
    missing = [k for k in keys if not cols.get(k)]
    assert not missing, f"{case}: no values for {missing}; logged {sorted(cols)}"
    for k in keys:
        assert all(math.isfinite(v) for v in cols[k]), (k, cols[k])
    assert len(cols["loss/total"]) == 2  # one optimizer step per epoch (8 episodes, minibatch 8)

    lora_b = [v for k, v in load_file(str(tmp_path / "csv" / "adapter" / "adapter_model.safetensors")).items() if "lora_B" in k]
    moved = any(v.abs().sum() > 0 for v in lora_b)  # lora_B starts at zero

    if "loss/echo" in keys:  # observation tokens exist in every episode: the echo term always has a gradient
        assert all(v > 0 for v in cols["loss/echo"]), cols["loss/echo"]
        assert moved, "echo loss > 0 but the exported adapter never moved"
    if "empg/scale_mean" in keys:
        assert all(v >= 0 for v in cols["empg/scale_mean"])
    if all(o in overrides for o in FORCE_TARGETS):
        assert all(v > 0 for v in cols["forecast/targets"]), cols["forecast/targets"]
        assert all(v == 0 for v in cols["forecast/masked_frac"]), cols["forecast/masked_frac"]
        assert all(v > 0 for v in cols["forecast/raw"]), cols["forecast/raw"]
        assert moved, "forecast targets on unmasked actions but the adapter never moved"
        check_ablation(case, cols)
    elif case == "cont-invalid=mask" and all(v == 1.0 for v in cols["rollout/invalid_rate"]):
        assert all(v == 8 for v in cols["forecast/episodes"]), cols["forecast/episodes"]  # every episode a source
        assert all(v == 0 for v in cols["forecast/targets"]), cols["forecast/targets"]
        assert all(v == 0 for v in cols["loss/forecast"]), cols["loss/forecast"]
    elif "forecast/targets" in keys and not any(cols["forecast/targets"]):  # cold start: no successful episode
        assert all(v == 0 for v in cols["loss/forecast"]), cols["loss/forecast"]
    if case == "cope_echo":  # cold start: no sample, so no forecast step
        assert cols["forecast/samples"] == [0.0, 0.0] and not cols.get("forecast/grad_norm"), cols["forecast/samples"]
    if case == "cope-separate":  # one forecast step per minibatch of 16 samples, after the epoch's policy step
        steps = [math.ceil(n / 16) for n in cols["forecast/samples"]]
        assert all(n > 0 for n in cols["forecast/samples"]) and len(cols["forecast/grad_norm"]) == sum(steps), cols
        assert moved and all(v > 0 for v in cols["loss/forecast"])
    if case == "cope-te":  # earlier forecasts of the epoch's actions: members, a KL that trains
        assert max(cols["te/positions"]) > 0 and max(cols["te/members_per_action"]) >= 1 and max(cols["te/kl"]) > 0, cols
    if case == "cope-joint":  # summed into the policy step: no step of its own
        assert all(n > 0 for n in cols["forecast/samples"]) and not cols.get("forecast/grad_norm")


def check_ablation(case: str, cols: dict[str, list[float]]) -> None:
    if case == "cont-K=1":  # one action per chunk: every action supervised by exactly one chunk
        assert all(v == 1.0 for v in cols["forecast/ensemble_size"]), cols["forecast/ensemble_size"]
    else:  # K=3: actions inside an episode are covered by several overlapping chunks
        assert all(v > 1.0 for v in cols["forecast/ensemble_size"]), cols["forecast/ensemble_size"]
    if case.startswith("cont-normalize="):
        # none / per_step: no adaptive balancing, the forecast term enters unscaled
        assert all(v == 1.0 for v in cols["forecast/scale"]), cols["forecast/scale"]
        assert cols["loss/forecast"] == cols["forecast/raw"]
