"""The in-process engine's sampler copy (cope.rollout.sampler_copy.snapshot): the trainable tensors copied, every frozen
tensor shared, the same outputs at the snapshot, unchanged by later training; its sampler reports the sampled
tokens' log-probs as the trainer scores them."""
from __future__ import annotations

import torch
from tiny_fixtures import tiny_policy

from cope.rollout.sampler_copy import snapshot


def test_snapshot_copies_the_adapter_shares_the_base_and_stays_put():
    policy = tiny_policy()
    model = policy.model
    twin = snapshot(model)
    ours, theirs = dict(model.named_parameters()), dict(twin.named_parameters())
    frozen = [n for n, p in ours.items() if not p.requires_grad]
    trained = [n for n, p in ours.items() if p.requires_grad]
    assert frozen and trained
    assert all(theirs[n] is ours[n] for n in frozen)  # the base: one tensor, no memory
    assert all(theirs[n] is not ours[n] and torch.equal(theirs[n], ours[n]) and not theirs[n].requires_grad for n in trained)
    assert all(any(b is c for c in model.buffers()) for b in twin.buffers())
    ids = torch.randint(0, 100, (2, 12))
    model.eval()
    with torch.no_grad():
        before = twin(input_ids=ids).logits
        assert torch.equal(model(input_ids=ids).logits, before) and not twin.training
        for n in trained:  # an optimizer step on the training model
            ours[n].add_(0.05)
        assert not torch.equal(model(input_ids=ids).logits, before)
        assert torch.equal(twin(input_ids=ids).logits, before)


def test_sampled_logprobs_are_the_trainers_at_the_sampling_temperature():
    from cope.rollout.hf_actor import CachedSamplingActor
    from cope.rollout.loop import Sampled
    from cope.train.logprobs import causal_lm_logprobs

    policy = tiny_policy()
    model = policy.model.eval()
    actor = CachedSamplingActor(model, policy.pad_id, policy.chat.stop_ids, 6, temperature=0.7, seed=3, logprobs=True)
    context = [[5, 6, 7, 8], [9, 10, 11]]
    out = actor(context)
    assert all(isinstance(s, Sampled) and len(s.ids) == len(s.logprobs) > 0 for s in out)
    for ctx, s in zip(context, out):
        ids = torch.tensor([ctx + s.ids])
        tempered = torch.zeros_like(ids, dtype=torch.bool)
        tempered[0, len(ctx):] = True
        with torch.no_grad():
            lp, _ = causal_lm_logprobs(model, ids, torch.ones_like(ids), torch.arange(ids.shape[1])[None], tempered=tempered,
                                       temperature=0.7)
        torch.testing.assert_close(torch.tensor(s.logprobs), lp[0, len(ctx):], atol=1e-5, rtol=0)


def test_the_in_process_engine_samples_a_held_version_from_its_copy():
    import functools

    import pytest
    from tiny_fixtures import maze_tasks

    from cope.envs.maze import MazeEnv
    from cope.rollout.engine import EnvRuntime, HFEngine, Sampling

    policy = tiny_policy()
    engine = HFEngine(functools.partial(MazeEnv, sizes=[5], max_steps=4), EnvRuntime(), max_context=1024)
    engine.connect(policy)
    tasks, sampling = maze_tasks(4), Sampling(temperature=0.7, max_action_tokens=6, seed=5)

    def actions(eps):
        return [[e.tokens[s.action_start:s.action_end] for s in e.steps] for e in eps]

    engine.sync(0)
    engine.hold(0)
    engine.hold(0)
    live, _ = engine.rollout(tasks, list(range(4)), sampling)
    held, _ = engine.rollout(tasks, list(range(4)), sampling, version=0)
    assert actions(live) == actions(held)  # the copy is the model at the hold
    assert all(s.sampler_logprobs is None for e in live for s in e.steps)
    assert all(len(s.sampler_logprobs) == s.action_end - s.action_start for e in held for s in e.steps)
    with torch.no_grad():  # training moves on
        for p in policy.trainable_parameters():
            p.add_(0.5)
    engine.sync(1)
    moved, _ = engine.rollout(tasks, list(range(4)), sampling)
    again, _ = engine.rollout(tasks, list(range(4)), sampling, version=0)
    assert actions(moved) != actions(live) and actions(again) == actions(held)
    with pytest.raises(ValueError, match="can hold only its current version"):
        engine.hold(5)
    engine.release(0)
    engine.rollout(tasks[:1], [0], sampling, version=0)  # one hold left
    engine.release(0)
    with pytest.raises(ValueError, match="neither held nor the current"):
        engine.rollout(tasks[:1], [0], sampling, version=0)
    with pytest.raises(ValueError, match="not held"):
        engine.release(0)
    engine.close()


def test_a_4bit_base_is_shared_not_copied(tmp_path):
    """QLoRA: the snapshot of a 4-bit model shares its quantized weights (no second base in memory) and samples the
    same logits."""
    import bitsandbytes as bnb
    from tiny_fixtures import lora_config, save_tiny

    from cope.models.policy import load_pretrained

    policy = load_pretrained(str(save_tiny(tmp_path / "base")), lora=lora_config(), dtype="bf16", quantization="4bit")
    model = policy.model.eval()
    twin = snapshot(model)
    ours = [m for m in model.modules() if isinstance(m, bnb.nn.Linear4bit)]
    theirs = [m for m in twin.modules() if isinstance(m, bnb.nn.Linear4bit)]
    assert ours and len(ours) == len(theirs) and all(a.weight is b.weight for a, b in zip(ours, theirs))
    ids = torch.randint(0, 100, (1, 8))
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, twin(input_ids=ids).logits)
