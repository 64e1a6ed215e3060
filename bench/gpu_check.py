"""GPU check: the project's training step and generation at Qwen2.5-7B's exact shape on one NVIDIA GPU.

What it builds: a randomly initialised Qwen2ForCausalLM of Qwen2.5-7B's shape (:data:`QWEN25_7B`, written
here: no weights, no tokenizer, no download), constructed directly in bf16 on the GPU, with the project's
7B preset applied the way ``cope.models.policy.load_pretrained`` applies it (``conf/model/qwen2.5-7b.yaml``: the
LoRA config, r=32 / alpha 64 on all 7 projections, via peft; gradient checkpointing; sdpa). Settings the
step reads come from the project's configs too: AdamW lr / weight decay, the gradient clip and the
sampling temperature (``conf/config.yaml``), PolicyGradient's arguments (``conf/algo/grpo.yaml``), CoPE's
K, weight, normalization, masking and packing of the continuation reading (``conf/algo/cope_continuation.yaml``: its
packed layout is the heaviest forward; the authors' separate forecast step trains plain rows, cheaper).

What it runs, through the project's own code: synthetic episodes (``cope.episode.Episode`` with a ChatML
scaffold of Qwen2.5's ids and random content ids; half of each group of 8 successful, 10% invalid steps),
``cope.train.batch.collate``, GRPO advantages (``cope.train.advantages.group_advantages``), the module's scoring pass
(``AgentRLModule.score_minibatches``), then optimizer steps written as ``AgentRLModule.training_step``
writes them: zero grads, ``module._backward`` (micro-batches under ``module.max_tokens_per_microbatch``;
``manual_backward`` patched to plain ``.backward()``, as tests/test_microbatch.py does, since no Trainer
runs), ``cope.train.objectives.combine`` for the logged loss, gradient-norm clipping
(``torch.nn.utils.clip_grad_norm_``: what Lightning's ``clip_gradients`` does in bf16-true), AdamW over the
LoRA parameters (``module.configure_optimizers``). Two objectives: GRPO (``cope.algos.grpo.PolicyGradient``)
and CoPE (+ ``cope.algos.cope.loss.ForecastLoss`` on forecast targets from
``cope.algos.cope.chunks.build_chunks`` laid out by ``pack_forecasts``), each also on the shared-prefix path
(``cope_tree``: the packed rows as trees; ``grpo_shared``: each group's prompt forwarded once, ``data.share_prefix``),
both through tree attention (the tiles kernel: FlexAttention is not selectable in training, its kernel is checked by
a ``gpu``-marked test). Then HF generation with
``cope.rollout.hf_actor.CachedSamplingActor`` (KV cache, nucleus sampling at T=1) at batch 64.

Sizes on the GPU (default), chosen to finish in well under 8 minutes on one H200:
    * 16 episodes (2 GRPO groups of 8) of 7.6k to 8.2k tokens (125k tokens per minibatch), 26 to 30 steps
      each: a 400-token system prompt, actions of 16-64 tokens, observations of 120-300 tokens.
    * ``max_tokens_per_microbatch`` 32,768: 4 rows of ~8k for GRPO; for CoPE (K=3: 224 forecast chunks
      from the 8 successful episodes, packed into their rows, which grow to 9.8k-10.7k) 3 rows, 6
      micro-batches. Meant to fit an 80 GB card too.
    * 1 warm-up step and 2 timed steps per objective (fewer when ``--max-seconds`` would be passed).
    * Generation: 64 prompts of 128 tokens, 64 new tokens each; 1 warm-up call, 2 timed.
``--smoke`` runs the same code on CPU at tiny shapes (a 2-layer model, 4 episodes of ~256 tokens) in
seconds: what tests/test_gpu_check.py runs.

Reports per phase: step seconds (mean of the timed steps), tokens/s (transcript tokens of the minibatch /
step seconds; the CoPE row counts the same transcript tokens, so its rate is comparable), the padded cells
the forward saw, micro-batches, the scoring pass's seconds, peak memory (``torch.cuda.max_memory_allocated``
over each step, reset before it: weights and optimizer state included; null on CPU), the forecast
overhead (CoPE step / GRPO step), and generation tokens/s (new tokens / wall time of the call, prefill
included). Prints a table, then one JSON line; writes the JSON to ``$OUT/gpu_check.json`` when ``OUT`` is
set (or to ``--json``), after every phase, so a run cut short still leaves what it measured. A phase that
fails is recorded with its error and the run goes on; the exit status is 1 then.

Runs from a bare checkout: no ``pip install``, no PYTHONPATH (the package mapping of pyproject.toml,
``cope`` = src/cope, ``cope.envs`` = envs, ``cope.callbacks`` = callbacks, is installed as an import
finder below); no hydra-core or omegaconf (the GPU image has neither; YAML is read with PyYAML).

On the device tool (nvidia-h200, torch 2.11 / transformers 5.17 / peft / lightning 2.6.6; carry nothing)::

    run(command="nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader; set -o pipefail; "
                "PYTHONUNBUFFERED=1 python3 bench/gpu_check.py 2>&1 | tee $OUT/gpu_check.log", timeout_s=600)

Anywhere else: ``python bench/gpu_check.py`` (CUDA) or ``python bench/gpu_check.py --smoke`` (CPU).
"""
from __future__ import annotations

