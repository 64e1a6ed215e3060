"""``model.adapter``: a run starts from an existing LoRA folder (an earlier run's export), trainable; a folder of another
base model or LoRA rank, or no adapter at all, is one clear error before any model is built."""
from __future__ import annotations

import json

import pytest
import torch

RUN = ["trainer.max_epochs=2", "callbacks.adapter_export.every_n_epochs=0", "model.warm_start_steps=150", "env.sizes=[5]",
       "env.min_distance=1"]


@pytest.fixture(scope="module")
def first_run(run_train, tmp_path_factory):
    out = tmp_path_factory.mktemp("first")
    result = run_train(RUN, out)
    return out, result


@pytest.mark.long
def test_a_run_starts_where_the_exported_adapter_left_off(first_run, run_train, read_metrics, tmp_path):
    from safetensors.torch import load_file

    first, result = first_run
    adapter = first / "csv" / "adapter"
    # ECHO on: a gradient in every step whatever the rewards, so the step must move the loaded (trainable) weights
    second = run_train([*RUN[1:], f"model.adapter={adapter}", "trainer.max_epochs=1", "algo=echo"], tmp_path)
    # the same held-out panel, greedy, the same weights: the first run's last validation, exactly
    assert second["start/val/success"] == result["val/success"]
    loaded = load_file(adapter / "adapter_model.safetensors")
    trained = load_file(tmp_path / "csv" / "adapter" / "adapter_model.safetensors")
    assert loaded.keys() == trained.keys()
    assert any(not torch.equal(loaded[k], trained[k]) for k in loaded)  # its first optimizer step moved the loaded weights


@pytest.mark.long
def test_bad_adapters_fail_before_the_model_is_built(first_run, run_train, tmp_path, monkeypatch):
    import cope.models.policy as policy

    first, _ = first_run
    adapter = first / "csv" / "adapter"

    def no_build(*a, **k):
        raise AssertionError("the model was built")

    monkeypatch.setattr(policy, "attach_lora", no_build)
    with pytest.raises(FileNotFoundError, match="model.adapter=.*no adapter_config.json"):
        run_train([*RUN, f"model.adapter={tmp_path}"], tmp_path / "a")
    with pytest.raises(ValueError, match=r"LoRA rank r=16, model.lora.r=8: set model.lora.r=16"):
        run_train([*RUN, f"model.adapter={adapter}", "model.lora.r=8"], tmp_path / "b")
    with pytest.raises(ValueError, match="was made on base model .* but this run's base is"):
        run_train([*RUN, f"model.adapter={adapter}", "model.num_layers=2"], tmp_path / "c")  # another tiny base
    other = tmp_path / "foreign"
    other.mkdir()
    (other / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": "Org/Other", "r": 16}))
    with pytest.raises(ValueError, match="'Org/Other'"):
        run_train([*RUN, f"model.adapter={other}"], tmp_path / "d")
