"""A test-only callback for multi-process runs of ``train.py``: each rank writes, to ``<out>/rank<r>.jsonl``, what it
alone saw of every epoch, so a test can recompute the global epoch metrics from both ranks' records together.

Loaded with ``PYTHONPATH=<tests>`` and ``+callbacks.metrics_trace._target_=ddp_metrics_trace.MetricsTrace``.
Lines: ``{"train": e, "episodes": [[group, aborted, reward, [valid, ...]], ...], "stop": {...}}`` at each training
epoch's start (this rank's episodes and its own, unpooled, stop-token tally under the policy that sampled them) and
``{"val": e, "probe": {...}, "stop_val": {...}}`` after each validation run (this rank's own probe and stop-token
tallies over its share of the held-out panel). No collective: a rank's tallies are its own.
"""
from __future__ import annotations

import json
from pathlib import Path

from lightning.pytorch import Callback

from cope.callbacks.probes import HeldOutProbes
from cope.callbacks.stop_token import StopTokenStats
from cope.records import train_record, val_record


def _episode(e) -> dict:
    """What the ``rollout/*`` and ``val/*`` metrics read of an episode (:func:`episode` rebuilds one)."""
    steps = [{k: getattr(s, k) for k in ("closed", "valid", "projected", "complete_len", "action_start", "action_end")}
             for s in e.steps]
    return {"group": e.group, "tokens": len(e.tokens), "reward": e.reward, "success": e.success, "score": e.score,
            "end_reason": e.end_reason, "steps": steps}


def episode(d: dict, group: int):
    """An :class:`~cope.episode.Episode` of a :func:`_episode` record, in GRPO group ``group``."""
    from cope.episode import Episode, Step
    steps = [Step(action_text="", **s) for s in d["steps"]]
    return Episode(task=None, group=group, tokens=[0] * d["tokens"], steps=steps, reward=d["reward"],
                   success=d["success"], score=d["score"], end_reason=d["end_reason"])


class MetricsTrace(Callback):
    def __init__(self, out: str):
        self.out = Path(out)

    def _write(self, trainer, row: dict) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        with open(self.out / f"rank{trainer.global_rank}.jsonl", "a") as f:
            f.write(json.dumps(row) + "\n")

    @staticmethod
    def _find(trainer, kind):
        return next(c for c in trainer.callbacks if isinstance(c, kind))

    def on_train_epoch_start(self, trainer, pl_module) -> None:
        # callbacks' hooks run before the module's: the policy is still the one that sampled the epoch
        rec = train_record(trainer)
        episodes = [[e.group, bool(e.aborted), float(e.reward), [bool(s.valid) for s in e.steps]] for e in rec.episodes]
        stop = self._find(trainer, StopTokenStats).rollout_tally(pl_module, rec)
        env = {k: v for k, v in rec.metrics.items() if k.startswith("env/")}  # this rank's own counts
        self._write(trainer, {"train": trainer.current_epoch, "episodes": episodes, "stop": stop, "env": env,
                              "full": [_episode(e) for e in rec.episodes]})

    def on_validation_epoch_end(self, trainer, pl_module) -> None:
        if trainer.sanity_checking:
            return
        rec = val_record(trainer)
        eps = rec.episodes if rec is not None else []
        probe = self._find(trainer, HeldOutProbes).tally(pl_module, eps, pl_module.policy.chat, pl_module.policy.pad_id)
        stop_val = self._find(trainer, StopTokenStats).panel_tally(pl_module, eps)
        self._write(trainer, {"val": trainer.current_epoch, "probe": probe, "stop_val": stop_val,
                              "full": [_episode(e) for e in eps]})
