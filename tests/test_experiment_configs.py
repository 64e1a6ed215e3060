"""Every experiment preset composes, names an existing env config, and builds its DataModule (no model)."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

EXPERIMENTS = sorted(p.stem for p in (Path(__file__).resolve().parents[1] / "conf" / "experiment").glob("*.yaml"))
NEEDS = {"scienceworld": "scienceworld", "textworld": "textworld", "alfworld": "alfworld", "tau2": "tau2",
         "cope_authors_alfworld": "alfworld"}
EXTRA = {"tau2": ["env.user_model=some-user-model"],  # the preset's user model has no default
         "alfworld": ["env.source=generated"],  # the official games are a download
         "cope_authors_alfworld": ["env.source=generated"]}


@pytest.mark.long  # builds each real env (tau2 domain load, ScienceWorld JVM, ...)
@pytest.mark.parametrize("name", EXPERIMENTS)
def test_experiment_composes_and_builds(name, cope_cache, tmp_path):
    from hydra import compose, initialize_config_dir
    from hydra.utils import instantiate

    pkg = NEEDS.get(name)
    if pkg and importlib.util.find_spec(pkg) is None:
        pytest.skip(f"needs the extra `{name}` (package {pkg})")
    with initialize_config_dir(config_dir=str(Path(__file__).resolve().parents[1] / "conf"), version_base="1.3"):
        cfg = compose(config_name="config", overrides=[f"experiment={name}", f"paths.output_dir={tmp_path}",
                                                                 *EXTRA.get(name, [])])
    assert cfg.env._target_.startswith("cope.envs."), cfg.env._target_
    assert cfg.data.sampling.max_action_tokens >= 16 and cfg.data.max_context >= 4096
    factory = instantiate(cfg.env)
    dm = instantiate(cfg.data, env=factory)
    assert dm.num_train_tasks > 0 and dm.num_test_tasks > 0
    dm.teardown("fit")
