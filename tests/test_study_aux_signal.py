"""bench.study.aux_signal: what an RWML or WM-SFT stage had to train on, from a run's own metrics rows."""
from __future__ import annotations

import pytest

from bench.study import aux_signal

NAMES = {"rwml_grpo": "RWML+GRPO", "wm_sft": "WM-SFT+GRPO"}


def test_a_run_s_rwml_stage_and_wm_nll_by_hand():
    rows = [
        {"epoch": 0.0, "rwml/stage": 1.0, "rwml/reward": 0.0, "rwml/pass_rate": 0.0, "rwml/copy_reward": 0.75},
        {"epoch": 1.0, "rwml/stage": 1.0, "rwml/reward": 0.5, "rwml/pass_rate": 1.0, "rwml/copy_reward": 0.25},
        {"epoch": 2.0, "rwml/stage": 0.0, "rwml/reward": 0.0, "rwml/pass_rate": 0.0},  # GRPO after the stage: not counted
        {"epoch": 2.0, "loss/pg": 0.1},
    ]
    assert aux_signal.of_run(rows) == {"rwml_epochs": 2, "rwml_reward": 0.25, "rwml_pass_rate": 0.5,
                                       "rwml_copy_reward": 0.5}
    wm = [{"epoch": 0.0, "loss/wm": 0.9}, {"epoch": 0.0, "loss/wm": 0.7}, {"epoch": 1.0, "loss/wm": 0.6},
          {"epoch": 3.0, "loss/wm": 0.5}, {"epoch": 3.0, "loss/wm": 0.3}, {"epoch": 3.0, "val/success": 0.2},
          {"epoch": 4.0, "loss/wm": 0.0, "wm/tokens": 0.0}]  # no sample: no NLL, not the last epoch's
    got = aux_signal.of_run(wm)
    assert got == {"wm_nll_first": pytest.approx(0.8), "wm_nll_last": pytest.approx(0.4)}
    assert aux_signal.of_run([{"epoch": 0.0, "loss/pg": 0.1}]) == {}  # GRPO: no stage, no row


def test_summary_over_seeds_and_its_table():
    old = {"rwml_epochs": 4, "rwml_reward": 0.0, "rwml_pass_rate": 0.0}  # a run from before rwml/copy_reward
    new = {"rwml_epochs": 4, "rwml_reward": 0.1, "rwml_pass_rate": 0.2, "rwml_copy_reward": 0.9}
    arms = {"grpo": {"runs": {0: {"aux": {}}}},
            "rwml_grpo": {"runs": {0: {"aux": old}, 1: {"aux": new}}},
            "wm_sft": {"runs": {0: {"aux": {"wm_nll_first": 0.9, "wm_nll_last": 0.5}}}}}
    got = aux_signal.summarize(arms)
    assert set(got) == {"rwml_grpo", "wm_sft"}
    assert got["rwml_grpo"]["seeds"] == 2 and got["rwml_grpo"]["rwml_reward"] == pytest.approx(0.05)
    assert got["rwml_grpo"]["rwml_copy_reward"] == 0.9 and got["rwml_grpo"]["wm_nll_first"] is None
    table = aux_signal.lines(got, NAMES)
    assert "| RWML+GRPO | 2 | 4 | 0.050 | 0.100 | 0.900 | - | - |" in table
    assert "| WM-SFT+GRPO | 1 | - | - | - | - | 0.900 | 0.500 |" in table
    assert aux_signal.lines({}, NAMES) == [] and aux_signal.lines(None, NAMES) == []
