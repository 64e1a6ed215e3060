"""Who started this process (torchrun, SLURM, plain variables or nobody), read from the environment before any work.

A multi-node run starts ``train.py`` once per process (torchrun, ``srun``) or once per node (plain variables, where
Lightning starts the node's other processes), and every such process composes its own Hydra config. Two things
follow, both handled here without torch:

* :func:`rank_overrides`: what the entry point appends to its command line so that every process but global rank 0
  keeps off rank 0's Hydra files in a run dir all nodes share: no ``.hydra/`` (``hydra.output_subdir=null``) and a
  log file of its own (``hydra.job.name=train_rank<R>``), as Lightning does for the processes it starts itself;
* :func:`check_launch`: the config rules between ``trainer.num_nodes`` x ``trainer.devices``, the launcher's world
  and the run dir (called by :mod:`cope.run.config_rules`), so that a mismatch fails before any model is built
  instead of hanging at the rendezvous or training with ranks that disagree.

The detection follows Lightning 2.6's choice of cluster environment (TorchElastic first, then SLURM unless the job
is named ``bash`` or ``interactive``, else its own environment, which reads ``MASTER_ADDR``, ``MASTER_PORT``,
``NODE_RANK`` and ``LOCAL_RANK``); LSF and MPI launchers are not read. Launch recipes: ``docs/multinode.md``.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Any, Callable, Mapping

from omegaconf import DictConfig, ListConfig, OmegaConf

TORCHRUN, SLURM, VARIABLES = "torchrun", "SLURM", "plain variables"
SCRIPTS = "scripts/launch_torchrun.sh (one command per node) or scripts/launch_slurm.sbatch (docs/multinode.md)"


@dataclass(frozen=True)
class Launcher:
    """What the environment says about the job this process belongs to.

    Args:
        name: ``torchrun``, ``SLURM``, ``plain variables`` or ``""`` (none: Lightning starts one node's processes).
        world: processes in the job as the launcher counts them (None: it does not say).
        world_var: the variable ``world`` comes from.
        per_node: processes per node as the launcher counts them (None: it does not say).
        per_node_var: the variable ``per_node`` comes from.
        rank: this process's global rank where the launcher gives it (None: it does not).
        node: this process's node rank.
        local: this process's rank on its node.
        external: the launcher starts every process itself, so each composes its own config.
    """

    name: str = ""
    world: int | None = None
    world_var: str = ""
    per_node: int | None = None
    per_node_var: str = ""
    rank: int | None = None
    node: int = 0
    local: int = 0
    external: bool = False


def _int(env: Mapping[str, str], var: str) -> int | None:
    m = re.match(r"\s*(\d+)", env.get(var, ""))  # SLURM writes some counts as "2(x3)"
    return int(m.group(1)) if m else None


def launcher(env: Mapping[str, str] | None = None) -> Launcher:
    """The launcher of this process, from ``env`` (default ``os.environ``)."""
    env = os.environ if env is None else env
    if "TORCHELASTIC_RUN_ID" in env:  # what torch.distributed.is_torchelastic_launched() reads
        return Launcher(TORCHRUN, _int(env, "WORLD_SIZE"), "WORLD_SIZE", _int(env, "LOCAL_WORLD_SIZE"), "LOCAL_WORLD_SIZE",
                        _int(env, "RANK"), _int(env, "GROUP_RANK") or 0, _int(env, "LOCAL_RANK") or 0, external=True)
    if "SLURM_NTASKS" in env and env.get("SLURM_JOB_NAME") not in ("bash", "interactive"):
        return Launcher(SLURM, _int(env, "SLURM_NTASKS"), "SLURM_NTASKS", _int(env, "SLURM_NTASKS_PER_NODE"),
                        "SLURM_NTASKS_PER_NODE", _int(env, "SLURM_PROCID"), _int(env, "SLURM_NODEID") or 0,
                        _int(env, "SLURM_LOCALID") or 0, external=True)
    if any(v in env for v in ("MASTER_ADDR", "NODE_RANK", "LOCAL_RANK")):
        node = _int(env, "NODE_RANK") if "NODE_RANK" in env else _int(env, "GROUP_RANK")
        return Launcher(VARIABLES, _int(env, "WORLD_SIZE"), "WORLD_SIZE", node=node or 0,
                        local=_int(env, "LOCAL_RANK") or 0, external="LOCAL_RANK" in env)
    return Launcher()


def rank_overrides(env: Mapping[str, str] | None = None) -> list[str]:
    """Hydra overrides for this process when it is not global rank 0: no ``.hydra/`` and a log file of its own.

    Under torchrun and SLURM the log is ``train_rank<R>.log``. Under plain variables the global rank is not known
    before the config (it needs ``trainer.devices``): node 0's other processes get Lightning's name
    (``train_ddp_process_<L>.log``, what Lightning passes the processes it starts), another node's
    ``train_node<N>_ddp_process_<L>.log``. Appended last on the command line, these win over Lightning's own."""
    at = launcher(env)
    if at.name in (TORCHRUN, SLURM):
        if not at.rank:
            return []
        name = f"train_rank{at.rank}"
    elif at.name == VARIABLES:
        if at.node == 0 and at.local == 0:
            return []
        name = f"train_ddp_process_{at.local}" if at.node == 0 else f"train_node{at.node}_ddp_process_{at.local}"
    else:
        return []
    return ["hydra.output_subdir=null", f"hydra.job.name={name}"]


def device_count(devices: Any) -> int | None:
    """Processes per node that ``trainer.devices`` asks for; None where the accelerator decides (``auto``, -1):
    Lightning checks those against the launcher itself when the Trainer is built, still before the model."""
    if isinstance(devices, bool):
        return None
    if isinstance(devices, int):
        return devices if devices > 0 else None
    if isinstance(devices, (list, tuple, ListConfig)):
        return len(devices) or None
    if isinstance(devices, str):
        s = devices.strip()
        if s.isdigit():
            return int(s) or None
        if "," in s:
            return len([x for x in s.split(",") if x.strip()]) or None
    return None


def check_launch(trainer: DictConfig, fail: Callable[[str, str], None], env: Mapping[str, str] | None = None,
                 run_dir: str | None = None) -> None:
    """``trainer.num_nodes`` and ``trainer.devices`` against the launcher in ``env`` (``fail(key, message)``):

    * their product must be the launcher's world (``WORLD_SIZE`` of torchrun or plain variables, ``SLURM_NTASKS``);
    * ``num_nodes > 1`` needs a launcher: started by hand, each node would wait for its peers forever;
    * under plain variables ``num_nodes > 1`` needs ``MASTER_ADDR``, ``MASTER_PORT`` and ``NODE_RANK`` on every node
      (Lightning would pick a random port and node 0 on each);
    * where several processes compose their own config, ``hydra.run.dir`` (``run_dir``: its value before
      interpolation, default: the running Hydra job's) must not depend on the clock, or each would write, and resume
      from, a folder of its own.
    """
    env = os.environ if env is None else env
    nodes, devices = trainer.get("num_nodes", 1), device_count(trainer.get("devices"))
    if not isinstance(nodes, int) or isinstance(nodes, bool) or nodes < 1:
        return  # the per-key check reports a bad type; Lightning refuses 0
    at = launcher(env)
    if nodes > 1 and not at.name:
        fail("trainer.num_nodes", f" = {nodes}: no launcher started this process (no torchrun: TORCHELASTIC_RUN_ID, "
             "WORLD_SIZE, RANK; no SLURM: SLURM_NTASKS, SLURM_PROCID; no MASTER_ADDR, MASTER_PORT, NODE_RANK), so "
             "it would wait for the other nodes forever; launch every node with " + SCRIPTS + ", or set "
             "trainer.num_nodes=1")
        return
    if nodes > 1 and at.name == VARIABLES:
        missing = [v for v in ("MASTER_ADDR", "MASTER_PORT", "NODE_RANK") if v not in env]
        if missing:
            fail("trainer.num_nodes", f" = {nodes}: started with plain variables but {', '.join(missing)} "
                 f"{'is' if len(missing) == 1 else 'are'} not set; every node needs MASTER_ADDR and MASTER_PORT (node "
                 "0's address and a free port, the same on all nodes) and its own NODE_RANK (0 .. num_nodes-1), or "
                 "launch with " + SCRIPTS)
            return
    if at.world is not None and devices is not None and nodes * devices != at.world:
        per = f" with {at.per_node} per node ({at.per_node_var})" if at.per_node else ""
        fix = (f"set trainer.num_nodes={at.world // at.per_node} trainer.devices={at.per_node}"
               if at.per_node and at.world % at.per_node == 0 else
               f"set trainer.num_nodes x trainer.devices to {at.world}")
        key = "trainer.devices" if at.per_node and at.per_node != devices else "trainer.num_nodes"
        fail(key, f": trainer.num_nodes x trainer.devices = {nodes} x {devices} = {nodes * devices} processes, but "
             f"{at.name} started {at.world} ({at.world_var}={at.world}){per}; {fix}, or launch {nodes} node(s) x "
             f"{devices} process(es) (" + SCRIPTS + ")")
        return
    composes = (at.external and (at.world or 1) > 1) or nodes > 1
    raw = run_dir if run_dir is not None else _hydra_run_dir()
    if composes and raw is not None and "${now:" in raw:
        fail("hydra.run.dir", f" = {raw!r}: each process of this {at.name or 'multi-node'} run composes its own config, "
             "and a folder named by the clock differs between them (other hosts, other seconds): they would log, "
             "checkpoint and resume in different folders; pass one folder every node sees, "
             "hydra.run.dir=/shared/runs/<name> (docs/multinode.md)")


def _hydra_run_dir() -> str | None:
    """``hydra.run.dir`` of the running Hydra job before interpolation (None outside ``@hydra.main``)."""
    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized():
        return None
    raw = OmegaConf.to_container(HydraConfig.get().run, resolve=False).get("dir")
    return raw if isinstance(raw, str) else None
