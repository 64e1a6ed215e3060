"""DDP with 2 CPU processes (gloo) through the real entry point; Lightning relaunches `train.py` for rank 1
with the Hydra overrides of the command line. Each rank collects its own groups; the experience counters
are summed over ranks."""
from __future__ import annotations

import pytest

RANKS, EPOCHS, TASKS, GROUP = 2, 2, 2, 4  # debug=fast: max_epochs, tasks_per_epoch, group_size
VAL = 7  # held-out tasks: 4 on rank 0, 3 on rank 1


def _health(epochs: list[list], rule) -> list[dict[str, float]]:
    """The health/* values of each epoch from both ranks' episodes together (``epochs[e]``: (rank, [group, aborted,
    reward, [valid, ...]]) pairs; a group is one rank's), with the stop rules' thresholds of ``rule`` (a RunHealth)."""
    out, streak, learned = [], {"aborted": 0, "zero_signal": 0, "invalid": 0}, None
    for e, eps in enumerate(epochs):
        groups: dict[tuple, set] = {}
        for r, (g, aborted, reward, _) in eps:
            if not aborted:
                groups.setdefault((r, g), set()).add(reward)
        valid = [v for _, (_, aborted, _, steps) in eps if not aborted for v in steps]
        frac = sum(x[1] for _, x in eps) / max(len(eps), 1)
        signal = sum(len(rewards) > 1 for rewards in groups.values())
        rate = valid.count(False) / len(valid) if valid else 0.0
        if learned is None and valid and rate <= rule.healthy_invalid_rate:
            learned = e
        streak = {"aborted": streak["aborted"] + 1 if frac > rule.max_aborted_frac else 0,
                  "zero_signal": streak["zero_signal"] + 1 if signal == 0 else 0,
                  "invalid": streak["invalid"] + 1 if learned is not None and rate > rule.max_invalid_rate else 0}
        out.append({"health/aborted_frac": frac, "health/signal_groups": float(signal), "health/invalid_rate": rate,
                    "health/format_learned": float(learned is not None),
                    **{f"health/{k}_streak": float(v) for k, v in streak.items()}})
    return out


