"""Every run the study launcher (bench.study.launch) can start composes and passes the config check: each regime, each
arm, each setting of its search, in both phases and in --smoke
(the first setting; the others in the test phase). A wrong key in a regime fails here in seconds,
not hours into a study when its first run of that arm starts."""
from __future__ import annotations

import pytest

from bench.study import launch as study

CASES = [(name, arm) for name, regime in study.SPEC.items() for arm in regime.arms]


@pytest.mark.parametrize("name, arm", CASES, ids=[f"{n}-{a}" for n, a in CASES])
def test_every_study_run_composes(name, arm, compose, tmp_path):
    from cope.run.config_check import check_config

    regime = study.SPEC[name]
    base = regime.search("grpo")[dict(regime.fixed).get("grpo", next(iter(regime.search("grpo"))))] if arm != "grpo" else ()
    for i, (label, setting) in enumerate(regime.search(arm).items()):  # the phases differ in panels and budget only
        for phase, smoke in (("test", False), ("tune", False), ("test", True))[: 3 if i == 0 else 1]:
            overrides = study._overrides(regime, phase, arm, (*base, *setting), smoke)
            cfg = compose([f"algo={study.ARM_ALGO.get(arm, arm)}", *overrides], tmp_path)
            check_config(cfg)  # raises ConfigError naming the key
            assert cfg.callbacks.sample_efficiency.threshold == regime.threshold, (name, arm, label)