import argparse
import functools
import gc
import importlib.abc
import importlib.util
import inspect
import json
import os
import random
import sys
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


# -- a bare checkout: pyproject's package-dir as an import finder -----------------------------------
def _package_dirs() -> dict[str, Path]:
    try:
        import tomllib

        dirs = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    except (ImportError, KeyError, OSError):  # Python 3.10 has no tomllib: the same mapping, written out
        dirs = {"cope": "src/cope", "cope.callbacks": "callbacks", "cope.envs": "envs"}
    return {name: REPO / d for name, d in dirs.items()}


class _CheckoutFinder(importlib.abc.MetaPathFinder):
    """Finds the mapped packages (``cope``, ``cope.envs``, ``cope.callbacks``) in this checkout, first;
    their subpackages resolve through the parent's ``__path__`` as usual."""

    def __init__(self, dirs: dict[str, Path]):
        self.dirs = dirs

    def find_spec(self, fullname, path=None, target=None):
        d = self.dirs.get(fullname)
        if d is None or not (d / "__init__.py").is_file():
            return None
        return importlib.util.spec_from_file_location(fullname, d / "__init__.py", submodule_search_locations=[str(d)])


if not any(isinstance(f, _CheckoutFinder) for f in sys.meta_path):
    sys.meta_path.insert(0, _CheckoutFinder(_package_dirs()))


# -- shapes and sizes --------------------------------------------------------------------------------
# Qwen2.5-7B(-Instruct)'s config.json, the fields that set the shape and the numerics
QWEN25_7B = dict(vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                 num_key_value_heads=4, max_position_embeddings=32768, rope_parameters={"rope_type": "default", "rope_theta": 1e6},
                 rms_norm_eps=1e-6, tie_word_embeddings=False, hidden_act="silu", use_sliding_window=False, max_window_layers=28,
                 attention_dropout=0.0, initializer_range=0.02, bos_token_id=151643, eos_token_id=151645)
TINY = {**QWEN25_7B, "vocab_size": 1024, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "bos_token_id": 1002, "eos_token_id": 1001}
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class Sizes:
    episodes: int  # per minibatch (one optimizer step)
    group_size: int
    episode_tokens: int  # longest episode; each is 0-1/16 shorter
    system_tokens: int
    action_tokens: tuple[int, int]  # per action, before the stop id
    obs_tokens: tuple[int, int]
    microbatch_tokens: int  # module.max_tokens_per_microbatch
    warmup: int
    steps: int
    gen_batch: int
    gen_prompt: int
    gen_new: int
    gen_runs: int


GPU = Sizes(16, 8, 8192, 400, (16, 64), (120, 300), 32768, 1, 2, 64, 128, 64, 2)
SMOKE = Sizes(4, 2, 256, 24, (2, 6), (6, 16), 512, 1, 2, 8, 16, 8, 1)


def log(msg: str) -> None:
    print(f"[gpu_check {time.perf_counter() - _T0:6.1f}s] {msg}", file=sys.stderr, flush=True)


_T0 = time.perf_counter()


