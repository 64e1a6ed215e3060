"""A tiny Qwen2-architecture policy built locally, for CPU demos and tests (``model=tiny``).

A randomly initialized model cannot write a valid action, while real users start from a pretrained
LLM that can. The tiny path therefore gets a warm start, by default one that uses no expert:

1. a byte-level BPE tokenizer trained on text the env produces (instructions, observations of
   random walks, admissible actions), with the ChatML special tokens and chat template;
2. a Qwen2 model from config, behaviour-cloned on walks with the loss on action tokens. By default
   (``warm_start_policy="random"``) the walks are *uniformly random over admissible actions* (format
   only: the walk knows nothing about the goal). ``warm_start_policy="expert"`` clones *noisy
   goal-directed walks* instead: the env's ``expert_action()`` with probability
   ``warm_start_expert_prob``, else a random admissible action, a stand-in for a pretrained/SFT'd
   model that is goal-directed but imperfect (:mod:`cope.models.warm_start`; the tokenizer's walks stay random).
   Transcripts come from the same rollout engine as training (token-in/token-out).

The result is saved with ``save_pretrained`` to a cache folder keyed by a hash of everything that
went into it, so it is built once; the policy is then loaded through the same
:func:`cope.models.policy.load_pretrained` path as a real model (LoRA, 4-bit and all).
"""
from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import random
import time
from pathlib import Path
from typing import Any, Callable

import torch

from cope.batch import collate
from cope.chat import CHATML_TEMPLATE, ChatFormat
from cope.chat.templates import chat_template as template_text
from cope.envs.base import Env, Task
from cope.models.build_cache import build_once
from cope.models.choices import Dtype, Finetune, Quantization, WarmStartPolicy
from cope.models.policy import Policy, load_pretrained
from cope.models.warm_start import WithExamples, check_warm_start, random_walks, walked_tasks

log = logging.getLogger(__name__)
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def _describe(env_factory: Callable[[], Env]) -> str:
    if isinstance(env_factory, functools.partial):
        f = env_factory.func
        return f"{f.__module__}.{f.__qualname__}({sorted(env_factory.keywords.items())!r})"
    return f"{type(env_factory).__module__}.{getattr(env_factory, '__qualname__', type(env_factory).__name__)}"


