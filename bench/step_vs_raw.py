"""The trainer's optimizer step against a raw fused step on the same tokens, and peak memory against
context length and vocabulary; side by side in one run.

Variants, each a full step (zero_grad, forward, loss, backward, AdamW step) over the LoRA parameters of
the same model on the same padded batch:

* ``raw``: ``model(...).logits`` + ``F.cross_entropy`` on the action tokens weighted by the advantage
  (what a plain PyTorch policy-gradient step costs; no PPO ratio, no metrics);
* ``trainer``: the project's step as ``training_step`` runs it (``AgentRLModule._backward``: log-probs
  from :mod:`cope.train.logprobs`, ``PolicyGradient`` with its clipped ratio and metrics);
* ``before``: the path this project used until 2026-12-01 (full logits, a per-row fp32 log-softmax and
  an entropy over the whole vocabulary at every position, then the same objective).

``raw / trainer`` is the speed of the trainer relative to the raw step (1.0 = as fast; the goal is
>= 0.9). Variants run interleaved round-robin after a warm-up round, one thread by default. Memory: the
peak RSS delta over the step (CPU, sampled every 5 ms after ``malloc_trim``; approximate) or
``torch.cuda.max_memory_allocated`` over the step start (CUDA).

Usage: ``python -m bench.step_vs_raw`` (speed at vocabularies 1k, 32k, 152k and memory at contexts
1k-8k); ``--quick`` for a seconds-long smoke run.
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
from pathlib import Path

import torch
import torch.nn.functional as F

from bench.step_overhead import StepMeter
from cope.algos.grpo import PolicyGradient
from cope.models.policy import Policy
from cope.train.logprobs import token_logprobs
from cope.train.module import AgentRLModule
from cope.train.objectives import ForwardOut, combine


def build(vocab: int, hidden: int, layers: int, seed: int = 0) -> Policy:
    from peft import LoraConfig, get_peft_model
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen2Config(hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=vocab, tie_word_embeddings=True, max_position_embeddings=16384)
    base = Qwen2ForCausalLM(cfg)
    for p in base.parameters():
        p.requires_grad_(False)
    model = get_peft_model(base, LoraConfig(r=16, lora_alpha=32, target_modules="all-linear", lora_dropout=0.0))
    return Policy(model=model, tokenizer=None, chat=None, source="random")


def batch(N: int, T: int, vocab: int, seed: int = 0) -> dict:
    """A padded batch shaped like rollouts: ragged lengths, ~30% action tokens, random advantages."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(T // 2, T + 1, (N,), generator=g)
    lengths[0] = T
    real = torch.arange(T)[None] < lengths[:, None]
    ids = torch.randint(0, vocab, (N, T), generator=g).masked_fill(~real, 0)
    act = (torch.rand(N, T, generator=g) < 0.3) & real
    act[:, 0] = False
    adv = torch.randn(N, 1, generator=g).expand(N, T) * act
    return {"input_ids": ids, "attention_mask": real.long(), "position_ids": (real.long().cumsum(-1) - 1).clamp(min=0),
            "action_mask": act, "advantages": adv.contiguous(), "aux_row": torch.zeros(N, dtype=torch.bool)}


def make_steps(policy: Policy, mb: dict):
    params = policy.trainable_parameters()
    opt = torch.optim.AdamW(params, lr=1e-5)
    module = AgentRLModule(policy, [PolicyGradient()], optimizer=functools.partial(torch.optim.AdamW, lr=1e-5))
    module.manual_backward = lambda loss: loss.backward()
    module.score_minibatches([mb])  # old log-probs (and entropy) as the scoring pass fills them
    model = policy.model
    ids, act, adv = mb["input_ids"], mb["action_mask"], mb["advantages"]

    def raw():
        opt.zero_grad(set_to_none=True)
        logits = model(input_ids=ids, attention_mask=mb["attention_mask"], position_ids=mb["position_ids"], use_cache=False).logits
        sel = act[:, 1:]
        nll = F.cross_entropy(logits[:, :-1][sel], ids[:, 1:][sel], reduction="none")  # fused log-softmax + gather
        (nll * adv[:, 1:][sel]).mean().backward()
        opt.step()

    def trainer():
        opt.zero_grad(set_to_none=True)
        module._backward(mb)
        opt.step()

    def before():
        opt.zero_grad(set_to_none=True)
        logits = model(input_ids=ids, attention_mask=mb["attention_mask"], position_ids=mb["position_ids"], use_cache=False).logits
        lp, ent = token_logprobs(logits, ids)
        total, _ = combine(module.objectives, ForwardOut(lp, ent, None), mb, 0)
        total.backward()
        opt.step()

    return {"raw": raw, "trainer": trainer, "before": before}