# -- the project's settings, read from its configs (plain YAML, no hydra) ----------------------------
def project_settings() -> dict:
    import yaml

    def load(rel: str) -> dict:
        return yaml.safe_load((REPO / rel).read_text())

    model, root = load("conf/model/qwen2.5-7b.yaml"), load("conf/config.yaml")
    grpo, cope = load("conf/algo/grpo.yaml"), load("conf/algo/cope_continuation.yaml")
    opt = root["module"]["optimizer"]
    return {
        "lora": {k: v for k, v in model["lora"].items() if k != "_target_"},
        "dtype": model["dtype"], "gradient_checkpointing": bool(model["gradient_checkpointing"]),
        "attn_implementation": model["attn_implementation"],
        "lr": float(opt["lr"]), "weight_decay": float(opt["weight_decay"]),
        "gradient_clip_val": root["module"]["gradient_clip_val"], "temperature": float(root["data"]["sampling"]["temperature"]),
        "pg": {k: v for k, v in grpo["objectives"]["pg"].items() if k != "_target_"},
        "cope": cope["cope"],
    }


# -- the policy --------------------------------------------------------------------------------------
def build_policy(shape: dict, device, settings: dict, chat):
    """A random model of ``shape`` in the preset's dtype on ``device``, frozen, gradient checkpointing and
    LoRA added as ``cope.models.policy.load_pretrained`` does after ``from_pretrained``."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from cope.models.policy import DTYPES, Policy

    config = Qwen2Config(**shape)
    with torch.device(device):  # allocated and initialised there: no fp32 or host copy of 7B weights
        model = Qwen2ForCausalLM._from_config(config, dtype=DTYPES[settings["dtype"]], attn_implementation=settings["attn_implementation"])
    for p in model.parameters():
        p.requires_grad_(False)
    if settings["gradient_checkpointing"]:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.config.use_cache = False
    model = get_peft_model(model, LoraConfig(**settings["lora"]))
    return Policy(model=model, tokenizer=None, chat=chat, source="random init, Qwen2.5-7B shape")


def expected_lora_params(shape: dict, r: int) -> int:
    hidden, inter = shape["hidden_size"], shape["intermediate_size"]
    kv = shape["num_key_value_heads"] * hidden // shape["num_attention_heads"]
    per_layer = (hidden + hidden) * 2 + (hidden + kv) * 2 + (hidden + inter) * 3  # q, o; k, v; gate, up, down: r * (in + out) each
    return r * per_layer * shape["num_hidden_layers"]


# -- synthetic episodes ------------------------------------------------------------------------------
def scaffold(vocab: int):
    """ChatML ids: Qwen2.5's own at its vocabulary (<|im_start|> 151644, <|im_end|> 151645, <|endoftext|>
    151643 = pad and second eos), stand-ins at the top of a small one. Returns (chat, pad id, content id range)."""
    from cope.chat import ChatFormat

    if vocab > 151645:
        start, end, eot, nl, system, user, assistant, words = 151644, 151645, 151643, 198, 8948, 872, 77091, (220, 151000)
    else:
        start, end, eot, nl, system, user, assistant, words = vocab - 24, vocab - 23, vocab - 22, 13, 10, 11, 12, (20, vocab - 24)
    chat = ChatFormat(system_open=(start, system, nl), user_open=(start, user, nl), assistant_open=(start, assistant, nl),
                      turn_end=(end,), newline=(nl,), stop_ids=(end, eot))
    return chat, eot, words


def make_episode(chat, words, sizes: Sizes, rng: random.Random, index: int, group: int, success: bool, invalid_frac: float = 0.1):
    """One transcript laid out as the rollout engine lays it out (docs/CONTRACTS.md), of at most
    ``sizes.episode_tokens`` minus a random 1/16, every action closed by the stop id."""
    from cope.envs.base import Task
    from cope.episode import Episode, Role, Step

    def rand(lo_hi):
        return [rng.randrange(*words) for _ in range(rng.randint(*lo_hi) if isinstance(lo_hi, tuple) else lo_hi)]

    limit = sizes.episode_tokens - rng.randrange(sizes.episode_tokens // 16)
    ep = Episode(task=Task("synthetic", "train", group), group=group, success=success, score=float(success), reward=float(success))
    task_rng, own = random.Random(group), rng  # a group's episodes share their task: the system prompt and first observation
    rng = task_rng
    ep.append([*chat.system_open, *rand(sizes.system_tokens), *chat.turn_end, *chat.newline, *chat.user_open], Role.PROMPT)
    ep.append(rand(sizes.obs_tokens), Role.OBSERVATION)
    ep.append(chat.close_turn(), Role.PROMPT)
    rng = own
    while True:
        action, obs = rand(sizes.action_tokens) + [chat.stop_id], rand(sizes.obs_tokens)
        grow = len(action) + len(chat.after_action(True)) + len(obs) + (len(chat.close_turn()) if ep.steps else 0)
        if ep.steps and len(ep.tokens) + grow > limit:
            break
        if ep.steps:  # the previous feedback turn ends by opening this action's turn
            ep.steps[-1].obs_end = ep.append(chat.close_turn(), Role.PROMPT)[1]
        a0, a1 = ep.append(action, Role.ACTION)
        o0, _ = ep.append(chat.after_action(True), Role.PROMPT)
        _, o1 = ep.append(obs, Role.OBSERVATION)
        ep.steps.append(Step(a0, a1, True, rng.random() >= invalid_frac, f"a{len(ep.steps)}", obs_start=o0, obs_end=o1))
    ep.prompt_len = ep.steps[0].action_start
    return ep


def make_episodes(chat, words, sizes: Sizes, seed: int = 0) -> list:
    import torch

    from cope.train.advantages import group_advantages

    rng = random.Random(seed)
    eps = [make_episode(chat, words, sizes, rng, i, i // sizes.group_size, success=i % 2 == 0) for i in range(sizes.episodes)]
    adv, _ = group_advantages(torch.tensor([e.reward for e in eps]), torch.tensor([e.group for e in eps]))
    for e, a in zip(eps, adv.tolist()):
        e.advantage = a
    return eps


# -- phases ------------------------------------------------------------------------------------------
def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _peak_gib(device) -> float | None:
    import torch

    return round(torch.cuda.max_memory_allocated(device) / 2**30, 2) if device.type == "cuda" else None


def train_step(module, opt, batch) -> float:
    """``AgentRLModule.training_step`` without a Trainer: zero grads, micro-batched forward + backward,
    the logged total, clip, optimizer step (no scheduler in the default config)."""
    import torch

    opt.zero_grad(set_to_none=True)
    _, total, _ = module._backward(batch)
    if module.gradient_clip_val is not None:
        torch.nn.utils.clip_grad_norm_(module.policy.trainable_parameters(), module.gradient_clip_val)
    opt.step()
    return float(total)


def run_training(name: str, policy, pad: int, objectives, episodes, settings: dict, sizes: Sizes, device, deadline: float,
                 cope: dict | None, shared: bool = False) -> dict:
    """One objective's phase. ``shared``: the shared-prefix path (``data.share_prefix=true``: tree attention,
    ``"cope_tree"``): with ``cope``, its packed rows side by side under tree attention (without: their dense mask on
    SDPA); without ``cope``, the GRPO groups' prefixes forwarded once. The model is back on SDPA afterwards."""
    import torch

    from cope.algos.cope.chunks import build_chunks
    from cope.algos.cope.packing import PACKINGS
    from cope.train.batch import collate, row_lengths
    from cope.train.group_prefix import pack_groups
    from cope.train.module import AgentRLModule
    from cope.train.tree_batch import use_tree_attention

    chat = policy.chat
    mb = collate(episodes, pad)
    res: dict = {"episodes": len(episodes), "tokens": sum(len(e.tokens) for e in episodes), "shared": shared}
    if cope is not None:
        # the ForecastTargets callback's call: every knob of the `cope:` node that build_chunks takes
        known = inspect.signature(build_chunks).parameters
        invalid = cope.get("invalid", "mask")  # as ForecastTargets maps it
        chunks, _ = build_chunks(episodes, chat, rng=random.Random(0), mask_invalid=invalid == "mask", cut_at_invalid=invalid == "cut",
                                 **{k: v for k, v in cope.items() if k in known})
        mb = PACKINGS[cope["packing"]](mb, episodes, chunks, pad)
        if shared:  # as the DataModule does: the trees side by side, rows within the micro-batch budget
            mb = pack_groups(mb, episodes, max_row_tokens=sizes.microbatch_tokens)
        res.update(chunks=len(chunks), layout=cope["packing"], K=int(cope["K"]))
    elif shared:
        mb = pack_groups(mb, episodes, max_row_tokens=sizes.microbatch_tokens)
        res["tokens_forwarded"] = mb["packed"].tokens
    if shared:
        use_tree_attention(policy.model)
    res["rows"], res["width"] = int(mb["input_ids"].shape[0]), int(mb["input_ids"].shape[1])
    opt_factory = functools.partial(torch.optim.AdamW, lr=settings["lr"], weight_decay=settings["weight_decay"])
    module = AgentRLModule(policy, objectives, optimizer=opt_factory, temperature=settings["temperature"],
                           gradient_clip_val=settings["gradient_clip_val"], max_tokens_per_microbatch=sizes.microbatch_tokens)
    module.manual_backward = lambda loss: loss.backward()  # no Trainer: the plain autograd call
    module.to(device)
    t0 = time.perf_counter()
    module.score_minibatches([mb])  # old log-probs (and entropy), no grad, under the same token budget
    _sync(device)
    res["score_s"] = round(time.perf_counter() - t0, 3)
    batch = {k: v.to(device) for k, v in mb.items()}
    del mb
    parts = module.micro_batches(batch)
    res["microbatches"] = len(parts)
    res["cells"] = int(sum(len(r) * n for r, n in parts)) if parts[0][0] is not None else res["rows"] * int(row_lengths(batch).max())
    opt = module.configure_optimizers()
    lora_b = [p for n, p in module.named_parameters() if "lora_B" in n]
    before = [p.detach().clone() for p in lora_b]
    module.train()
    times, peaks, losses = [], [], []
    for i in range(sizes.warmup + sizes.steps):
        timed = i >= sizes.warmup
        if timed and times and time.perf_counter() + times[-1] > deadline:
            log(f"{name}: stopping after {len(times)} timed step(s) (--max-seconds)")
            break
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        _sync(device)
        t0 = time.perf_counter()
        losses.append(train_step(module, opt, batch))
        _sync(device)
        dt = time.perf_counter() - t0
        log(f"{name}: step {i} {'timed' if timed else 'warm-up'} {dt:.2f}s loss {losses[-1]:.4f} peak {_peak_gib(device)} GiB")
        if timed:
            times.append(dt)
            peaks.append(_peak_gib(device))
    res["step_s_all"] = [round(t, 3) for t in times]
    res["step_s"] = round(sum(times) / len(times), 3)
    res["tokens_per_s"] = round(res["tokens"] / res["step_s"], 1)
    res["peak_mem_gib"] = max(peaks) if device.type == "cuda" else None
    res["loss"] = losses
    res["finite"] = all(x == x and abs(x) != float("inf") for x in losses)
    res["adapter_moved"] = any(not torch.equal(a, b) for a, b in zip(lora_b, before))
    del opt, batch, module
    if shared:
        policy.model.set_attn_implementation("sdpa")
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return res