@pytest.mark.long
@pytest.mark.ddp
def test_ddp_two_cpu_ranks(train_script, read_metrics, tmp_path):
    """Also: every epoch metric that pools over ranks (health/*, probe/*, stop/*, pg/adv_balance, rollout/*, env/*,
    val/*) equals the value computed from both ranks' records together (tests/ddp_metrics_trace.py), and no
    sync_dist warning."""
    import json
    import os
    from pathlib import Path

    from cope.algos.stop_stats import stop_metrics
    from cope.callbacks.probes import probe_metrics
    from cope.callbacks.run_health import RunHealth

    tests, run_dir, out = Path(__file__).resolve().parent, tmp_path / "run", tmp_path / "trace"
    pythonpath = os.pathsep.join(p for p in (str(tests), os.environ.get("PYTHONPATH", "")) if p)
    proc = train_script(["debug=fast", "trainer=ddp", "trainer.devices=2", "trainer.accelerator=cpu",
                         f"hydra.run.dir={run_dir}", "+callbacks.metrics_trace._target_=ddp_metrics_trace.MetricsTrace",
                         # a warm-started model finishes some mazes: the ranks' episodes differ in length, and an odd
                         # panel gives the ranks 4 and 3 held-out tasks, so a mean of per-rank ratios is not global
                         "model.warm_start_steps=150", "env.sizes=[5]", "env.min_distance=1", f"data.val_tasks={VAL}",
                         f"+callbacks.metrics_trace.out={out}"], tmp_path, timeout=300, env={"PYTHONPATH": pythonpath})
    report = f"exit {proc.returncode}\n--- stdout ---\n{proc.stdout[-3000:]}\n--- stderr ---\n{proc.stderr[-5000:]}"
    assert proc.returncode == 0, report
    assert "Starting with 2 processes" in proc.stderr + proc.stdout, report
    assert "GLOBAL_RANK: 1" in proc.stderr + proc.stdout, report
    assert (run_dir / "checkpoints" / "last.ckpt").is_file() and (run_dir / "csv" / "adapter" / "adapter_model.safetensors").is_file()
    cols = read_metrics(run_dir / "csv" / "metrics.csv")
    # cumulative episodes after epoch e, summed over both ranks
    assert cols["counters/episodes"] == [RANKS * TASKS * GROUP * (e + 1) for e in range(EPOCHS)], report
    assert cols["counters/env_steps"][-1] >= cols["counters/episodes"][-1]
    # StopTokenStats pools its sums over the ranks (one collective per epoch and per validation run)
    assert len(cols["stop/prob"]) == EPOCHS and len(cols["stop/prob_val"]) == EPOCHS + 1, report
    # rank 0 alone prints the summary, with the summed count
    assert proc.stdout.count("=== cope-trainer run summary ===") == 1, report
    assert f"episodes {RANKS * TASKS * GROUP * EPOCHS}," in proc.stdout, report
    # Lightning warns about an epoch metric logged without sync_dist (it cannot tell a global value from a rank's own)
    assert "when logging on epoch level in distributed setting" not in proc.stdout + proc.stderr, report

    rows = [[json.loads(x) for x in (out / f"rank{r}.jsonl").read_text().splitlines()] for r in range(RANKS)]
    train = [[x for x in rank if "train" in x] for rank in rows]
    val = [[x for x in rank if "val" in x] for rank in rows]
    assert [len(t) for t in train] == [EPOCHS] * RANKS and [len(v) for v in val] == [EPOCHS + 1] * RANKS, rows

    def summed(tallies: list[dict]) -> dict:
        return {k: sum(t[k] for t in tallies) for k in tallies[0]}

    expected: dict[str, list[float]] = {}
    for e in range(EPOCHS):
        for k, v in {**_health([[(r, x) for r in range(RANKS) for x in train[r][i]["episodes"]] for i in range(e + 1)],
                               RunHealth())[e],
                     **stop_metrics(summed([train[r][e]["stop"] for r in range(RANKS)]))}.items():
            expected.setdefault(k, []).append(v)
    for e in range(EPOCHS + 1):
        m = stop_metrics(summed([val[r][e]["stop_val"] for r in range(RANKS)]))
        for k, v in {**probe_metrics(summed([val[r][e]["probe"] for r in range(RANKS)])),
                     "stop/prob_val": m["stop/prob"], "stop/positions_val": m["stop/positions"]}.items():
            expected.setdefault(k, []).append(v)
    logged = {k: v for k, v in cols.items() if k.split("/")[0] in ("health", "probe", "stop") or k == "pg/adv_balance"}
    assert set(logged) == set(expected), (sorted(logged), sorted(expected))
    for k in expected:
        assert logged[k] == pytest.approx(expected[k], rel=1e-5, abs=1e-6), (k, logged[k], expected[k])
    # the premise: rank 0's own values are not the global ones, so a rank-0 (or mean-of-ratios) metric would fail above
    rank0 = {**stop_metrics(train[0][-1]["stop"]), **probe_metrics(val[0][-1]["probe"])}
    assert any(abs(rank0[k] - expected[k][-1]) > 1e-4 for k in ("stop/prob", "pg/adv_balance", "probe/obs_nll")), rank0
    _check_episode_metrics(cols, train, val)