def measure(steps: dict, rounds: int, warmup: int, cuda: bool) -> dict:
    times = {k: [] for k in steps}
    mem = {k: 0.0 for k in steps}
    meter = StepMeter(cuda)
    for r in range(warmup + rounds):
        for name, fn in steps.items():
            meter.start()
            fn()
            dt, peak = meter.stop()
            if r >= warmup:
                times[name].append(dt)
                mem[name] = max(mem[name], peak / 2**20)
    return {k: {"mean_s": statistics.mean(v), "peak_mib": mem[k]} for k, v in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="seconds-long smoke run (tiny shapes)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--json", type=str, default=None, help="also write the results here")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    cuda = torch.cuda.is_available()
    dev = torch.device("cuda" if cuda else "cpu")
    speed = [(1000, 16, 768), (32000, 8, 512), (152064, 4, 512)]  # (vocab, N, T)
    memory = [(32000, 1, T) for T in (1024, 2048, 4096, 8192)] + [(152064, 1, 2048)]
    if args.quick:
        speed, memory, args.rounds = [(1000, 2, 64), (8000, 2, 64)], [(8000, 1, 128)], 1
    print(f"device {dev}, torch {torch.__version__}, threads {args.threads}, model hidden {args.hidden} x {args.layers} layers, "
          f"LoRA r=16 all-linear; {args.rounds} timed rounds after 1 warm-up, interleaved", flush=True)
    results = {"speed": [], "memory": []}
    for section, shapes in (("speed", speed), ("memory", memory)):
        for vocab, N, T in shapes:
            policy = build(vocab, args.hidden, args.layers)
            policy.model.to(dev)
            mb = {k: v.to(dev) for k, v in batch(N, T, vocab).items()}
            res = measure(make_steps(policy, mb), args.rounds if section == "speed" else 1, 1, cuda)
            row = {"vocab": vocab, "N": N, "T": T, **{f"{k}_{m}": v[m] for k, v in res.items() for m in v},
                   "raw_over_trainer": res["raw"]["mean_s"] / res["trainer"]["mean_s"],
                   "raw_over_before": res["raw"]["mean_s"] / res["before"]["mean_s"]}
            results[section].append(row)
            print(json.dumps(row), flush=True)
            del policy, mb
    print("\nspeed (seconds per step; raw/x = x's speed relative to the raw step)")
    print(f"{'vocab':>7} {'N x T':>9} {'raw':>8} {'trainer':>8} {'before':>8} {'raw/trainer':>12} {'raw/before':>11}")
    for r in results["speed"]:
        print(f"{r['vocab']:>7} {r['N']:>3} x {r['T']:<5} {r['raw_mean_s']:>8.3f} {r['trainer_mean_s']:>8.3f} {r['before_mean_s']:>8.3f} "
              f"{r['raw_over_trainer']:>12.2f} {r['raw_over_before']:>11.2f}")
    print("\npeak memory per step, MiB (" + ("CUDA allocated" if cuda else "CPU RSS delta, approximate") + ")")
    print(f"{'vocab':>7} {'N x T':>9} {'raw':>8} {'trainer':>8} {'before':>8}")
    for r in results["memory"]:
        peaks = " ".join(f"{r[k + '_peak_mib']:>8.0f}" for k in ("raw", "trainer", "before"))
        print(f"{r['vocab']:>7} {r['N']:>3} x {r['T']:<5} {peaks}")
    if args.json or os.environ.get("OUT"):
        path = Path(args.json or Path(os.environ["OUT"]) / "step_vs_raw.json")
        path.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