def run_generation(policy, pad: int, sizes: Sizes, device, words, temperature: float) -> dict:
    import torch

    from cope.rollout.hf_actor import CachedSamplingActor

    chat = policy.chat
    rng = random.Random(1)
    body = sizes.gen_prompt - len(chat.system_open) - len(chat.turn_end) - len(chat.newline) - len(chat.user_open) - len(chat.close_turn())
    prompts = [[*chat.system_open, *[rng.randrange(*words) for _ in range(body // 2)], *chat.turn_end, *chat.newline, *chat.user_open,
                *[rng.randrange(*words) for _ in range(body - body // 2)], *chat.close_turn()] for _ in range(sizes.gen_batch)]
    policy.model.eval()
    model, note = policy.model, None  # cope.rollout.hf_actor handles the cache keyword of older transformers
    CachedSamplingActor(model, pad, chat.stop_ids, max_new_tokens=4, temperature=temperature, seed=0)(prompts)  # warm-up
    actor = CachedSamplingActor(model, pad, chat.stop_ids, max_new_tokens=sizes.gen_new, temperature=temperature, seed=0)
    times, new = [], []
    for _ in range(sizes.gen_runs):
        actor.reset()
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        _sync(device)
        t0 = time.perf_counter()
        outs = actor(prompts)
        _sync(device)
        times.append(time.perf_counter() - t0)
        new.append(sum(len(o) for o in outs))
    secs = sum(times) / len(times)
    res = {"batch": sizes.gen_batch, "prompt_tokens": len(prompts[0]), "max_new_tokens": sizes.gen_new, "new_tokens": new[-1],
           "seconds_all": [round(t, 3) for t in times], "seconds": round(secs, 3), "tokens_per_s": round(sum(new) / sum(times), 1),
           "peak_mem_gib": _peak_gib(device)}
    if note:
        res["compat"] = note
    return res


# -- report ------------------------------------------------------------------------------------------
def table(summary: dict) -> str:
    def fmt(x, spec="{:,.2f}"):
        return "-" if x is None else spec.format(x)

    lines = ["| phase | step s | tokens/s | tokens | cells | micro-batches | score s | peak GiB |", "|---|---|---|---|---|---|---|---|"]
    for name in ("grpo", "cope", "cope_tree", "grpo_shared"):
        r = summary.get(name) or {}
        if "step_s" in r:
            lines.append(f"| {name} | {fmt(r['step_s'], '{:.3f}')} | {fmt(r['tokens_per_s'], '{:,.0f}')} | {r['tokens']:,} | "
                         f"{r['cells']:,} | {r['microbatches']} | {fmt(r['score_s'], '{:.3f}')} | {fmt(r['peak_mem_gib'])} |")
        elif r.get("error"):
            lines.append(f"| {name} | failed: {r['error'].splitlines()[-1][:100]} | | | | | | |")
    g = summary.get("generation") or {}
    if "tokens_per_s" in g:
        lines.append(f"| generation (batch {g['batch']}, {g['max_new_tokens']} new) | {fmt(g['seconds'], '{:.3f}')} | "
                     f"{fmt(g['tokens_per_s'], '{:,.0f}')} | {g['new_tokens']:,} | | | | {fmt(g['peak_mem_gib'])} |")
    elif g.get("error"):
        lines.append(f"| generation | failed: {g['error'].splitlines()[-1][:100]} | | | | | | |")
    if summary.get("forecast_overhead") is not None:
        lines.append(f"\nforecast overhead (CoPE step / GRPO step): {summary['forecast_overhead']:.2f}")
    for key, what in (("cope_tree_vs_cope", "CoPE packed rows, tree attention (tiles) / their dense mask"),
                      ("grpo_shared_vs_grpo", "GRPO, group prefixes shared / unshared")):
        if summary.get(key) is not None:
            lines.append(f"{what} (step time): {summary[key]:.2f}")
    return "\n".join(lines)


def write(summary: dict, path: Path | None) -> None:
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(summary, indent=2) + "\n")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny shapes, seconds (the test's run)")
    ap.add_argument("--steps", type=int, help="timed steps per objective (default 2)")
    ap.add_argument("--microbatch-tokens", type=int, help="module.max_tokens_per_microbatch (default 32768; smoke 512)")
    ap.add_argument("--max-seconds", type=float, default=420.0, help="stop timing more steps past this (after one timed step)")
    ap.add_argument("--json", type=Path, help="write the JSON here (default $OUT/gpu_check.json when OUT is set)")
    args = ap.parse_args(argv)
    if args.steps is not None and args.steps < 1:
        ap.error("--steps must be >= 1")

    import torch

    if not args.smoke and not torch.cuda.is_available():
        print("gpu_check: no CUDA device (torch.cuda.is_available() is False). This script is for an NVIDIA GPU; "
              "run `python bench/gpu_check.py --smoke` for the CPU smoke run.", file=sys.stderr)
        return 2
    sizes, shape = (SMOKE, TINY) if args.smoke else (GPU, QWEN25_7B)
    overrides = {k: v for k, v in (("steps", args.steps), ("microbatch_tokens", args.microbatch_tokens)) if v is not None}
    sizes = Sizes(**{**asdict(sizes), **overrides})
    device = torch.device("cpu" if args.smoke else "cuda")
    out = args.json or (Path(os.environ["OUT"]) / "gpu_check.json" if os.environ.get("OUT") else None)
    if args.smoke:
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    torch.manual_seed(0)
    deadline = _T0 + args.max_seconds

    import lightning
    import peft
    import transformers

    import cope

    settings = project_settings()
    summary: dict = {"smoke": args.smoke, "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                     "versions": {"python": sys.version.split()[0], "torch": torch.__version__, "transformers": transformers.__version__,
                                  "peft": peft.__version__, "lightning": lightning.__version__},
                     "cope_path": str(Path(cope.__file__).resolve().parent), "sizes": asdict(sizes), "settings": settings}
    failed = False
    t0 = time.perf_counter()
    chat, pad, words = scaffold(shape["vocab_size"])
    policy = build_policy(shape, device, settings, chat)
    _sync(device)
    n_all = sum(p.numel() for p in policy.model.parameters())
    n_train = sum(p.numel() for p in policy.trainable_parameters())
    summary["model"] = {"shape": {k: v for k, v in shape.items() if k != "rope_parameters"},
                        "rope_theta": shape["rope_parameters"]["rope_theta"], "params": n_all, "params_base": n_all - n_train,
                        "trainable": n_train,
                        "trainable_expected": expected_lora_params(shape, int(settings["lora"]["r"])),
                        "lora_targets_complete": sorted(settings["lora"]["target_modules"]) == sorted(LORA_TARGETS),
                        "build_s": round(time.perf_counter() - t0, 2), "build_peak_gib": _peak_gib(device)}
    log(f"model: {n_all / 1e9:.3f}B params, {n_train / 1e6:.1f}M trainable, built in {summary['model']['build_s']}s")
    if n_train != summary["model"]["trainable_expected"]:
        raise RuntimeError(f"LoRA trainable parameters {n_train} != expected {summary['model']['trainable_expected']}")
    episodes = make_episodes(chat, words, sizes)
    summary["episode_tokens"] = [len(e.tokens) for e in episodes]
    summary["episode_steps"] = [e.num_steps for e in episodes]

    from cope.algos.cope.loss import ForecastLoss
    from cope.algos.grpo import PolicyGradient

    c = settings["cope"]  # as conf/algo/cope_continuation.yaml builds the objective (no LossBalance callback: an adaptive scale stays 1)
    forecast = ForecastLoss(weight=float(c["weight"]), normalize=c["normalize"], adaptive_target=c.get("adaptive_ratio"))
    train = functools.partial(run_training, policy=policy, pad=pad, episodes=episodes, settings=settings, sizes=sizes, device=device,
                              deadline=deadline)
    phases = {
        "grpo": lambda: train("grpo", objectives=[PolicyGradient(**settings["pg"])], cope=None),
        "cope": lambda: train("cope", objectives=[PolicyGradient(**settings["pg"]), forecast], cope=c),
        # the shared-prefix path (tree attention): the packed rows side by side, then GRPO groups
        "cope_tree": lambda: train("cope_tree", objectives=[PolicyGradient(**settings["pg"]), forecast], cope=c, shared=True),
        "grpo_shared": lambda: train("grpo_shared", objectives=[PolicyGradient(**settings["pg"])], cope=None, shared=True),
        "generation": lambda: run_generation(policy, pad, sizes, device, words, settings["temperature"]),
    }
    for name, fn in phases.items():
        log(f"{name}: start")
        try:
            summary[name] = fn()
        except Exception as e:  # noqa: BLE001 - a failed phase is reported, the others still run
            failed = True
            summary[name] = {"error": "".join(traceback.format_exception_only(type(e), e)).strip()}
            traceback.print_exc()
        gc.collect()  # a failed phase's frames (its batch, optimizer) are gone once its exception is
        if device.type == "cuda":
            torch.cuda.empty_cache()
        if name == "cope" and "step_s" in summary.get("grpo", {}) and "step_s" in summary[name]:
            summary["forecast_overhead"] = round(summary[name]["step_s"] / summary["grpo"]["step_s"], 3)
        for shared, base in (("cope_tree", "cope"), ("grpo_shared", "grpo")):  # shared / reference
            if name == shared and "step_s" in summary.get(base, {}) and "step_s" in summary[name]:
                summary[f"{shared}_vs_{base}"] = round(summary[name]["step_s"] / summary[base]["step_s"], 3)
        write(summary, out)
    summary["imported_hydra_or_omegaconf"] = sorted({m.split(".")[0] for m in sys.modules} & {"hydra", "omegaconf"})
    summary["total_s"] = round(time.perf_counter() - _T0, 1)
    summary["ok"] = not failed
    write(summary, out)
    print(table(summary))
    print(json.dumps(summary))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
