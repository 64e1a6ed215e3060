"""``callbacks.best_checkpoint`` (Lightning's ``ModelCheckpoint`` on ``val/success``, off by default): ``best.ckpt`` holds
the trained weights of the best validation, not the last, across a resume, and ``eval.py ckpt_path=<it>`` reproduces
that validation. The run is the shape the callback is for: held-out success falls after its first validation (the
late collapses of bench/results/study4)."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import metric_rows

CONF = Path(__file__).resolve().parents[1] / "conf"
MODEL = ["model.warm_start_steps=150", "env.sizes=[5]", "env.min_distance=1"]
RUN = [*MODEL, "module.optimizer.lr=1e-2", "validate_before_fit=false", "callbacks.best_checkpoint.save_top_k=1"]


def _eval(ckpt: Path, out: Path) -> float:
    from hydra import compose, initialize_config_dir

    from cope.run.evaluate import evaluate

    with initialize_config_dir(config_dir=str(CONF), version_base="1.3", job_name="test"):
        cfg = compose("eval", overrides=["debug=fast", *MODEL, f"paths.output_dir={out}", f"eval.out={out}",
                                         f"ckpt_path={ckpt}", "eval.start=0", "eval.count=8"])  # debug=fast's panel
    return evaluate(cfg)["success"]


@pytest.mark.long
def test_best_checkpoint_keeps_the_best_validation_across_a_resume(run_train, tmp_path):
    # stopped right after the first validation, the best so far: last.ckpt must hold the callback's state after that
    # validation (Lightning's checkpoint callbacks save at an epoch's end in list order; a stale state forgets the best)
    run_train([*RUN, "trainer.max_epochs=1"], tmp_path)
    run_train([*RUN, "trainer.max_epochs=4", "ckpt_path=last"], tmp_path)
    vals = [(int(r["epoch"]), float(r["val/success"])) for r in metric_rows(tmp_path / "csv" / "metrics.csv")
            if "val/success" in r]
    assert [e for e, _ in vals] == [0, 1, 2, 3]
    best = max(v for _, v in vals)
    assert vals[-1][1] < best, vals  # otherwise best and last coincide and this test shows nothing
    first_best = next(e for e, v in vals if v == best)  # ties keep the earlier file: it is replaced on a strict gain
    ckpt = torch.load(tmp_path / "checkpoints" / "best.ckpt", map_location="cpu", weights_only=True)
    assert ckpt["epoch"] == first_best and "optimizer_states" not in ckpt  # weights only
    assert _eval(tmp_path / "checkpoints" / "best.ckpt", tmp_path / "best") == best
    assert _eval(tmp_path / "checkpoints" / "last.ckpt", tmp_path / "last") == vals[-1][1]
