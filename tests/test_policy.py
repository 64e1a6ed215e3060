"""`cope.models.policy.load_pretrained` on a tiny model saved to disk: LoRA-only training with an exact
trainable count, a frozen bit-identical base, the adapter-disabled reference, errors, and 4-bit."""
from __future__ import annotations

import importlib.util

import pytest
import torch
from tiny_fixtures import lora_config, save_tiny, tiny_chat

from cope.models.policy import load_pretrained
from cope.rollout.hf_actor import CachedSamplingActor

R = 4
IDS = torch.tensor([[1, 290, 201, 30, 31, 2, 201, 1, 295, 201, 268, 2], [1, 294, 201, 40, 41, 42, 2, 201, 1, 295, 201, 263]])


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny(tmp_path_factory.mktemp("tiny") / "base", seed=0)


@pytest.fixture(scope="module")
def base(model_dir):
    """The saved base model, loaded plainly (no adapter, never trained)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()


def _expected_lora_params(base) -> int:
    # peft "all-linear" targets every nn.Linear except the output head; each gets A (r, in) and B (out, r)
    lins = [(n, m) for n, m in base.named_modules() if isinstance(m, torch.nn.Linear) and n != "lm_head"]
    assert len(lins) == 7  # q, k, v, o, gate, up, down of the single layer
    return sum(R * (m.in_features + m.out_features) for _, m in lins)


def _train_steps(model, n: int, lr: float = 1e-2) -> None:
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr)
    model.train()
    for _ in range(n):
        logits = model(input_ids=IDS).logits.float()  # (N, T, V)
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].transpose(1, 2), IDS[:, 1:])
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()


def test_lora_only_training_keeps_base_bit_identical(model_dir, base):
    policy = load_pretrained(str(model_dir), lora=lora_config(), dtype="fp32")
    # built to train: every module in train mode (from_pretrained leaves the base in eval), as Lightning expects
    assert [n for n, m in policy.model.named_modules() if not m.training] == []
    model = policy.model.eval()
    assert policy.chat == tiny_chat() and policy.pad_id == 0 and policy.source == str(model_dir)

    trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_A" in n or "lora_B" in n for n in trainable)
    assert sum(p.numel() for p in trainable.values()) == _expected_lora_params(base)
    # hand count: q 4*(32+32) + k 4*(32+16) + v 4*(32+16) + o 4*(32+32) + gate/up/down 3 * 4*(32+64)
    assert _expected_lora_params(base) == 256 + 192 + 192 + 256 + 3 * 384 == 2048
    assert policy.trainable_parameters() == list(trainable.values())

    with torch.no_grad():
        base_logits = base(input_ids=IDS).logits  # (N, T, V)
        # lora_B starts at zero: the fresh adapter is exactly the identity
        assert torch.equal(model(input_ids=IDS).logits, base_logits)

    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    lora0 = {n: p.detach().clone() for n, p in trainable.items()}
    _train_steps(model, 3)
    for n, p in model.named_parameters():
        if n in frozen:
            assert torch.equal(p, frozen[n]), f"base weight {n} changed"
        else:
            assert not torch.equal(p, lora0[n]), f"LoRA weight {n} did not change"

    with torch.no_grad():
        trained = model(input_ids=IDS).logits
        with model.disable_adapter():
            ref = model(input_ids=IDS).logits
    assert torch.equal(ref, base_logits)  # the KL reference is exactly the untouched base
    assert not torch.allclose(trained, base_logits)


def test_missing_path_raises_file_not_found(tmp_path):
    with pytest.raises(FileNotFoundError, match="model.path"):
        load_pretrained(str(tmp_path / "no-such-model"), lora=lora_config())
    # a hub-style id that is not in the local cache: still no network, same error type
    with pytest.raises(FileNotFoundError, match="model.path"):
        load_pretrained("cope-no-such-model-xyz", lora=lora_config())


def test_bad_dtype_and_quantization_are_rejected(model_dir):
    with pytest.raises(ValueError, match="model.dtype"):
        load_pretrained(str(model_dir), lora=lora_config(), dtype="fp8")
    with pytest.raises(ValueError, match="model.quantization"):
        load_pretrained(str(model_dir), lora=lora_config(), quantization="2bit")


@pytest.mark.skipif(importlib.util.find_spec("bitsandbytes") is None, reason="bitsandbytes (extra 'quant') not installed")
def test_4bit_rollout_then_train(model_dir):
    """QLoRA on CPU: an eval-mode rollout forward followed by a training step must not hit the
    bitsandbytes bf16 repack trap (see cope.models.policy._disable_cpu_bf16_repack)."""
    import bitsandbytes as bnb

    policy = load_pretrained(str(model_dir), lora=lora_config(), dtype="bf16", quantization="4bit")
    model = policy.model.eval()
    q = [m for m in model.modules() if isinstance(m, bnb.nn.Linear4bit)]
    assert len(q) == 7 and all(m.support_avx512bf16_for_cpu is False for m in q)
    assert sum(p.numel() for p in model.parameters() if p.requires_grad) == 2048

    chat = policy.chat
    actor = CachedSamplingActor(model, policy.pad_id, chat.stop_id, max_new_tokens=3, temperature=1.0, seed=0)
    actions = actor([IDS[0].tolist(), IDS[1, :7].tolist()])  # the rollout's eval forward (with KV cache)
    assert all(1 <= len(a) <= 3 for a in actions)

    lora0 = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    _train_steps(model, 1)  # raised "a view of a leaf Variable ..." before the CPU repack was disabled
    assert any(not torch.equal(p, lora0[n]) for n, p in model.named_parameters() if p.requires_grad)
