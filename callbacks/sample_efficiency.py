"""Sample-efficiency tracking: held-out success against the experience spent to reach it.

After every validation run (not the sanity check) the callback records the global counters of the
datamodule (``episodes``, ``env_steps``, ``generated_tokens``, ``train_tokens``; summed over ranks)
together with ``val/success`` and ``val/score``; after every training epoch it records the same
counters with ``rollout/success``. The first validation with ``val/success >= threshold`` gives
``efficiency/episodes_to_threshold`` and ``efficiency/env_steps_to_threshold``, logged once.

Outputs in the run folder: ``<filename>.csv`` (validation rows), ``<filename>_train.csv`` (training
rows) and ``<filename>.png`` (held-out success as markers, rollout success as a thin line, both
against episodes). All rows are part of the callback state, so a resumed run keeps the whole curve.

Validation rows are taken at ``on_validation_end`` rather than ``on_validation_epoch_end``: callback
hooks run before the LightningModule's hook of the same name, so a ``val/success`` logged by the
module's ``on_validation_epoch_end`` is only in ``callback_metrics`` afterwards. Lightning forbids
``self.log`` there, so the efficiency numbers go straight to ``trainer.loggers``.
"""
from __future__ import annotations

import csv
from pathlib import Path

import torch
from lightning.pytorch import Callback

from cope import records
from cope.train.dist import log_now

COUNTERS = ("episodes", "env_steps", "generated_tokens", "train_tokens")
VAL_COLUMNS = ["epoch", "global_step", *COUNTERS, "val_success", "val_score"]
TRAIN_COLUMNS = ["epoch", "global_step", *COUNTERS, "rollout_success"]


def _run_dir(trainer) -> Path:
    """``trainer.log_dir`` (a collective under DDP: call it on every rank), else ``default_root_dir``."""
    return Path(getattr(trainer, "log_dir", None) or trainer.default_root_dir)


def _metric(trainer, key: str) -> float | None:
    v = trainer.callback_metrics.get(key)
    if v is None:
        return None
    return float(v.detach().float().mean()) if torch.is_tensor(v) else float(v)


def _mean_success(episodes) -> float | None:
    eps = list(episodes or [])
    return sum(bool(e.success) for e in eps) / len(eps) if eps else None


class SampleEfficiency(Callback):
    """Learning curve against experience (episodes, env steps, tokens) and steps-to-threshold.

    Args:
        threshold: held-out success rate that counts as "reached", in (0, 1].
        plot: also draw ``<filename>.png`` (matplotlib, Agg canvas, no pyplot state).
        filename: stem of the files written in the run folder (no path separators).
    """

    def __init__(self, threshold: float = 0.5, plot: bool = True, filename: str = "learning_curve"):
        if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or not 0.0 < threshold <= 1.0:
            raise ValueError(f"SampleEfficiency.threshold must be in (0, 1], got {threshold!r}")
        if not filename or not isinstance(filename, str) or "/" in filename or "\\" in filename:
            raise ValueError(f"SampleEfficiency.filename must be a plain file stem, got {filename!r}")
        self.threshold, self.plot, self.filename = float(threshold), bool(plot), filename
        self.val_rows: list[dict] = []
        self.train_rows: list[dict] = []
        self.reached: dict[str, int] | None = None  # counters at the first crossing

    @property
    def state_key(self) -> str:
        return self._generate_state_key(filename=self.filename)

    def _row(self, trainer) -> dict:
        counters = records.counters(trainer)
        row = {"epoch": int(trainer.current_epoch), "global_step": int(trainer.global_step)}
        row.update({k: int(counters.get(k, 0)) for k in COUNTERS})
        return row

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        row = self._row(trainer)
        success = _metric(trainer, "rollout/success")
        if success is None:  # the module logs it later: fall back to the episodes themselves
            rec = records.train_record(trainer)
            success = _mean_success(rec.episodes if rec is not None else None)
        row["rollout_success"] = success
        self.train_rows.append(row)
        path = _run_dir(trainer) / f"{self.filename}_train.csv"
        if trainer.is_global_zero:
            self._write_csv(path, TRAIN_COLUMNS, self.train_rows)

    def on_validation_end(self, trainer, pl_module) -> None:
        if trainer.sanity_checking:
            return
        row = self._row(trainer)
        success = _metric(trainer, "val/success")
        if success is None:
            rec = records.val_record(trainer)
            success = _mean_success(rec.episodes if rec is not None else None)
        row["val_success"], row["val_score"] = success, _metric(trainer, "val/score")
        self.val_rows.append(row)
        if self.reached is None and success is not None and success >= self.threshold:
            self.reached = {k: row[k] for k in ("episodes", "env_steps", "global_step")}
            metrics = {"efficiency/episodes_to_threshold": row["episodes"], "efficiency/env_steps_to_threshold": row["env_steps"],
                       "epoch": row["epoch"]}
            log_now(trainer.loggers, metrics, trainer.global_step)  # logger methods are rank-zero-only themselves
        out = _run_dir(trainer)  # on every rank: log_dir is a collective
        if trainer.is_global_zero:
            self._write_csv(out / f"{self.filename}.csv", VAL_COLUMNS, self.val_rows)
            if self.plot:
                self.draw(out / f"{self.filename}.png")

    def on_fit_end(self, trainer, pl_module) -> None:
        out = _run_dir(trainer)
        if trainer.is_global_zero and self.plot:
            self.draw(out / f"{self.filename}.png")

    @staticmethod
    def _write_csv(path: Path, columns: list[str], rows: list[dict]) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".csv.tmp")
        with tmp.open("w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=columns, extrasaction="ignore")
            w.writeheader()
            w.writerows(rows)
        tmp.replace(path)  # readers never see a half-written file

    def draw(self, path: Path) -> bool:
        """Draws the learning curve to ``path``; returns False when there is nothing to draw."""
        val = [r for r in self.val_rows if r.get("val_success") is not None]
        train = [r for r in self.train_rows if r.get("rollout_success") is not None]
        if not val and not train:
            return False
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure

        fig = Figure(figsize=(6, 4), dpi=100)
        FigureCanvasAgg(fig)
        ax = fig.add_subplot()
        if train:
            ax.plot([r["episodes"] for r in train], [r["rollout_success"] for r in train], lw=0.8, alpha=0.7,
                    label="rollout success (train)")
        if val:
            ax.plot([r["episodes"] for r in val], [r["val_success"] for r in val], "o-", ms=5, label="held-out success (val)")
        if self.reached is not None:
            ax.axvline(self.reached["episodes"], color="gray", ls=":", lw=0.8)
        ax.axhline(self.threshold, color="gray", ls="--", lw=0.8, label=f"threshold {self.threshold:g}")
        ax.set(xlabel="episodes", ylabel="success rate", ylim=(-0.02, 1.02), title="sample efficiency")
        ax.grid(alpha=0.3)
        ax.legend(loc="lower right", fontsize=8)
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path)
        return True

    def state_dict(self) -> dict:
        return {"val_rows": [dict(r) for r in self.val_rows], "train_rows": [dict(r) for r in self.train_rows],
                "reached": self.reached}

    def load_state_dict(self, state_dict: dict) -> None:
        self.val_rows = [dict(r) for r in state_dict.get("val_rows", [])]
        self.train_rows = [dict(r) for r in state_dict.get("train_rows", [])]
        self.reached = state_dict.get("reached")
