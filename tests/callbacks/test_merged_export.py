"""The merged export (``callbacks.adapter_export.merged=true``): the base with the LoRA adapter merged in, a plain
``from_pretrained`` folder with no adapter file, whose logits equal the adapter path's; a quantized base is refused."""
from __future__ import annotations

import pytest
import torch
from tiny_fixtures import tiny_policy

from cope.callbacks.adapter_export import export_merged


def _trained_looking(policy):
    """A LoRA adapter that changes the outputs (lora_B starts at zero)."""
    torch.manual_seed(3)
    with torch.no_grad():
        for n, p in policy.model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.05)
    return policy


def test_merged_folder_loads_plainly_and_equals_the_adapter(tmp_path):
    from transformers import AutoModelForCausalLM

    policy = _trained_looking(tiny_policy(seed=0))
    before = {n: p.detach().clone() for n, p in policy.model.named_parameters()}
    out = export_merged(policy, tmp_path / "merged")
    assert not any(f.name.startswith("adapter_") for f in out.iterdir())  # no adapter_config.json / adapter_model.*
    assert all(torch.equal(p, before[n]) for n, p in policy.model.named_parameters())  # the training model untouched
    merged = AutoModelForCausalLM.from_pretrained(str(out)).eval()
    ids = torch.randint(3, 300, (2, 40))
    with torch.no_grad():
        want = policy.model.eval()(input_ids=ids).logits
        got = merged(input_ids=ids).logits
        base = policy.model.get_base_model()
        with policy.model.disable_adapter():
            plain = policy.model(input_ids=ids).logits
    assert (want - plain).abs().max() > 1e-3  # the adapter matters here
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    assert merged.config.model_type == base.config.model_type and next(merged.parameters()).dtype == torch.float32


def test_a_quantized_base_is_refused(tmp_path):
    policy = tiny_policy(seed=0)
    policy.model.get_base_model().config.quantization_config = {"load_in_4bit": True}
    with pytest.raises(ValueError, match="quantized.*round it away"):
        export_merged(policy, tmp_path / "merged")
    assert not (tmp_path / "merged").exists()


@pytest.mark.long
def test_train_py_writes_the_merged_folder(run_train, tmp_path):
    run_train(["trainer.max_epochs=1", "validate_before_fit=false", "callbacks.adapter_export.merged=true"], tmp_path)
    folder = tmp_path / "csv" / "merged"
    assert (folder / "config.json").is_file() and (folder / "model.safetensors").is_file()
    assert (tmp_path / "csv" / "adapter" / "adapter_model.safetensors").is_file()  # the adapter export stays
