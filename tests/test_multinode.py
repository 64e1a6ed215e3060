"""Two nodes on one host: 2 nodes x 1 process (gloo, CPU) through the launch recipes, each equal to a 1-node,
2-process run of the same config (``trainer=ddp trainer.devices=2``); and the launch rules of
:mod:`cope.run.launch`, which fail before the model build.

* torchrun: ``scripts/launch_torchrun.sh`` once per node (``--nnodes 2 --nproc-per-node 1 --node-rank 0|1``);
* SLURM: ``scripts/launch_slurm.sbatch`` with the allocation's variables and a stand-in ``srun`` that starts the two
  tasks on this host with their own ``SLURM_PROCID``/``SLURM_NODEID``/``SLURM_LOCALID`` (no SLURM here).

Equal means: every ``metrics.csv`` row value for value (timing columns ``perf/*`` excepted), each rank's held-out
episodes and the exported adapter's tensors. Same machine, one thread per process. Not covered: NCCL, and a run dir
on a filesystem shared across hosts."""
from __future__ import annotations

import csv
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = REPO / "scripts"
VAL = 7  # held-out tasks: 4 on rank 0, 3 on rank 1
# a warm-started model finishes some mazes, so the policy gradient and the adapter change (an untrained one gets 0)
RUN = ["debug=fast", "trainer.accelerator=cpu", "model.warm_start_steps=150", "env.sizes=[5]", "env.min_distance=1",
       f"data.val_tasks={VAL}"]
LAUNCH_VARS = ("MASTER_ADDR", "MASTER_PORT", "NODE_RANK", "GROUP_RANK", "LOCAL_RANK", "RANK", "WORLD_SIZE",
               "LOCAL_WORLD_SIZE")
TIMEOUT = 240

