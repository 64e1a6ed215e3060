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
