"""Every shipped model config runs end to end on a locally saved tiny model of its family.

The Qwen2.5 presets give ``lora.target_modules`` as a YAML list; before configs were turned into plain
containers on their way to library constructors (``cope.run.train.instantiate_plain``), peft held an OmegaConf
``ListConfig`` there and the adapter export at the end of the run could not serialize it (a 0-byte
``adapter_config.json``, exit 1). Here each preset trains one epoch through ``python train.py`` on a
tiny Qwen2 saved with ``save_pretrained`` (same architecture family, no download), exports, and the
export loads with plain peft onto the same base and reproduces the trained adapter's weights."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from tiny_fixtures import save_tiny

# tiny: tests/test_train_e2e.py runs it end to end; smollm2-135m (no `path`: a packaged GGUF): tests/test_smollm2.py
MODEL_CONFIGS = sorted(p.stem for p in (Path(__file__).resolve().parents[1] / "conf" / "model").glob("*.yaml")
                       if p.stem not in ("tiny", "smollm2-135m"))


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory) -> Path:
    return save_tiny(tmp_path_factory.mktemp("tiny_qwen2"))


def test_every_pretrained_preset_is_covered():
    assert {"qwen2.5-7b", "qwen2.5-14b"} <= set(MODEL_CONFIGS)


@pytest.mark.long
@pytest.mark.parametrize("preset", MODEL_CONFIGS)
def test_preset_trains_exports_and_reloads(train_script, tmp_path, tiny_folder, preset):
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    run = tmp_path / "run"
    proc = train_script([f"model={preset}", f"model.path={tiny_folder}", "model.dtype=fp32", "trainer.max_epochs=1",
                         "data.tasks_per_epoch=1", "data.group_size=2", "data.val_tasks=2", "data.max_context=1024",
                         "data.progress=false", "trainer.enable_progress_bar=false", f"hydra.run.dir={run}"],
                        tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "=== cope-trainer run summary ===" in proc.stdout
    adapter = run / "csv" / "adapter"
    cfg = json.loads((adapter / "adapter_config.json").read_text())
    assert isinstance(cfg["target_modules"], list) and "q_proj" in cfg["target_modules"], cfg["target_modules"]
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(str(tiny_folder)), str(adapter))
    saved = load_file(str(adapter / "adapter_model.safetensors"))
    loaded = {k: v for k, v in model.state_dict().items() if "lora_" in k}
    assert len(saved) == len(loaded) > 0
    for k, v in saved.items():
        match = [lk for lk in loaded if lk.replace(".default", "").endswith(k.split("base_model.model.", 1)[-1])]
        assert match and torch.equal(loaded[match[0]], v), k
    assert (run / "checkpoints" / "last.ckpt").is_file()


@pytest.mark.parametrize("model", sorted(p.stem for p in (Path(__file__).resolve().parents[1] / "conf" / "model").glob("*.yaml")))
def test_debug_fast_composes_with_every_model(compose, tmp_path, model):
    """``debug=fast`` shrinks what applies to the chosen model and leaves the rest: it once set tiny-model keys
    (``model.hidden_size``, ...) on every model, so ``model=smollm2-135m debug=fast`` was refused by the config check."""
    from cope.run.config_check import check_config

    cfg = compose([f"model={model}"], tmp_path)  # debug=fast comes first in `compose`
    check_config(cfg)
    assert cfg.data.tasks_per_epoch == 2 and cfg.trainer.max_epochs == 2  # the preset's run-size keys apply
    assert ("hidden_size" in cfg.model) == (model == "tiny")  # the micro-model keys only where the model takes them
    if model == "tiny":
        assert cfg.model.hidden_size == 32


# -- the micro-batch token budget of the real-model runs (issue: a 16-episode minibatch of 8k-token episodes was
# one forward, 131k tokens of activations) -------------------------------------------------------------------------
CONF = Path(__file__).resolve().parents[1] / "conf"
# the presets for the Qwen2.5 models: they include the shared real-model data settings (8k contexts, conf/data/real.yaml)
REAL_EXPERIMENTS = sorted(p.stem for p in (CONF / "experiment").glob("*.yaml") if "- /data/real" in p.read_text())


def _compose_plain(overrides: list[str], tmp_path):
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(CONF), version_base="1.3", job_name="test"):
        return compose(config_name="config", overrides=[f"paths.output_dir={tmp_path}", *overrides])


def test_real_experiments_are_found():
    assert {"alfworld", "scienceworld", "tau2", "terminal", "textworld", "webshop"} == set(REAL_EXPERIMENTS)


@pytest.mark.parametrize("model", ["qwen2.5-7b", "qwen2.5-14b"])
@pytest.mark.parametrize("experiment", REAL_EXPERIMENTS)
def test_real_runs_have_a_microbatch_budget(tmp_path, experiment, model):
    cfg = _compose_plain([f"experiment={experiment}", f"model={model}"], tmp_path)
    budget, ctx, mb = cfg.module.max_tokens_per_microbatch, cfg.data.max_context, cfg.data.minibatch_size
    assert isinstance(budget, int), f"experiment={experiment} model={model}: module.max_tokens_per_microbatch={budget}"
    assert ctx <= budget < mb * ctx, (budget, ctx, mb)  # one full-length episode fits; a full minibatch is split
    assert cfg.model.gradient_checkpointing and cfg.model.dtype == "bf16"  # what the budget's arithmetic assumes


@pytest.mark.parametrize("model", ["qwen2.5-7b", "qwen2.5-14b"])
def test_the_model_preset_alone_brings_its_budget(tmp_path, model):
    """``model=qwen2.5-7b env=alfworld`` without an experiment: the budget comes with the model
    (conf/module_for_model/<model>.yaml), and the command line still overrides it."""
    assert _compose_plain([f"model={model}", "env=alfworld"], tmp_path).module.max_tokens_per_microbatch == 16384
    assert _compose_plain([f"model={model}", "module.max_tokens_per_microbatch=4096"], tmp_path).module.max_tokens_per_microbatch == 4096
    assert _compose_plain(["model=tiny"], tmp_path).module.max_tokens_per_microbatch is None  # tiny models: one forward