SRUN = """#!/usr/bin/env bash
# srun on one host: SLURM_NTASKS copies of the command, each with its task's variables, output in $SRUN_LOGS/task<i>
while [[ $1 == --* ]]; do shift; done
pids=()
for ((i = 0; i < SLURM_NTASKS; i++)); do
  SLURM_PROCID=$i SLURM_NODEID=$((i / SLURM_NTASKS_PER_NODE)) SLURM_LOCALID=$((i % SLURM_NTASKS_PER_NODE)) \\
    "$@" > "$SRUN_LOGS/task$i" 2>&1 &
  pids+=($!)
done
rc=0
for p in "${pids[@]}"; do wait "$p" || rc=$?; done
exit $rc
"""
SCONTROL = """#!/usr/bin/env bash
[ "$1 $2" = "show hostnames" ] && tr ',' '\\n' <<< "$3"
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(**extra: str) -> dict[str, str]:
    """This process's environment without any launcher's variables, one thread, offline (conftest's settings)."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SLURM_", "TORCHELASTIC_")) and k not in LAUNCH_VARS}
    return {**env, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "HYDRA_FULL_ERROR": "0", "PYTHON": sys.executable,
            **extra}


def _launch(cmds: list[tuple[list[str], dict[str, str]]], cwd: Path) -> list[tuple[int, str]]:
    """Start every command at once (each in its own session), wait for all; (exit code, output) of each. A launch
    past TIMEOUT is killed whole (a rank waiting for a peer that never comes)."""
    procs, logs = [], []
    for i, (cmd, env) in enumerate(cmds):
        logs.append(cwd / f"launch{i}.log")
        with open(logs[-1], "w") as f:
            procs.append(subprocess.Popen(cmd, cwd=cwd, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True))
    deadline = time.monotonic() + TIMEOUT
    for p in procs:
        try:
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for q in procs:
                if q.poll() is None:
                    os.killpg(q.pid, signal.SIGKILL)
            p.wait()
    return [(p.returncode, log.read_text()) for p, log in zip(procs, logs)]


def _rows(run: Path) -> list[dict[str, str]]:
    with open(run / "csv" / "metrics.csv", newline="") as f:
        return list(csv.DictReader(f))


def _adapter(run: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(run / "csv" / "adapter" / "adapter_model.safetensors"))


@pytest.fixture(scope="module")
def reference(tmp_path_factory, cope_cache) -> Path:
    """The run dir of the 1-node, 2-process run (Lightning starts rank 1) that both multi-node launches must equal."""
    tmp = tmp_path_factory.mktemp("reference")
    (rc, out), = _launch([([sys.executable, str(REPO / "train.py"), "trainer=ddp", "trainer.devices=2", *RUN,
                            f"hydra.run.dir={tmp / 'run'}"], _env())], tmp)
    assert rc == 0, out[-5000:]
    assert "Starting with 2 processes" in out, out[-5000:]
    return tmp / "run"


def _check_same_as_reference(run: Path, ref: Path, outputs: list[str]) -> None:
    report = "\n".join(f"--- node {i} ---\n{o[-4000:]}" for i, o in enumerate(outputs))
    assert "Starting with 2 processes" in outputs[0] and "GLOBAL_RANK: 1, MEMBER: 2/2" in outputs[1], report
    # one CSV, one Hydra record, one checkpoint, one summary: all global rank 0's
    assert sorted(run.rglob("metrics.csv")) == [run / "csv" / "metrics.csv"], sorted(run.rglob("metrics.csv"))
    assert sorted(p.name for p in run.rglob(".hydra")) == [".hydra"]
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["last.ckpt"]
    assert [o.count("=== cope-trainer run summary ===") for o in outputs] == [1, 0], report
    # rank 1 (the other node) logs into a file of its own, not into rank 0's train.log
    logs = {p.name: p.read_text().count(" trainable / ") for p in run.glob("*.log")}
    assert logs == {"train.log": 1, "train_rank1.log": 1}, logs

    got, want = _rows(run), _rows(ref)
    assert list(got[0]) == list(want[0])  # the same columns, in the same order
    timing = [k for k in want[0] if k.startswith("perf/")]  # wall-clock: differs between any two runs
    assert len(got) == len(want), (len(got), len(want))
    for i, (g, w) in enumerate(zip(got, want)):
        for k in want[0]:
            if k not in timing:
                assert g[k] == w[k], (i, k, g[k], w[k])
    # the premise: the runs trained (a policy gradient, a changed adapter), so equal values are not all zeros
    assert any(float(r["train/grad_norm"]) > 0 for r in want if r.get("train/grad_norm")), want
    assert any(float(r["loss/pg"]) != 0 for r in want if r.get("loss/pg")), want

    mine, theirs = _adapter(run), _adapter(ref)
    assert sorted(mine) == sorted(theirs)
    for k in theirs:
        assert mine[k].equal(theirs[k]), k

    # validation: each rank its own shard of the panel, none evaluated twice, each as in the 1-node run
    shards = sorted((run / "csv" / "val_episodes").iterdir())
    assert [p.name for p in shards] == [p.name for p in sorted((ref / "csv" / "val_episodes").iterdir())]
    assert len(shards) == 2 * 3, shards  # before fit and after each of the 2 epochs, 2 ranks
    for p in shards:
        assert p.read_text() == (ref / "csv" / "val_episodes" / p.name).read_text(), p.name
    for rank0 in (p for p in shards if p.name.endswith("_rank0.csv")):
        idx = [[int(r["index"]) for r in csv.DictReader(open(f))] for f in (rank0, Path(str(rank0).replace("_rank0", "_rank1")))]
        assert sorted(idx[0] + idx[1]) == list(range(VAL)) and len(idx[0]) == 4, idx


@pytest.mark.long
@pytest.mark.ddp
def test_two_nodes_under_torchrun_equal_one_node(reference, tmp_path):
    port, run = _free_port(), tmp_path / "run"
    cmds = [(["bash", str(SCRIPTS / "launch_torchrun.sh"), "2", str(node), "127.0.0.1", str(port), "1", *RUN,
              f"hydra.run.dir={run}"], _env()) for node in (0, 1)]
    results = _launch(cmds, tmp_path)
    assert [rc for rc, _ in results] == [0, 0], "\n".join(o[-5000:] for _, o in results)
    _check_same_as_reference(run, reference, [o for _, o in results])


@pytest.mark.long
@pytest.mark.ddp
def test_two_nodes_under_slurm_equal_one_node(reference, tmp_path):
    bin_dir, logs, run = tmp_path / "bin", tmp_path / "tasks", tmp_path / "run"
    bin_dir.mkdir()
    logs.mkdir()
    for name, text in (("srun", SRUN), ("scontrol", SCONTROL)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    env = _env(PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}", SRUN_LOGS=str(logs), MASTER_PORT=str(_free_port()),
               SLURM_JOB_ID="4242", SLURM_JOB_NAME="cope-test", SLURM_NNODES="2", SLURM_NTASKS="2",
               SLURM_NTASKS_PER_NODE="1", SLURM_JOB_NODELIST="127.0.0.1,127.0.0.1",
               SLURM_NODELIST="127.0.0.1,127.0.0.1", SLURM_SUBMIT_DIR=str(REPO))
    (rc, out), = _launch([(["bash", str(SCRIPTS / "launch_slurm.sbatch"), *RUN, f"hydra.run.dir={run}"], env)], tmp_path)
    outputs = [(logs / f"task{i}").read_text() if (logs / f"task{i}").exists() else "" for i in (0, 1)]
    assert rc == 0, out[-3000:] + "\n".join(o[-5000:] for o in outputs)
    assert "SLURM auto-requeueing enabled" in outputs[0], outputs[0][-5000:]  # Lightning read the SLURM variables
    _check_same_as_reference(run, reference, outputs)


# -- the launch rules: no launch, each fails in the config check, before the model build --------------------------------
def _clear_launchers(monkeypatch, env: dict[str, str]) -> None:
    for k in list(os.environ):
        if k.startswith(("SLURM_", "TORCHELASTIC_")) or k in LAUNCH_VARS:
            monkeypatch.delenv(k)
    for k, v in env.items():
        monkeypatch.setenv(k, v)


def _torchrun(world: int, per_node: int, rank: int = 0) -> dict[str, str]:
    return {"TORCHELASTIC_RUN_ID": "none", "WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE": str(per_node),
            "RANK": str(rank), "GROUP_RANK": str(rank // per_node), "LOCAL_RANK": str(rank % per_node),
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}


def _slurm(tasks: int, per_node: int, rank: int = 0, job: str = "cope") -> dict[str, str]:
    return {"SLURM_NTASKS": str(tasks), "SLURM_NTASKS_PER_NODE": str(per_node), "SLURM_NNODES": str(tasks // per_node),
            "SLURM_PROCID": str(rank), "SLURM_NODEID": str(rank // per_node), "SLURM_LOCALID": str(rank % per_node),
            "SLURM_JOB_NAME": job, "SLURM_NODELIST": "node[1-2]", "SLURM_JOB_ID": "4242"}


PLAIN = {"MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500", "NODE_RANK": "1"}


@pytest.mark.parametrize("env, overrides, key, says", [
    (_torchrun(3, 1), ["trainer.num_nodes=2", "trainer.devices=1"], "trainer.num_nodes",
     ["2 x 1 = 2 processes", "torchrun started 3 (WORLD_SIZE=3)", "set trainer.num_nodes=3 trainer.devices=1"]),
    (_torchrun(2, 2), ["trainer.devices=1"], "trainer.devices",  # one node, torchrun --nproc-per-node 2
     ["1 x 1 = 1 processes", "(LOCAL_WORLD_SIZE)", "set trainer.num_nodes=1 trainer.devices=2"]),
    (_slurm(4, 2), ["trainer.num_nodes=2", "trainer.devices=1"], "trainer.devices",
     ["SLURM started 4 (SLURM_NTASKS=4)", "set trainer.num_nodes=2 trainer.devices=2"]),
    ({**PLAIN, "WORLD_SIZE": "4"}, ["trainer.num_nodes=2", "trainer.devices=1"], "trainer.num_nodes",
     ["plain variables started 4 (WORLD_SIZE=4)", "set trainer.num_nodes x trainer.devices to 4"]),
    ({}, ["trainer.num_nodes=2", "trainer.devices=1"], "trainer.num_nodes",  # started by hand: would wait forever
     ["no launcher", "TORCHELASTIC_RUN_ID", "SLURM_NTASKS", "MASTER_ADDR, MASTER_PORT, NODE_RANK",
      "scripts/launch_torchrun.sh", "scripts/launch_slurm.sbatch", "trainer.num_nodes=1"]),
    ({"MASTER_ADDR": "10.0.0.1"}, ["trainer.num_nodes=2", "trainer.devices=1"], "trainer.num_nodes",
     ["MASTER_PORT, NODE_RANK are not set", "its own NODE_RANK"]),
])
def test_launch_mismatch_fails_before_the_model(run_train, tmp_path, monkeypatch, env, overrides, key, says):
    """A trainer that does not fit its launcher fails in the config check, naming the key and the fix; in seconds, before
    the tiny model is built (a rank would otherwise wait for peers that never come, or train with ranks that disagree)."""
    from cope.run.config_keys import ConfigError

    _clear_launchers(monkeypatch, env)
    cache = tmp_path / "cache"
    monkeypatch.setenv("COPE_CACHE", str(cache))
    import lightning.pytorch  # noqa: F401  (import time is not what is measured)
    import peft  # noqa: F401
    import torch.distributed

    def refuse(*args, **kwargs):  # without the check the no-launcher case would wait for its peers for 30 minutes
        raise RuntimeError("the run reached the rendezvous: the config check let it through")

    monkeypatch.setattr(torch.distributed, "init_process_group", refuse)
    t0 = time.perf_counter()
    with pytest.raises(ConfigError) as err:
        run_train(["trainer=ddp", "trainer.accelerator=cpu", *overrides], tmp_path)
    assert time.perf_counter() - t0 < 10, "the error came late"
    assert not (cache / "tiny").exists(), "the tiny model was built before the config error surfaced"
    mine = [p for p in err.value.problems if p.startswith(key)]
    assert len(mine) == 1, err.value.problems
    for s in says:
        assert s in mine[0], (s, mine[0])


@pytest.mark.parametrize("env, kind, overrides", [
    (_torchrun(2, 1, rank=1), "torchrun", ["hydra.output_subdir=null", "hydra.job.name=train_rank1"]),
    (_torchrun(4, 2, rank=0), "torchrun", []),
    (_slurm(2, 1, rank=1), "SLURM", ["hydra.output_subdir=null", "hydra.job.name=train_rank1"]),
    (_slurm(2, 1, rank=1, job="interactive"), "", []),  # an interactive allocation: Lightning ignores SLURM
    ({**PLAIN, "LOCAL_RANK": "0"}, "plain variables", ["hydra.output_subdir=null", "hydra.job.name=train_node1_ddp_process_0"]),
    ({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1", "NODE_RANK": "0", "LOCAL_RANK": "1", "WORLD_SIZE": "2"},  # Lightning's child
     "plain variables", ["hydra.output_subdir=null", "hydra.job.name=train_ddp_process_1"]),
    ({}, "", []),
])
def test_launcher_reads_what_lightning_reads(monkeypatch, env, kind, overrides):
    """cope.run.launch reads the launcher Lightning picks, and the same world, ranks and node; the entry point's
    overrides keep every process but global rank 0 off rank 0's Hydra files."""
    from lightning.fabric.plugins.environments import LightningEnvironment, SLURMEnvironment, TorchElasticEnvironment

    from cope.run.launch import launcher, rank_overrides

    _clear_launchers(monkeypatch, env)
    at = launcher()
    assert at.name == kind
    theirs = next((e() for e in (TorchElasticEnvironment, SLURMEnvironment) if e.detect()), LightningEnvironment())
    assert type(theirs) is {"torchrun": TorchElasticEnvironment, "SLURM": SLURMEnvironment}.get(kind, LightningEnvironment)
    assert (at.node, at.local) == (theirs.node_rank(), theirs.local_rank())
    if kind in ("torchrun", "SLURM"):
        assert (at.world, at.rank) == (theirs.world_size(), theirs.global_rank())
    assert rank_overrides() == overrides


@pytest.mark.long
def test_clock_run_dir_refused_and_rank_files_kept_apart(train_script, tmp_path):
    """Through the real entry point, as torchrun's rank 1 of 2 nodes: the default run dir (named by the clock) is refused
    before the model build, naming hydra.run.dir; and this process wrote no .hydra/ of its own, only train_rank1.log."""
    cache = tmp_path / "cache"
    env = {**_torchrun(2, 1, rank=1), "COPE_CACHE": str(cache)}
    proc = train_script(["debug=fast", "trainer=ddp", "trainer.accelerator=cpu", "trainer.num_nodes=2", "trainer.devices=1"],
                        tmp_path, timeout=120, env=env)
    report = f"exit {proc.returncode}\n{proc.stderr[-4000:]}"
    assert proc.returncode != 0 and "hydra.run.dir = 'outputs/${now:" in proc.stderr, report
    assert "/shared/runs/" in proc.stderr, report
    assert not (cache / "tiny").exists(), report
    runs = [p for p in (tmp_path / "outputs").glob("*/*") if p.is_dir()]
    assert len(runs) == 1 and sorted(p.name for p in runs[0].iterdir()) == ["train_rank1.log"], runs