def train_tokenizer(env_factory: Callable[[], Env], vocab_size: int, seed: int, episodes: int = 200,
                    num_tasks: int | None = None, chat_template: str | None = None):
    """Byte-level BPE on env text (random walks); every string stays encodable (byte fallback). ``chat_template``: a
    choice of :func:`cope.chat.templates.chat_template` (None: plain ChatML)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    env = WithExamples(env_factory())
    rng = random.Random(seed)
    texts = [env.instructions] + ["system\n", "user\n", "assistant\n"] * 200
    seen: list[str] = []
    for _ in range(episodes):
        r = env.reset(Task(env.name, "train", rng.randrange(walked_tasks(env, num_tasks))))
        texts.append(r.observation)
        for _k in range(env.max_steps):
            if not r.admissible_actions:
                break
            seen = sorted(set(seen) | set(r.admissible_actions))
            # mostly admissible moves; sometimes any known action (may be refused) or a malformed one,
            # so the vocabulary also covers the env's refusal and harness messages
            a = rng.choice(r.admissible_actions) if rng.random() < 0.8 else rng.choice(seen + ["??"])
            texts.append(a)
            r = env.step(a)
            texts.append(r.observation + ("\n" + r.harness if r.harness else ""))
            if r.done:
                break
    env.close()
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIAL, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<|endoftext|>", eos_token="<|im_end|>",
        chat_template=CHATML_TEMPLATE if chat_template is None else template_text(chat_template))


def build_tiny_base(
    env_factory: Callable[[], Env],
    out_dir: Path,
    hidden_size: int,
    num_layers: int,
    num_heads: int,
    vocab_size: int,
    max_context: int,
    warm_start_steps: int,
    warm_start_batch: int,
    warm_start_lr: float,
    seed: int,
    tokenizer_episodes: int = 200,
    warm_start_walks: int = 128,
    max_action_tokens: int = 8,
    warm_start_tasks: int | None = None,
    warm_start_policy: str = "random",
    warm_start_expert_prob: float = 0.5,
    chat_template: str | None = None,
) -> None:
    """Train the tokenizer and behaviour-clone a fresh tiny Qwen2 on ``warm_start_policy``'s walks into ``out_dir``."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    check_warm_start(warm_start_policy, warm_start_expert_prob, env_factory)
    torch.manual_seed(seed)
    tokenizer = train_tokenizer(env_factory, vocab_size, seed, tokenizer_episodes, warm_start_tasks, chat_template)
    chat = ChatFormat.chatml(tokenizer) if chat_template is None else ChatFormat.from_template(tokenizer)
    cfg = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=hidden_size * 3,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=max(1, num_heads // 2),
        max_position_embeddings=max_context,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=chat.stop_id,
        bos_token_id=None,
    )
    model = Qwen2ForCausalLM(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=warm_start_lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 20) * max(0.1, 1 - s / warm_start_steps))
    t0, pool = time.perf_counter(), []
    walkers = [WithExamples(env_factory())]
    walks = min(warm_start_walks, getattr(walkers[0].env, "max_instances", None) or warm_start_walks)
    walkers += [WithExamples(env_factory()) for _ in range(walks - 1)]
    model.train()
    for step in range(warm_start_steps):
        for attempt in range(3):
            if pool:
                break
            pool = random_walks(walkers, tokenizer, chat, seed + step + 7919 * attempt, max_context, max_action_tokens,
                                 warm_start_tasks, warm_start_policy, warm_start_expert_prob)
        if not pool:
            raise RuntimeError("the tiny model's warm start got no episode from the env (every random walk aborted); "
                               "see the env errors logged above")
        batch = collate([pool.pop() for _ in range(min(warm_start_batch, len(pool)))], tokenizer.pad_token_id)
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, :-1]  # (N, T-1, V)
        target = batch["input_ids"][:, 1:]
        mask = batch["action_mask"][:, 1:]
        nll = torch.nn.functional.cross_entropy(logits.transpose(1, 2), target, reduction="none")  # (N, T-1)
        loss = (nll * mask).sum() / mask.sum()
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        if step % 50 == 0 or step == warm_start_steps - 1:
            log.info("warm start %d/%d: action nll %.3f (%.0fs)", step + 1, warm_start_steps, loss.item(), time.perf_counter() - t0)
    for w in walkers:
        w.close()
    model.save_pretrained(out_dir)  # a temporary folder of cope.models.build_cache, renamed into the cache when complete
    tokenizer.save_pretrained(out_dir)


def tiny_base_folder(
    env_factory: Callable[[], Env],
    cache_dir: str = "~/.cache/cope-trainer/tiny",
    hidden_size: int = 128,
    num_layers: int = 4,
    num_heads: int = 4,
    vocab_size: int = 512,
    max_context: int = 2048,
    warm_start_steps: int = 300,
    warm_start_batch: int = 16,
    warm_start_lr: float = 3e-3,
    tokenizer_episodes: int = 200,
    warm_start_walks: int = 128,
    warm_start_action_tokens: int = 8,
    warm_start_tasks: int | None = None,
    warm_start_policy: WarmStartPolicy = "random",
    warm_start_expert_prob: float = 0.5,
    seed: int = 0,
    chat_template: str | None = None,
) -> tuple[Path, dict]:
    """The cache folder of the tiny base these settings build (``<cache_dir>/<hash of the spec>``, also what the
    policy records as its source) and the spec; nothing is built. Same arguments as :func:`tiny_policy`."""
    check_warm_start(warm_start_policy, warm_start_expert_prob, env_factory)  # before any work
    spec = dict(
        env=_describe(env_factory), hidden_size=hidden_size, num_layers=num_layers, num_heads=num_heads, vocab_size=vocab_size,
        max_context=max_context, warm_start_steps=warm_start_steps, warm_start_batch=warm_start_batch,
        warm_start_lr=warm_start_lr, seed=seed, version=1,
    )
    if chat_template is not None:  # the build's tokenizer carries it (the warm start's walks are in its scaffold)
        template_text(chat_template)  # a bad choice fails before any work
        spec.update(chat_template=chat_template)
    if warm_start_tasks is not None:
        if warm_start_tasks < 1:
            raise ValueError(f"model.warm_start_tasks must be >= 1 or null, got {warm_start_tasks}")
        spec.update(warm_start_tasks=warm_start_tasks)
    if warm_start_policy != "random":  # the random walks' caches keep their keys (the prob does not change them)
        spec.update(warm_start_policy=warm_start_policy, warm_start_expert_prob=float(warm_start_expert_prob))
    if (tokenizer_episodes, warm_start_walks, warm_start_action_tokens) != (200, 128, 8):  # old cache keys stay valid
        spec.update(tokenizer_episodes=tokenizer_episodes, warm_start_walks=warm_start_walks,
                    warm_start_action_tokens=warm_start_action_tokens)
    for name, v in dict(tokenizer_episodes=tokenizer_episodes, warm_start_walks=warm_start_walks,
                        warm_start_action_tokens=warm_start_action_tokens).items():
        if v < 1:
            raise ValueError(f"model.{name} must be >= 1, got {v}")
    key = hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:16]
    return Path(os.path.expanduser(cache_dir)) / key, spec


