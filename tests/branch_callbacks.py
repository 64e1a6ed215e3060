"""Test-only callbacks for ``train.py`` subprocesses of branching runs, loaded with ``PYTHONPATH=<tests>``.

* :class:`KillMidTree` (``+callbacks.kill._target_=branch_callbacks.KillMidTree``, tests/test_branching_resume.py)
  SIGKILLs a run while a tree is being grown (``+callbacks.kill.epoch=-1``: never, so the straight and resumed runs
  compose the same callbacks). In epoch ``epoch``'s collection it kills its own process (no cleanup, as a preemption
  without grace) at the first generation call that hands a child its parent's actions: the roots are grown, the
  children's envs are rebuilt, none of them has sampled a token yet. Before dying it appends one line to ``<out>``:
  the epoch and how many children were live.
* :class:`TreeTrace` (``+callbacks.trees._target_=branch_callbacks.TreeTrace``, tests/test_branching_ddp.py) writes,
  at each training epoch's start, this rank's trees to ``<out>/rank<r>.jsonl``: per episode its task, group,
  ``branch_of``, ``shared_steps`` and whether it was aborted.
* :class:`ServerWithoutActor` (tests/test_config_rules.py): a server engine that lends no sampling actor.
"""
from __future__ import annotations

import json
import os
import signal
from pathlib import Path

from lightning.pytorch import Callback

from cope.rollout.vllm.engine import VLLMEngine


class KillMidTree(Callback):
    def __init__(self, epoch: int = -1, out: str = "kill.jsonl"):
        self.epoch, self.out = int(epoch), Path(out)

    def setup(self, trainer, pl_module, stage: str) -> None:
        if self.epoch < 0:
            return
        from cope.train.collect.branching import tree

        collector = trainer.datamodule.collector
        collect, armed = collector.collect, {"epoch": None}

        def arming(epoch: int):  # on this instance only
            armed["epoch"] = epoch
            return collect(epoch)

        collector.collect = arming
        call = tree.ScriptedActor.__call__

        def dying(actor, contexts, admissible, keys):
            children = [k for k in keys if actor.scripts.get(k)]
            if armed["epoch"] == self.epoch and children:
                with open(self.out, "a") as f:
                    f.write(json.dumps({"epoch": armed["epoch"], "children": len(children)}) + "\n")
                    f.flush()
                    os.fsync(f.fileno())
                os.kill(os.getpid(), signal.SIGKILL)
            return call(actor, contexts, admissible, keys)

        tree.ScriptedActor.__call__ = dying


class TreeTrace(Callback):
    def __init__(self, out: str):
        self.out = Path(out)

    def on_train_epoch_start(self, trainer, pl_module) -> None:
        from cope.records import train_record

        rec = train_record(trainer)
        row = {"epoch": trainer.current_epoch,
               "episodes": [[e.task.id, e.group, e.branch_of, e.shared_steps, bool(e.aborted)] for e in rec.episodes]}
        self.out.mkdir(parents=True, exist_ok=True)
        with open(self.out / f"rank{trainer.global_rank}.jsonl", "a") as f:
            f.write(json.dumps(row) + "\n")


class ServerWithoutActor(VLLMEngine):
    """A server engine that lends no sampling actor (the config rule refuses it for branched rollouts)."""

    lends_actor = False
