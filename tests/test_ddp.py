"""DDP with 2 CPU processes (gloo) through the real entry point; Lightning relaunches `train.py` for rank 1
with the Hydra overrides of the command line. Each rank collects its own groups; the experience counters
are summed over ranks."""
from __future__ import annotations

import pytest

RANKS, EPOCHS, TASKS, GROUP = 2, 2, 2, 4  # debug=fast: max_epochs, tasks_per_epoch, group_size


@pytest.mark.long
@pytest.mark.ddp
def test_ddp_two_cpu_ranks(train_script, read_metrics, tmp_path):
    run_dir = tmp_path / "run"
    proc = train_script(["debug=fast", "trainer=ddp", "trainer.devices=2", "trainer.accelerator=cpu",
                         f"hydra.run.dir={run_dir}"], tmp_path, timeout=300)
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


@pytest.mark.long
@pytest.mark.ddp
def test_ddp_ranks_drop_the_same_steps_past_the_trust_region(train_script, read_metrics, tmp_path):
    """module.max_approx_kl under DDP: a run whose trust region trips keeps both ranks' adapters equal after every step
    (the KL is averaged over ranks before the decision). Here both ranks' own KLs pass this small limit at the same
    step, so the run would also agree without the average: it checks the collective and the dropped steps under two
    processes, not ranks whose KLs straddle the limit."""
    import json
    import os
    from pathlib import Path

    tests, run_dir, out = Path(__file__).resolve().parent, tmp_path / "run", tmp_path / "trace"
    pythonpath = os.pathsep.join(p for p in (str(tests), os.environ.get("PYTHONPATH", "")) if p)
    proc = train_script(["debug=fast", "trainer=ddp", "trainer.devices=2", "trainer.accelerator=cpu", f"hydra.run.dir={run_dir}",
                         "module.max_approx_kl=1e-4", "data.minibatch_size=2", "trainer.max_epochs=3", "module.optimizer.lr=1e-2",
                         "model.warm_start_steps=150", "env.sizes=[5]", "env.min_distance=1", "validate_before_fit=false",
                         "+callbacks.trace._target_=ddp_trace.DDPTrace", f"+callbacks.trace.out={out}"],
                        tmp_path, timeout=600, env={"PYTHONPATH": pythonpath})
    assert proc.returncode == 0, proc.stderr[-5000:]
    adapters = [[json.loads(x)["adapter"] for x in (out / f"rank{r}.jsonl").read_text().splitlines() if '"adapter"' in x]
                for r in range(RANKS)]
    assert adapters[0] == adapters[1] and len(adapters[0]) == 3 * 4, adapters  # 4 steps an epoch on each rank
    stopped = read_metrics(run_dir / "csv" / "metrics.csv")["train/kl_stopped"]
    assert 1.0 in stopped and 0.0 in stopped[4:], stopped  # the premise: a trip, and an epoch stepping after it