def tiny_policy(
    lora: Any,
    env_factory: Callable[[], Env],
    cache_dir: str = "~/.cache/cope-trainer/tiny",
    hidden_size: int = 128,
    num_layers: int = 4,
    num_heads: int = 4,
    vocab_size: int = 512,
    max_context: int = 2048,
    warm_start_steps: int = 300,
    warm_start_batch: int = 16,
    warm_start_lr: float = 3e-3,
    tokenizer_episodes: int = 200,
    warm_start_walks: int = 128,
    warm_start_action_tokens: int = 8,
    warm_start_tasks: int | None = None,
    warm_start_policy: WarmStartPolicy = "random",
    warm_start_expert_prob: float = 0.5,
    seed: int = 0,
    dtype: Dtype = "fp32",
    quantization: Quantization | None = None,
    gradient_checkpointing: bool = False,
    attn_implementation: str = "sdpa",
    adapter: str | None = None,
    finetune: Finetune = "lora",
    chat_template: str | None = None,
) -> Policy:
    """Build (once, cached) and load the tiny warm-started policy for the env of ``env_factory``; ``adapter``: a
    LoRA folder to start from (see :func:`cope.models.policy.load_pretrained`); ``chat_template``: another template
    than its plain ChatML (:mod:`cope.chat.templates`), e.g. ``chatml-hermes`` for native tool calls: the build's
    tokenizer carries it, so the warm start walks in its scaffold (another cached base).

    ``warm_start_policy``: ``random`` (format-only walks) or ``expert`` (noisy expert walks: the env's
    ``expert_action()`` with probability ``warm_start_expert_prob``, else a random admissible action).
    """
    out, spec = tiny_base_folder(
        env_factory, cache_dir=cache_dir, hidden_size=hidden_size, num_layers=num_layers, num_heads=num_heads,
        vocab_size=vocab_size, max_context=max_context, warm_start_steps=warm_start_steps, warm_start_batch=warm_start_batch,
        warm_start_lr=warm_start_lr, tokenizer_episodes=tokenizer_episodes, warm_start_walks=warm_start_walks,
        warm_start_action_tokens=warm_start_action_tokens, warm_start_tasks=warm_start_tasks,
        warm_start_policy=warm_start_policy, warm_start_expert_prob=warm_start_expert_prob, seed=seed,
        chat_template=chat_template)

    def build(tmp: Path) -> None:
        log.info("building the tiny base model in %s (once): %s", out, spec)
        with torch.random.fork_rng(devices=[]):  # the build reseeds torch: keep the caller's RNG (LoRA init) as it was
            build_tiny_base(env_factory, tmp, hidden_size, num_layers, num_heads, vocab_size, max_context,
                            warm_start_steps, warm_start_batch, warm_start_lr, seed,
                            tokenizer_episodes, warm_start_walks, warm_start_action_tokens, warm_start_tasks,
                            warm_start_policy, warm_start_expert_prob, chat_template)
        (tmp / "spec.json").write_text(json.dumps(spec, indent=1))

    build_once(out, build)  # concurrent runs (a study's parallel jobs, DDP ranks) wait for one build
    return load_pretrained(str(out), lora=lora, dtype=dtype, quantization=quantization,
                           gradient_checkpointing=gradient_checkpointing, attn_implementation=attn_implementation,
                           adapter=adapter, source_is_cache_key=True, finetune=finetune)


# its own template is plain ChatML, no tools (the config rule on env.action_format=native; model.chat_template replaces
# it)
tiny_policy.tool_template = False
