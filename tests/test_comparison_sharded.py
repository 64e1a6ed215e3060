"""The comparison set's algorithms (``algo=rwml_grpo``, ``wm_sft``, ``sft``, ``echo_only``) on 2 CPU ranks through
the real entry point: ``trainer=fsdp`` agrees with ``trainer=ddp`` (the same tokens on each rank, every logged metric
within fp32 noise, the adapter or the whole weights after fit), with LoRA and with full fine-tuning. The harness and
its tolerances are ``tests/test_fsdp.py``'s. Each pair also proves the algorithm runs under DDP at all: the ranks
sample their own episodes, some optimizer step has a gradient and the algorithm's own loss is logged non-zero.
"""
from __future__ import annotations

import pytest
from test_fsdp import _agree, _half_each, _pair

CASES = {
    # one RWML epoch then one GRPO epoch: both stages, the stage switch between them
    "rwml_grpo": (["algo=rwml_grpo", "rwml.epochs=1", "rwml.predictions=4", "rwml.max_triplets=4"], "rwml/triplets"),
    # WM-SFT's extra rows beside GRPO, every weight trained (the frozen reference for the KL)
    "wm_sft_full": (["algo=wm_sft", "wm_sft.weight=0.5", "model.finetune=full", "module.optimizer.lr=1e-4",
                     "algo.objectives.kl.weight=0.05"], "loss/wm"),
    # the maze expert's demonstrations, 4 per rank and epoch
    "sft": (["algo=sft", "data.tasks_per_epoch=4", "data.minibatch_size=2"], "loss/sft"),
    # the observation loss alone, on clean and unclean rollouts (the filter off: a warm-started model still errs)
    "echo_only": (["algo=echo_only", "algo.objectives.echo.clean_only=false"], "loss/echo"),
}


@pytest.mark.slow
@pytest.mark.ddp
@pytest.mark.parametrize("case", list(CASES))
def test_fsdp_matches_ddp(case, train_script, read_metrics, tmp_path):
    overrides, key = CASES[case]
    got = _agree(_pair(train_script, tmp_path, overrides), read_metrics, epochs=2, every_step=False,
                 logged=("loss/total", "train/grad_norm", key))
    assert max(abs(v) for v in got["metrics"][key]) > 0, (key, got["metrics"][key])
    if "model.finetune=full" in overrides:
        _half_each(got)
