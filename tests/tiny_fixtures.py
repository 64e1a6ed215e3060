"""Tiny in-process builders shared by the rollout, generation, policy and module tests.

Everything is built locally, with no network: a byte-level BPE tokenizer trained on maze text
(:func:`cope.models.tiny.train_tokenizer`) and a randomly initialized one-layer Qwen2 wrapped in a LoRA
adapter exactly as :func:`cope.models.policy.load_pretrained` does it (base frozen first). Test modules turn
these into module-scoped fixtures; the tokenizer is cached per process since it never changes.
"""
from __future__ import annotations

import functools
from pathlib import Path

import torch

from cope.chat import ChatFormat
from cope.envs.base import Task
from cope.envs.maze import MazeEnv
from cope.models.policy import Policy

# The env every test here runs: 6x6 mazes, 8 moves per episode.
maze_factory = functools.partial(MazeEnv, sizes=[6], max_steps=8)


@functools.lru_cache(maxsize=1)
def tiny_tokenizer():
    """Byte-level BPE with the ChatML special tokens (ids 0..2), trained on maze text (~0.5 s)."""
    from cope.models.tiny import train_tokenizer

    return train_tokenizer(maze_factory, vocab_size=400, seed=0, episodes=30)


def tiny_chat() -> ChatFormat:
    return ChatFormat.chatml(tiny_tokenizer())


def lora_config():
    from peft import LoraConfig

    return LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", lora_dropout=0.0)


def tiny_config(**overrides):
    from transformers import Qwen2Config

    tok = tiny_tokenizer()
    kw = dict(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
        vocab_size=len(tok), tie_word_embeddings=True, pad_token_id=tok.pad_token_id, eos_token_id=tiny_chat().stop_id,
        bos_token_id=None,
    )
    kw.update(overrides)
    return Qwen2Config(**kw)


def tiny_base(seed: int = 0, **overrides):
    """A random (untrained) tiny Qwen2 causal LM in eval mode."""
    from transformers import Qwen2ForCausalLM

    torch.manual_seed(seed)
    return Qwen2ForCausalLM(tiny_config(**overrides)).eval()


def wrap_lora(base):
    """Freeze the base and add the LoRA adapter, as ``load_pretrained`` does."""
    from peft import get_peft_model

    for p in base.parameters():
        p.requires_grad_(False)
    return get_peft_model(base, lora_config())


def tiny_policy(seed: int = 0, **overrides) -> Policy:
    """An in-process :class:`Policy` (random tiny base + zero-initialized LoRA adapter)."""
    tok = tiny_tokenizer()
    model = wrap_lora(tiny_base(seed, **overrides)).eval()
    return Policy(model=model, tokenizer=tok, chat=tiny_chat(), source="in-process tiny")


def save_tiny(path: Path, seed: int = 0) -> Path:
    """Save a random tiny base model and the tokenizer as a ``from_pretrained`` folder."""
    tiny_base(seed).save_pretrained(path)
    tiny_tokenizer().save_pretrained(path)
    return path


def maze_tasks(n: int, split: str = "train", start: int = 0) -> list[Task]:
    return [Task("maze", split, start + i) for i in range(n)]


class Scripted:
    """Actor returning fixed id lists: ``scripts[key][turn]``; repeats the last one when a script runs out."""

    def __init__(self, scripts: dict[int, list[list[int]]]):
        self.scripts, self.turn = scripts, {}

    def __call__(self, contexts, admissible, keys):
        out = []
        for k in keys:
            t = self.turn.get(k, 0)
            self.turn[k] = t + 1
            script = self.scripts[k]
            out.append(list(script[min(t, len(script) - 1)]))
        return out

    def fork(self):  # scripts are per episode key: one instance serves every part of the live episodes
        return self


def exactness_model(arch: str = "qwen2", vocab_size: int = 128):
    """A fresh 2-layer causal LM of ``arch`` (``qwen2`` or ``llama``; grouped-query attention) on SDPA, fp32, its base
    frozen, with a LoRA adapter initialized away from zero (every LoRA matrix gets a gradient): what the shared-prefix
    exactness tests compare packed rows against unshared ones on."""
    import transformers
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    kw = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              vocab_size=vocab_size)
    cfg = transformers.LlamaConfig(**kw) if arch == "llama" else transformers.Qwen2Config(**kw)
    base = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa", dtype=torch.float32)
    for p in base.parameters():
        p.requires_grad_(False)
    return get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False))


def exactness_module(model, objectives, chat, temperature: float = 1.0, budget: int | None = None):
    """An AgentRLModule around ``model`` with ``objectives`` (SGD, no trainer: ``manual_backward`` is plain autograd)."""
    from cope.train.module import AgentRLModule

    module = AgentRLModule(Policy(model=model, tokenizer=None, chat=chat, source="t"), objectives, optimizer=torch.optim.SGD,
                           temperature=temperature, max_tokens_per_microbatch=budget)
    module.manual_backward = lambda loss: loss.backward()
    return module


def scored_step(module, batch: dict) -> tuple:
    """The scoring pass then one micro-batched forward + backward, as an epoch's first training step takes them:
    (old log-probs, reference log-probs or None, total loss, metrics, every LoRA gradient)."""
    from cope.train.step.backward import backward_microbatched

    module.score_minibatches([batch])
    module.zero_grad(set_to_none=True)
    _, total, metrics = backward_microbatched(module, batch)
    grads = [p.grad.clone() for p in module.policy.trainable_parameters()]
    return batch["old_logprobs"], batch.get("ref_logprobs"), total, metrics, grads


def branched_epoch(policy, env, tasks: int, group_size: int, runtime=None, sampling=None, minibatch_size: int | None = None,
                   max_context: int = 512, **branch):
    """Epoch 0 of a RolloutDataModule whose collector branches (``+collector=branching``; ``branch``: its settings),
    collected with ``policy`` over ``tasks`` tasks of ``env`` (one minibatch unless ``minibatch_size``); torn down
    after."""
    from cope.rollout.engine import EnvRuntime, Sampling
    from cope.train.collect.branching.collector import BranchingCollector
    from cope.train.datamodule import RolloutDataModule

    dm = RolloutDataModule(env=env, tasks_per_epoch=tasks, group_size=group_size,
                           minibatch_size=minibatch_size or group_size * tasks,
                           max_context=max_context, sampling=sampling or Sampling(max_action_tokens=4), val_tasks=0,
                           progress=False, env_runtime=runtime or EnvRuntime(),
                           collector=functools.partial(BranchingCollector, group_size=group_size, **branch))
    dm.connect(policy)
    try:
        return dm.collect_epoch(0)
    finally:
        dm.teardown("fit")

