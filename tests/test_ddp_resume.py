"""Two DDP ranks (gloo, CPU) after a resume: each rank collects its own experience, as in the uninterrupted run.

Checkpoints are written by rank 0; a task-stream RNG state carried in them was restored on every rank, so after
the first resume all ranks sampled the same tasks with the same seeds (N times the cost for the work of one,
and nothing failed). Now every stream is derived from (seed, rank, epoch) (``cope.train.seeding``). The test runs
the same 2-process job straight through and killed with SIGKILL at the start of epoch 2 (after the epoch-1
checkpoint), then resumed; per rank and epoch the tasks and sampled tokens must equal the straight run's, the
two ranks must differ, both ranks hold the same adapter after every step, the final adapter is the straight
run's, bit for bit, and so is metrics.csv, row for row (wall-clock columns aside). The CoPE case is killed earlier,
right after the epoch-1 checkpoint was written and before Lightning logged epoch 1's row: rank 0 logs that row from
the checkpoint when the run resumes (``callbacks/checkpoint.py``). With GRPO, with CoPE under micro-batching with
shared prefixes (its separate steps and the GRPO groups, ``data.share_prefix``), and with full fine-tuning (KL to
the frozen reference) under ``trainer=fsdp`` writing sharded (torch distributed) checkpoints."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from conftest import metric_rows

TESTS = Path(__file__).resolve().parent
EPOCHS, KILL_AT = 4, 2
# a maze the warm-started tiny model solves now and then (a reward spread: the policy gradient is not 0)
LEARNS = ["model.warm_start_steps=150", "env.sizes=[5]", "env.min_distance=1"]
CASES = {"grpo": ["algo=grpo", *LEARNS],
         # both shared-prefix paths (the separate forecast steps' rows; data.share_prefix's packed groups) micro-batched
         "cope_microbatched": ["algo=cope", "cope.gate=all", "module.max_tokens_per_microbatch=300", "data.share_prefix=true",
                               *LEARNS],
         # sharded full fine-tuning (every weight, the KL to the frozen reference copy), its checkpoint a torch
         # distributed checkpoint folder (each rank's shards)
         "fsdp_full_distributed_checkpoint": ["algo=grpo", "model.finetune=full", "algo.objectives.kl.weight=0.05",
                                              "module.optimizer.lr=1e-4", "trainer=fsdp",
                                              "trainer.strategy.distributed_checkpoint=true", *LEARNS]}


def _read(out: Path, rank: int) -> tuple[dict[int, dict], dict[int, str]]:
    epochs, steps = {}, {}
    for line in (out / f"rank{rank}.jsonl").read_text().splitlines():
        row = json.loads(line)
        if "epoch" in row:
            epochs[row["epoch"]] = row
        else:
            steps[row["step"]] = row["adapter"]
    return epochs, steps


# the cases killed right after epoch KILL_AT - 1's checkpoint, before its metrics row was logged; the others die at
# the start of epoch KILL_AT
KILLED_AFTER_CHECKPOINT = {"cope_microbatched"}


def _run(train_script, tmp_path, run_dir: Path, out: Path, extra: list[str], kill: str = "", resume: bool = False):
    args = ["debug=fast", "trainer=ddp", "trainer.devices=2", "trainer.accelerator=cpu", f"trainer.max_epochs={EPOCHS}",
            "validate_before_fit=false", "trainer.check_val_every_n_epoch=100", f"hydra.run.dir={run_dir}",
            "+callbacks.trace._target_=ddp_trace.DDPTrace", f"+callbacks.trace.out={out}",
            *([kill] if kill else []), *extra] + (["ckpt_path=last"] if resume else [])
    pythonpath = os.pathsep.join(p for p in (str(TESTS), os.environ.get("PYTHONPATH", "")) if p)
    return train_script(args, tmp_path, timeout=600, env={"PYTHONPATH": pythonpath})


@pytest.mark.slow
@pytest.mark.ddp
@pytest.mark.parametrize("case", sorted(CASES))
def test_resumed_ddp_ranks_collect_what_the_straight_run_collected(train_script, tmp_path, case):
    from safetensors.torch import load_file

    from cope.run.checkpoint_io import read_checkpoint

    extra = CASES[case]
    straight = _run(train_script, tmp_path, tmp_path / "straight", tmp_path / "trace_straight", extra)
    assert straight.returncode == 0, straight.stderr[-4000:]
    after_checkpoint = case in KILLED_AFTER_CHECKPOINT
    kill = (f"+callbacks.trace.kill_after_checkpoint={KILL_AT - 1}" if after_checkpoint
            else f"+callbacks.trace.kill_at_epoch={KILL_AT}")
    killed = _run(train_script, tmp_path, tmp_path / "cut", tmp_path / "trace_cut", extra, kill=kill)
    assert killed.returncode != 0 and (tmp_path / "cut/checkpoints/last.ckpt").exists(), killed.stderr[-4000:]
    assert read_checkpoint(tmp_path / "cut/checkpoints/last.ckpt")["epoch"] == KILL_AT - 1  # a file, or a sharded folder
    resumed = _run(train_script, tmp_path, tmp_path / "cut", tmp_path / "trace_resumed", extra, resume=True)
    assert resumed.returncode == 0, resumed.stderr[-4000:]

    for rank in (0, 1):
        s_epochs, s_steps = _read(tmp_path / "trace_straight", rank)
        c_epochs, c_steps = _read(tmp_path / "trace_cut", rank)
        r_epochs, r_steps = _read(tmp_path / "trace_resumed", rank)
        assert sorted(s_epochs) == list(range(EPOCHS)) and sorted(r_epochs) == list(range(KILL_AT, EPOCHS))
        for e in range(EPOCHS):  # the interrupted run's epochs, then the resumed run's, are the straight run's
            got = c_epochs[e] if e < KILL_AT else r_epochs[e]
            assert got == s_epochs[e], (rank, e)
        if after_checkpoint:
            assert KILL_AT not in c_epochs  # died inside epoch KILL_AT - 1's end
        else:
            assert c_epochs[KILL_AT] == s_epochs[KILL_AT]  # the killed epoch had collected the same before it died
        assert {**c_steps, **r_steps} == s_steps, rank  # the adapter after every step
    for e in range(EPOCHS):  # the ranks collect different experience, before and after the resume
        assert _read(tmp_path / "trace_straight", 0)[0][e]["tasks"] != _read(tmp_path / "trace_straight", 1)[0][e]["tasks"]
        assert _read(tmp_path / "trace_resumed", 0)[0].get(e) != _read(tmp_path / "trace_resumed", 1)[0].get(e) or e < KILL_AT
    steps = _read(tmp_path / "trace_straight", 0)[1]
    assert len(set(steps.values())) == len(steps) >= EPOCHS, steps  # every step moved the adapter: not vacuous
    if case == "cope_microbatched":  # the authors' CoPE: forecast steps of its own after each epoch's policy step
        assert len(steps) > EPOCHS, steps
    assert steps == _read(tmp_path / "trace_straight", 1)[1]  # ranks in sync
    assert _read(tmp_path / "trace_resumed", 0)[1] == _read(tmp_path / "trace_resumed", 1)[1]
    cut_rows = metric_rows(tmp_path / "cut/csv/metrics.csv")
    assert cut_rows == metric_rows(tmp_path / "straight/csv/metrics.csv")  # every epoch row once, none lost, none repeated
    assert sum("counters/episodes" in r for r in cut_rows) == EPOCHS
    export = "model/model.safetensors" if "model.finetune=full" in extra else "adapter/adapter_model.safetensors"
    a = load_file(tmp_path / "straight/csv" / export)
    b = load_file(tmp_path / "cut/csv" / export)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