def _check_episode_metrics(cols: dict, train: list[list[dict]], val: list[list[dict]]) -> None:
    """rollout/*, env/* and val/* of every epoch equal the values of both ranks' episodes together (env/*: the sum of
    the ranks' counts), and a mean over ranks of the ranks' own ratios (the old reduction) would not."""
    import torch
    from ddp_metrics_trace import episode

    from cope.rollout.metrics import episode_metrics
    from cope.train.advantages import group_advantages

    def eps_of(rows: list[dict], r: int) -> list:
        return [episode(d, r * 1000 + d["group"]) for d in rows[r]["full"]]  # a group is one rank's

    expected: dict[str, list[float]] = {}
    mean_of_ratios: dict[str, list[float]] = {}
    for e in range(EPOCHS):
        eps = [x for r in range(RANKS) for x in eps_of([train[r][e] for r in range(RANKS)], r)]
        _, adv = group_advantages(torch.tensor([x.reward for x in eps]), torch.tensor([x.group for x in eps]),
                                  valid=torch.tensor([not x.aborted for x in eps]))
        env = {k: sum(train[r][e]["env"][k] for r in range(RANKS)) for k in train[0][e]["env"]}
        for k, v in {**episode_metrics(eps, "rollout"), **adv, **env}.items():
            expected.setdefault(k, []).append(float(v))
        own = [episode_metrics(eps_of([train[r][e] for r in range(RANKS)], r), "rollout") for r in range(RANKS)]
        for k in own[0]:
            mean_of_ratios.setdefault(k, []).append(sum(m[k] for m in own) / RANKS)
    for e in range(EPOCHS + 1):
        per_rank = [eps_of([val[r][e] for r in range(RANKS)], r) for r in range(RANKS)]
        assert [len(p) for p in per_rank] == [4, 3], [len(p) for p in per_rank]
        for k, v in episode_metrics(per_rank[0] + per_rank[1], "val").items():
            expected.setdefault(k, []).append(v)
        own = [episode_metrics(p, "val") for p in per_rank]  # Lightning's old mean, weighted by the ranks' episodes
        for k in own[0]:
            mean_of_ratios.setdefault(k, []).append(sum(m[k] * len(p) for m, p in zip(own, per_rank)) / VAL)
    logged = {k: v for k, v in cols.items() if k.split("/")[0] in ("rollout", "env", "val")}
    assert set(logged) == set(expected), (sorted(logged), sorted(expected))
    for k in expected:
        assert logged[k] == pytest.approx(expected[k], rel=1e-5, abs=1e-6), (k, logged[k], expected[k])

    def differs(k: str) -> bool:
        return any(abs(a - b) > 1e-5 * max(1.0, abs(b)) for a, b in zip(mean_of_ratios[k], expected[k]))

    # the premise: the ranks' own ratios differ, so the old reduction fails above in both families
    assert any(differs(k) for k in mean_of_ratios if k.startswith("rollout/")), (mean_of_ratios, expected)
    assert any(differs(k) for k in mean_of_ratios if k.startswith("val/")), (mean_of_ratios, expected)


@pytest.mark.long
@pytest.mark.ddp
def test_ddp_ranks_drop_the_same_steps_past_the_trust_region(train_script, read_metrics, tmp_path):
    """module.max_approx_kl under DDP, on lagged batches: a run whose trust region trips keeps both ranks' adapters equal
    after every step (the KL is averaged over ranks before the decision). Here both ranks' own KLs pass this small limit
    at the same step, so the run would also agree without the average: it checks the collective and the dropped steps
    under two processes, not ranks whose KLs straddle the limit. ``data.max_lag=1``: each rank collects the next epoch
    in its own thread (its sampler copy) while the ranks train in step; the records and their all-reduces stay in the
    main threads."""
    import json
    import os
    from pathlib import Path

    tests, run_dir, out = Path(__file__).resolve().parent, tmp_path / "run", tmp_path / "trace"
    pythonpath = os.pathsep.join(p for p in (str(tests), os.environ.get("PYTHONPATH", "")) if p)
    # algo=cope_continuation: its joint forecast rows ride in the policy steps, and its forecast/* epoch metrics are
    # pooled over the ranks (no sync_dist warning below)
    proc = train_script(["debug=fast", "trainer=ddp", "trainer.devices=2", "trainer.accelerator=cpu", f"hydra.run.dir={run_dir}",
                         "algo=cope_continuation", "module.max_approx_kl=1e-4", "data.minibatch_size=2", "trainer.max_epochs=3",
                         "module.optimizer.lr=1e-2", "data.max_lag=1",
                         "model.warm_start_steps=150", "env.sizes=[5]", "env.min_distance=1", "validate_before_fit=false",
                         "+callbacks.trace._target_=ddp_trace.DDPTrace", f"+callbacks.trace.out={out}"],
                        tmp_path, timeout=600, env={"PYTHONPATH": pythonpath})
    assert proc.returncode == 0, proc.stderr[-5000:]
    assert "when logging on epoch level in distributed setting" not in proc.stdout + proc.stderr, proc.stderr[-5000:]
    adapters = [[json.loads(x)["adapter"] for x in (out / f"rank{r}.jsonl").read_text().splitlines() if '"adapter"' in x]
                for r in range(RANKS)]
    assert adapters[0] == adapters[1] and len(adapters[0]) == 3 * 4, adapters  # 4 steps an epoch on each rank
    cols = read_metrics(run_dir / "csv" / "metrics.csv")
    assert len(cols["forecast/targets"]) == 3, cols.get("forecast/targets")  # logged every epoch, pooled
    stopped = cols["train/kl_stopped"]
    assert 1.0 in stopped and 0.0 in stopped[4:], stopped  # the premise: a trip, and an epoch stepping after it
    assert cols["rollout/lag_mean"] == [0.0, 1.0, 1.0] and "policy/behaviour_weight_mean" in cols
