"""Memory you can plan with (:mod:`cope.train.fsdp.memory`, ``python -m bench.memory_plan``): the formula's terms by
hand at a small shape, the parameter count against a real model built from the same config, and every GPU preset
against the card it is meant for."""
from __future__ import annotations

import pytest
from transformers import Qwen2Config, Qwen2ForCausalLM

from bench.memory_plan import fits, plan_from_config
from cope.train.fsdp.memory import SHAPES, MemoryPlan, ModelShape

SMALL = ModelShape(vocab=64, hidden=32, intermediate=48, layers=2, heads=4, kv_heads=2)


def test_parameter_counts_equal_a_built_model():
    model = Qwen2ForCausalLM(Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False))
    assert SMALL.params() == sum(p.numel() for p in model.parameters())
    from peft import LoraConfig, get_peft_model

    lora = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                                 "up_proj", "down_proj"]))
    assert SMALL.lora_params(4) == sum(p.numel() for p in lora.parameters() if p.requires_grad)
    assert abs(SHAPES["Qwen/Qwen2.5-7B-Instruct"].params() - 7.62e9) < 0.01e9  # Qwen2.5-7B: 7.62B


def test_terms_by_hand():
    P = SMALL.params()
    full = MemoryPlan(SMALL, finetune="full", world=2, microbatch_tokens=10, step_tokens=25, live_tokens=7)
    assert full.micro_batches == 3
    assert full.resident() == {"weights": 4 * P / 2, "gradients": 4 * P / 2, "adamw_moments": 8 * P / 2,
                               "kl_reference": 2 * P / 2}
    step = full.step()
    assert step["accumulated_unsharded_gradient"] == 4 * P and step["gathered_step_weights"] == 2 * P
    assert step["trained_head_backward"] == 8 * 64 * 32 and step["adamw_foreach_temporary"] == 4 * P / 2
    assert full.rollout() == {"whole_bf16_model": 2 * P, "kv_cache": 2 * 2 * 2 * 2 * 8 * 7}
    synced = MemoryPlan(SMALL, finetune="full", world=2, microbatch_tokens=10, step_tokens=25, sync_every_microbatch=True)
    assert "accumulated_unsharded_gradient" not in synced.step()
    one = MemoryPlan(SMALL, finetune="full", world=2, microbatch_tokens=None)  # one forward: nothing accumulates
    assert {"accumulated_unsharded_gradient", "gathered_step_weights"}.isdisjoint(one.step())
    lora = MemoryPlan(SMALL, lora_rank=4, kl=True, world=1)
    assert lora.resident()["weights"] == 2 * P + 4 * SMALL.lora_params(4) and "kl_reference" not in lora.resident()
    assert "whole_bf16_model" not in lora.rollout()  # nothing sharded: the model is whole already
    assert full.host_setup() == {"per_rank": 8 * P, "per_node": 8 * P}


def _composed(overrides: list[str], tmp_path):
    """The run config as a user composes it (no debug preset: the real sizes)."""
    from hydra import compose

    from bench.memory_plan import _conf

    with _conf():
        return compose("config", overrides=[*overrides, f"paths.output_dir={tmp_path}"])


def test_the_authors_preset_fits_the_card_it_names(tmp_path):
    """experiment=cope_authors_alfworld: full fine-tuning of Qwen2.5-7B on 4 GPUs fits an 80 GB H100 by the formula,
    because it reduce-scatters every micro-batch (without it, the accumulated fp32 gradient needs an H200)."""
    cfg = _composed(["experiment=cope_authors_alfworld"], tmp_path)
    plan = plan_from_config(cfg)
    assert plan.finetune == "full" and plan.world == 4 and plan.sync_every_microbatch and plan.kl
    assert plan.step_tokens >= 16 * 8192 and plan.micro_batches >= 16  # the real sizes, not a debug preset's
    assert fits(plan, "H100"), plan.table()
    unsynced = plan_from_config(_composed(["experiment=cope_authors_alfworld",
                                         "trainer.strategy.sync_every_microbatch=false"], tmp_path))
    assert not fits(unsynced, "H100") and fits(unsynced, "H200"), unsynced.table()


def test_lora_presets_on_one_gpu(tmp_path):
    """LoRA on one GPU (``experiment=alfworld model=<it> trainer=gpu``), every live episode's KV cache at
    ``data.max_context`` (the worst case): 7B fits an H100; 14B's KV cache (48 layers, 8 KV heads) needs an H200, or on
    an H100 the live episodes capped in waves (``data.env_runtime.max_live_episodes=16``, docs/sharding.md)."""
    seven = plan_from_config(_composed(["experiment=alfworld", "model=qwen2.5-7b", "trainer=gpu"], tmp_path))
    assert seven.finetune == "lora" and seven.world == 1
    assert fits(seven, "H100"), seven.table()
    fourteen = ["experiment=alfworld", "model=qwen2.5-14b", "trainer=gpu"]
    plan = plan_from_config(_composed(fourteen, tmp_path))
    assert not fits(plan, "H100") and fits(plan, "H200"), plan.table()
    capped = plan_from_config(_composed([*fourteen, "data.env_runtime.max_live_episodes=16"], tmp_path))
    assert fits(capped, "H100"), capped.table()


def test_plan_refuses_an_unknown_shape(tmp_path):
    with pytest.raises(ValueError, match="no shape known"):
        plan_from_config(_composed(["experiment=alfworld", "model=smollm2-135m"], tmp_path))


def test_bf16_reference_of_full_finetuning_is_half_the_fp32_one():
    assert (MemoryPlan(SMALL, finetune="full", bf16_compute=False).resident()["kl_reference"]
            == 2 * MemoryPlan(SMALL, finetune="full").resident()["kl_reference"])


def test_host_ram_at_setup_is_measured_against_the_formula():
    """The host RAM term measured in a fresh process (``bench.fsdp_memory --host-setup``): the reference's deep copy
    takes 4P exactly, and building the fp32 model takes at least 4P (random initialization's temporaries stay with
    the allocator), so the setup takes at least the formula's 8P."""
    import json
    import subprocess
    import sys

    code = "import json, bench.fsdp_memory as m; print(json.dumps(m.host_setup(2)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={**__import__("os").environ, "OMP_NUM_THREADS": "1"})
    got = json.loads(out.stdout.strip().splitlines()[-1])
    P = got["params"]
    assert got["reference_bytes"] == pytest.approx(4 * P, rel=0.05), got
    assert got["model_bytes"] >= 0.98 * 4 * P and got["measured_bytes"] >= 0.98 * got["predicted_bytes"], got
