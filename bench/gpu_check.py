"""GPU check: the project's LoRA training step, generation and tree-attention kernels at Qwen2.5-7B's exact shape on
one NVIDIA GPU, phase by phase, in minutes (docs/gpu.md: the commands in order, the card each needs).

What it builds: a randomly initialised Qwen2ForCausalLM of Qwen2.5-7B's shape (:data:`QWEN25_7B`, written here: no
weights, no tokenizer, no download), constructed directly in bf16 on the GPU, with the project's 7B preset applied
the way ``cope.models.policy.load_pretrained`` applies it (``conf/model/qwen2.5-7b.yaml``: the LoRA config, r=32 /
alpha 64 on all 7 projections, via peft, which keeps the adapter fp32; gradient checkpointing; sdpa). Settings the
step reads come from the project's configs too: AdamW lr / weight decay, the gradient clip and the sampling
temperature (``conf/config.yaml``), PolicyGradient's arguments (``conf/algo/grpo.yaml``), CoPE's K, weight,
normalization, masking and packing of the continuation reading (``conf/algo/cope_continuation.yaml``: its packed
layout is the heaviest forward), and the Trainer's (``conf/trainer/gpu.yaml`` over ``cpu.yaml``: one device,
``precision: bf16-mixed``).

Phases (:data:`PHASES`; ``--phase`` picks one or several by name, ``--list`` shows them all, ``--dry-run`` prints the
plan and exits; the plan is printed first on every run):

* ``grpo``, ``cope``, ``cope_tree``, ``grpo_shared``: optimizer steps through **Lightning**: a ``lightning.Trainer``
  with ``trainer=gpu``'s settings (bf16 autocast, ``precision=bf16-mixed``) fits ``cope.train.module.AgentRLModule``
  on synthetic episodes (``cope.episode.Episode`` with a ChatML scaffold of Qwen2.5's ids and random content ids;
  half of each group of 8 successful, 10% invalid steps; ``cope.batch.collate``, GRPO advantages): its own
  ``training_step`` (micro-batches under ``max_tokens_per_microbatch``, ``combine``, Lightning's ``clip_gradients``,
  AdamW over the LoRA parameters), after the module's scoring pass under the same precision context (run from
  ``on_train_start``, as the module runs it at an epoch's start). GRPO (``cope.algos.grpo.PolicyGradient``); CoPE
  (+ ``cope.algos.cope.loss.ForecastLoss`` on targets from ``build_chunks`` laid out by ``pack_forecasts``); each
  also on the shared-prefix path (``cope_tree``: the packed rows as trees; ``grpo_shared``: each group's prompt
  forwarded once, ``data.share_prefix``), both through the tiles kernel. The Trainer's one-device strategy keeps the
  model on the GPU at teardown (:func:`keep_on_device`): the next phase trains the same model.
* ``tree``: the tiles kernel alone at 7B's attention shape with the SDPA math kernel disabled, its kernel choice
  asserted, against the dense-mask reference (``bench/gpu_tree.py``). Builds no model.
* ``generation``: ``cope.rollout.hf_actor.CachedSamplingActor`` (KV cache, nucleus sampling at T=1) at batch 64, as
  the in-process engine generates in a ``trainer=gpu`` run: outside ``training_step`` (Lightning's autocast is the
  step's alone), the base weights bf16.

Sizes on the GPU (:data:`GPU`): 16 episodes (2 GRPO groups of 8) of 7.6k to 8.2k tokens (125k tokens per minibatch),
26 to 30 steps each (a 400-token system prompt, actions of 16-64 tokens, observations of 120-300 tokens);
``max_tokens_per_microbatch`` 32,768 (GRPO: 4 rows of ~8k; CoPE, K=3: 224 forecast chunks packed into the 8
successful rows, which grow to 9.8k-10.7k: 3 rows, 6 micro-batches); 1 warm-up and 2 timed steps per training phase.
Generation: 64 prompts of 128 tokens, 64 new tokens each; 1 warm-up call, 2 timed. ``--smoke`` runs the same code
on CPU at tiny shapes (a 2-layer model, 4 episodes of ~256 tokens; bf16-mixed on CPU) in seconds: what
tests/test_gpu_check.py runs.

Reports per phase: step seconds (mean of the timed steps), tokens/s (transcript tokens of the minibatch / step
seconds; the CoPE rows count the same transcript tokens, so their rate is comparable), the padded cells the forward
saw, micro-batches, the scoring pass's seconds, peak memory (``torch.cuda.max_memory_allocated`` over each step, reset
before it: weights and optimizer state included; null on CPU), the forecast overhead (CoPE step / GRPO step), the
tree kernel's seconds, peak and errors, and generation tokens/s (new tokens / wall time of the call, prefill
included). Prints a table, then one JSON line; writes the JSON to ``$OUT/gpu_check.json`` when ``OUT`` is set (or to
``--json``), after every phase, so a run cut short still leaves what it measured. A phase that fails is recorded
with its error and the run goes on; a phase not started before ``--max-seconds`` is recorded as such; the exit status
is 1 then.

Runs from a bare checkout (no ``pip install``, no PYTHONPATH: pyproject's package mapping is installed as an import
finder, ``bench/gpu_plan.py``) on the GPU image's stack (torch, transformers, peft, lightning, PyYAML; no hydra-core
or omegaconf: YAML is read with PyYAML). Needs nothing carried.

On the device tool::

    run(command="set -o pipefail; PYTHONUNBUFFERED=1 python3 bench/gpu_check.py 2>&1 | tee $OUT/gpu_check.log", timeout_s=600)

Anywhere else: ``python bench/gpu_check.py [--phase ...]`` (CUDA) or ``python bench/gpu_check.py --smoke`` (CPU).
"""
from __future__ import annotations

import argparse
import functools
import gc
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
if str(REPO) not in sys.path:  # `python3 bench/gpu_check.py` from a bare checkout: bench.* importable
    sys.path.insert(0, str(REPO))
from bench.gpu_plan import PhaseSpec, add_plan_args, check_card, install_checkout_finder, plan_only, selected  # noqa: E402

install_checkout_finder()  # `cope`, `cope.envs`, `cope.callbacks` from this checkout, no install needed

# -- the plan: phases, the card each needs, estimated minutes ------------------------------------------------------
# How the minutes are estimated (no GPU has run this yet: each is an estimate until a run's `measured` replaces it).
# Training FLOPs per token at Qwen2.5-7B: the matmul weights (7.07B, the input embedding aside) cost 14.1 GFLOP in a
# forward, attention at a ~4k mean context 1.6 more: ~15.8. A LoRA step with checkpointed layers is ~3.1 forwards
# (forward, recompute, backward through activations; frozen weights get no gradient): ~49 GFLOP a token, 6.1 PFLOP for
# a 125k-token minibatch; the scoring pass is one forward, 2.0 PFLOP. At an assumed 300 TFLOP/s sustained (38% of the
# ~790 TFLOP/s bf16 matmul measured on both lent cards; an eager HF model, LoRA's small matmuls, the chunked head):
# 20 s a step. Memory: 15.2 GB of bf16 weights, 0.3 GB of fp32 adapter and moments, checkpoints of 32k tokens x 28
# layers x 3584 x 2 B = 6.6 GB, one layer's recompute and the chunked head: well inside 80 GB (either card).
SETUP = PhaseSpec("setup", "imports (torch, transformers, peft, lightning), CUDA init, the 7.6B bf16 model built on the GPU",
                  "80GB", 0.7, "~15 s of cold imports, ~5 s CUDA init, ~20 s to build and initialise 7.6B bf16 weights and "
                  "peft's wrappers (0.3 min for `tree` alone: no model)")
PHASES = {p.name: p for p in (
    PhaseSpec("grpo", "GRPO: scoring pass + 1 warm-up + 2 timed LoRA steps, 125k tokens, through Lightning (bf16-mixed)",
              "80GB", 1.2, "2.0 PFLOP scoring + 3 x 6.1 PFLOP steps at 300 TFLOP/s = 68 s"),
    PhaseSpec("cope", "CoPE (K=3 forecast chunks packed into the rows): the same, rows 1.28x longer",
              "80GB", 1.5, "grpo's 68 s x 1.28 (224 forecast chunks: rows of 9.8k-10.7k for 8k transcripts) = 87 s"),
    PhaseSpec("cope_tree", "CoPE's packed rows as trees under tree attention (the tiles kernel), data.share_prefix",
              "80GB", 1.5, "as cope (the same cells; the tiles kernel's gathers cost about what the dense mask saves)", default=False),
    PhaseSpec("grpo_shared", "GRPO with each group's prompt forwarded once (data.share_prefix)",
              "80GB", 1.1, "grpo's 68 s less the shared prompt and first observation (~7% of the tokens) = 63 s", default=False),
    PhaseSpec("tree", "the tiles kernel at 7B's attention (28/4 heads, d128, bf16), math kernel disabled, vs dense SDPA",
              "80GB", 0.3, "2 rows x 4.1k tokens: ~0.1 TFLOP a forward + backward (milliseconds); the time is the plan's "
              "Python build, the kernels' first calls and the fp32 reference on a 1.1k-token slice: ~15 s"),
    PhaseSpec("generation", "CachedSamplingActor at batch 64: 128-token prompts, 64 new tokens; 1 warm-up + 2 timed calls",
              "80GB", 0.25, "a decode step reads 15 GB of weights (~5 ms at 3.3 TB/s) but eager HF decoding of 28 layers "
              "takes ~40 ms a step: 2 x 64 steps + prefills ~ 6 s, the warm-up's kernels ~5 s"),
)}
MODEL_PHASES = ("grpo", "cope", "cope_tree", "grpo_shared", "generation")
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
    gpu = load("conf/trainer/gpu.yaml")  # its defaults: cpu, then itself
    trainer = {**load("conf/trainer/cpu.yaml"), **{k: v for k, v in gpu.items() if k != "defaults"}}
    return {
        "lora": {k: v for k, v in model["lora"].items() if k != "_target_"},
        "dtype": model["dtype"], "gradient_checkpointing": bool(model["gradient_checkpointing"]),
        "attn_implementation": model["attn_implementation"],
        "lr": float(opt["lr"]), "weight_decay": float(opt["weight_decay"]),
        "gradient_clip_val": root["module"]["gradient_clip_val"], "temperature": float(root["data"]["sampling"]["temperature"]),
        "pg": {k: v for k, v in grpo["objectives"]["pg"].items() if k != "_target_"},
        "cope": cope["cope"],
        # what a one-device fit reads of trainer=gpu (the rest, epochs, validation and checkpoints, is the run's)
        "trainer": {k: trainer[k] for k in ("accelerator", "devices", "precision", "use_distributed_sampler",
                                            "gradient_clip_val", "log_every_n_steps")},
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


@functools.cache
def keep_on_device():
    """Lightning's one-device strategy whose teardown leaves the model on its device. ``Strategy.teardown`` moves the
    LightningModule to host memory after every fit; here the next phase trains the same 7.6B model, and two 15 GB
    copies per phase would cost seconds and host memory for nothing. The rest of its teardown is Lightning's."""
    from lightning.pytorch.strategies import SingleDeviceStrategy

    class KeepOnDevice(SingleDeviceStrategy):
        def teardown(self) -> None:
            self.precision_plugin.teardown()
            self.accelerator.teardown()
            self.checkpoint_io.teardown()

    return KeepOnDevice


@functools.cache
def step_clock():
    """A Lightning callback: the module's scoring pass at train start (timed), then per training batch the seconds
    (synchronized), the loss and the peak memory (reset before it), and a stop once one more timed step would pass the
    deadline (one timed step at least)."""
    import torch
    from lightning.pytorch import Callback

    class StepClock(Callback):
        def __init__(self, name: str, minibatch: dict, warmup: int, deadline: float):
            self.name, self.minibatch, self.warmup, self.deadline = name, minibatch, warmup, deadline
            self.times, self.peaks, self.losses, self.score_s, self._t0 = [], [], [], None, 0.0

        def on_train_start(self, trainer, module) -> None:
            t0 = time.perf_counter()
            module.score_minibatches([self.minibatch])  # under the precision plugin's context, as at an epoch's start
            _sync(module.device)
            self.score_s = round(time.perf_counter() - t0, 3)

        def on_train_batch_start(self, trainer, module, batch, batch_idx) -> None:
            _sync(module.device)
            if module.device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(module.device)
            self._t0 = time.perf_counter()

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
            _sync(module.device)
            dt = time.perf_counter() - self._t0
            timed = batch_idx >= self.warmup
            self.losses.append(float(outputs["loss"]))
            log(f"{self.name}: step {batch_idx} {'timed' if timed else 'warm-up'} {dt:.2f}s loss {self.losses[-1]:.4f} "
                f"peak {_peak_gib(module.device)} GiB")
            if timed:
                self.times.append(dt)
                self.peaks.append(_peak_gib(module.device))
                if time.perf_counter() + dt > self.deadline:
                    log(f"{self.name}: stopping after {len(self.times)} timed step(s) (--max-seconds)")
                    trainer.should_stop = True

    return StepClock


class _Repeat:
    """A map-style dataset yielding the same minibatch dict ``n`` times (the scoring pass fills it in place)."""

    def __init__(self, minibatch: dict, n: int):
        self.minibatch, self.n = minibatch, n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict:
        return self.minibatch


def fit_steps(name: str, module, minibatch: dict, settings: dict, sizes: Sizes, device, deadline: float):
    """``sizes.warmup + sizes.steps`` optimizer steps of ``module`` on ``minibatch`` through a ``lightning.Trainer`` of
    ``trainer=gpu``'s settings (:func:`project_settings`), on ``device``. Returns the :func:`step_clock` callback."""
    import warnings

    import lightning.pytorch as pl
    from torch.utils.data import DataLoader

    clock = step_clock()(name, minibatch, sizes.warmup, deadline)
    n = sizes.warmup + sizes.steps
    t = settings["trainer"]
    trainer = pl.Trainer(accelerator=device.type, devices=1, strategy=keep_on_device()(device=device), precision=t["precision"],
                         use_distributed_sampler=t["use_distributed_sampler"], num_sanity_val_steps=0,
                         gradient_clip_val=t["gradient_clip_val"], log_every_n_steps=t["log_every_n_steps"],
                         enable_model_summary=False, max_epochs=1, limit_train_batches=n, limit_val_batches=0, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, callbacks=[clock],
                         default_root_dir=os.environ.get("TMPDIR", "/tmp"))
    loader = DataLoader(_Repeat(minibatch, n), batch_size=None, collate_fn=lambda b: b)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*does not have many workers.*")
        trainer.fit(module, train_dataloaders=loader)
    if len(clock.losses) < sizes.warmup + 1:
        raise RuntimeError(f"{name}: the Trainer ran {len(clock.losses)} step(s), expected at least {sizes.warmup + 1}")
    return clock


def run_training(name: str, policy, pad: int, objectives, episodes, settings: dict, sizes: Sizes, device, deadline: float,
                 cope: dict | None, shared: bool = False) -> dict:
    """One objective's phase. ``shared``: the shared-prefix path (``data.share_prefix=true``: tree attention,
    ``"cope_tree"``): with ``cope``, its packed rows side by side under tree attention (without: their dense mask on
    SDPA); without ``cope``, the GRPO groups' prefixes forwarded once. The model is back on SDPA afterwards."""
    import torch

    from cope.algos.cope.chunks import build_chunks
    from cope.algos.cope.packing import PACKINGS
    from cope.batch import collate, row_lengths
    from cope.train.module import AgentRLModule
    from cope.train.packing.group_prefix import pack_groups
    from cope.train.packing.tree_batch import use_tree_attention

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
    parts = module.micro_batches(mb)
    res["microbatches"] = len(parts)
    res["cells"] = int(sum(len(r) * n for r, n in parts)) if parts[0][0] is not None else res["rows"] * int(row_lengths(mb).max())
    lora_b = [p for n, p in module.named_parameters() if "lora_B" in n]
    before = [p.detach().clone() for p in lora_b]
    res["precision"] = settings["trainer"]["precision"]
    try:
        clock = fit_steps(name, module, mb, settings, sizes, device, deadline)
    finally:
        if shared:
            policy.model.set_attn_implementation("sdpa")
    res["score_s"] = clock.score_s
    res["step_s_all"] = [round(t, 3) for t in clock.times]
    res["step_s"] = round(sum(clock.times) / len(clock.times), 3)
    res["tokens_per_s"] = round(res["tokens"] / res["step_s"], 1)
    res["peak_mem_gib"] = max(clock.peaks) if device.type == "cuda" else None
    res["loss"] = clock.losses
    res["finite"] = all(x == x and abs(x) != float("inf") for x in clock.losses)
    res["adapter_moved"] = any(not torch.equal(a, b) for a, b in zip(lora_b, before))
    res["adapter_dtype"] = sorted({str(p.dtype).removeprefix("torch.") for p in lora_b})
    del module, clock, mb
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
    model = policy.model  # cope.rollout.hf_actor handles the cache keyword of older transformers
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
    return {"batch": sizes.gen_batch, "prompt_tokens": len(prompts[0]), "max_new_tokens": sizes.gen_new, "new_tokens": new[-1],
            "seconds_all": [round(t, 3) for t in times], "seconds": round(secs, 3), "tokens_per_s": round(sum(new) / sum(times), 1),
            "peak_mem_gib": _peak_gib(device)}


# -- report ------------------------------------------------------------------------------------------
def table(summary: dict) -> str:
    def fmt(x, spec="{:,.2f}"):
        return "-" if x is None else spec.format(x)

    def failed(name: str, r: dict) -> str:
        return f"| {name} | failed: {r['error'].splitlines()[-1][:100]} | | | | | | |"

    lines = ["| phase | step s | tokens/s | tokens | cells | micro-batches | score s | peak GiB |", "|---|---|---|---|---|---|---|---|"]
    for name in ("grpo", "cope", "cope_tree", "grpo_shared"):
        r = summary.get(name) or {}
        if "step_s" in r:
            lines.append(f"| {name} | {fmt(r['step_s'], '{:.3f}')} | {fmt(r['tokens_per_s'], '{:,.0f}')} | {r['tokens']:,} | "
                         f"{r['cells']:,} | {r['microbatches']} | {fmt(r['score_s'], '{:.3f}')} | {fmt(r['peak_mem_gib'])} |")
        elif r.get("error"):
            lines.append(failed(name, r))
    t = summary.get("tree") or {}
    if "step_s" in t:
        lines.append(f"| tree kernel ({t['rows']} x {t['length']:,}, {t['heads']}/{t['kv_heads']} heads, fwd+bwd) | "
                     f"{t['step_s']:.4f} | {t['real_tokens'] / t['step_s']:,.0f} | {t['real_tokens']:,} | {t['cells']['tree']:,} | | | "
                     f"{fmt(t['peak_mem_gib'])} |")
    if t.get("error"):
        lines.append(failed("tree", t))
    g = summary.get("generation") or {}
    if "tokens_per_s" in g:
        lines.append(f"| generation (batch {g['batch']}, {g['max_new_tokens']} new) | {fmt(g['seconds'], '{:.3f}')} | "
                     f"{fmt(g['tokens_per_s'], '{:,.0f}')} | {g['new_tokens']:,} | | | | {fmt(g['peak_mem_gib'])} |")
    elif g.get("error"):
        lines.append(failed("generation", g))
    if summary.get("forecast_overhead") is not None:
        lines.append(f"\nforecast overhead (CoPE step / GRPO step): {summary['forecast_overhead']:.2f}")
    for key, what in (("cope_tree_vs_cope", "CoPE packed rows, tree attention (tiles) / their dense mask"),
                      ("grpo_shared_vs_grpo", "GRPO, group prefixes shared / unshared")):
        if summary.get(key) is not None:
            lines.append(f"{what} (step time): {summary[key]:.2f}")
    if "kernels" in t:
        ex = t["exactness"]
        lines.append(f"tree kernel: calls per layer {t['calls_per_layer']}, kernels {t['kernels']}; bf16 error vs dense fp32 "
                     f"{ex['tiles_bf16_rel_err']} (dense SDPA in bf16: {ex['dense_bf16_rel_err']})")
    return "\n".join(lines)


def write(summary: dict, path: Path | None) -> None:
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(summary, indent=2) + "\n")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    add_plan_args(ap, PHASES)
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny shapes, seconds (the test's run)")
    ap.add_argument("--steps", type=int, help="timed steps per training phase (default 2)")
    ap.add_argument("--microbatch-tokens", type=int, help="module.max_tokens_per_microbatch (default 32768; smoke 512)")
    ap.add_argument("--max-seconds", type=float, default=330.0,
                    help="no phase starts past this, and no more steps are timed past it (after one timed step)")
    ap.add_argument("--json", type=Path, help="write the JSON here (default $OUT/gpu_check.json when OUT is set)")
    args = ap.parse_args(argv)
    if args.steps is not None and args.steps < 1:
        ap.error("--steps must be >= 1")
    names = selected(args, PHASES)
    setup = SETUP if any(n in MODEL_PHASES for n in names) else PhaseSpec("setup", "imports, CUDA init (no model)", "80GB", 0.3,
                                                                          "~15 s of cold imports, ~5 s CUDA init")
    if plan_only(args, "gpu_check", PHASES, setup):
        return 0

    import torch

    if not args.smoke and not torch.cuda.is_available():
        print("gpu_check: no CUDA device (torch.cuda.is_available() is False). This script is for an NVIDIA GPU; "
              "run `python bench/gpu_check.py --smoke` for the CPU smoke run, `--dry-run` for the plan.", file=sys.stderr)
        return 2
    if not args.smoke and (refused := check_card("gpu_check", PHASES, names)) is not None:
        return refused
    sizes, shape = (SMOKE, TINY) if args.smoke else (GPU, QWEN25_7B)
    overrides = {k: v for k, v in (("steps", args.steps), ("microbatch_tokens", args.microbatch_tokens)) if v is not None}
    sizes = Sizes(**{**asdict(sizes), **overrides})
    device = torch.device("cpu" if args.smoke else "cuda", None if args.smoke else 0)
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
    cuda = device.type == "cuda"
    summary: dict = {"smoke": args.smoke, "phases": names, "device": torch.cuda.get_device_name(device) if cuda else "cpu",
                     "device_gib": round(torch.cuda.get_device_properties(device).total_memory / 2**30, 1) if cuda else None,
                     "versions": {"python": sys.version.split()[0], "torch": torch.__version__, "transformers": transformers.__version__,
                                  "peft": peft.__version__, "lightning": lightning.__version__},
                     "cope_path": str(Path(cope.__file__).resolve().parent), "sizes": asdict(sizes), "settings": settings,
                     "estimates_min": {n: PHASES[n].minutes for n in names}}
    chat, pad, words = scaffold(shape["vocab_size"])
    state: dict = {}

    def policy():  # built on the first phase that needs it: `--phase tree` builds none
        if "policy" not in state:
            t0 = time.perf_counter()
            state["policy"] = p = build_policy(shape, device, settings, chat)
            _sync(device)
            n_all = sum(x.numel() for x in p.model.parameters())
            n_train = sum(x.numel() for x in p.trainable_parameters())
            summary["model"] = {"shape": {k: v for k, v in shape.items() if k != "rope_parameters"},
                                "rope_theta": shape["rope_parameters"]["rope_theta"], "params": n_all, "params_base": n_all - n_train,
                                "trainable": n_train, "trainable_expected": expected_lora_params(shape, int(settings["lora"]["r"])),
                                "lora_targets_complete": sorted(settings["lora"]["target_modules"]) == sorted(LORA_TARGETS),
                                "build_s": round(time.perf_counter() - t0, 2), "build_peak_gib": _peak_gib(device)}
            log(f"model: {n_all / 1e9:.3f}B params, {n_train / 1e6:.1f}M trainable, built in {summary['model']['build_s']}s")
            if n_train != summary["model"]["trainable_expected"]:
                raise RuntimeError(f"LoRA trainable parameters {n_train} != expected {summary['model']['trainable_expected']}")
        return state["policy"]

    def episodes():
        if "episodes" not in state:
            state["episodes"] = eps = make_episodes(chat, words, sizes)
            summary["episode_tokens"] = [len(e.tokens) for e in eps]
            summary["episode_steps"] = [e.num_steps for e in eps]
        return state["episodes"]

    from bench.gpu_tree import run_tree
    from cope.algos.cope.loss import ForecastLoss
    from cope.algos.grpo import PolicyGradient

    c = settings["cope"]  # as conf/algo/cope_continuation.yaml builds the objective (no LossBalance callback: an adaptive scale stays 1)

    def train(name: str, cope_node: dict | None, shared: bool = False) -> dict:
        objectives = [PolicyGradient(**settings["pg"])]
        if cope_node is not None:
            objectives.append(ForecastLoss(weight=float(c["weight"]), normalize=c["normalize"], adaptive_ratio=c.get("adaptive_ratio")))
        return run_training(name, policy(), pad, objectives, episodes(), settings, sizes, device, deadline, cope_node, shared)

    phases = {
        "grpo": lambda: train("grpo", None),
        "cope": lambda: train("cope", c),
        # the shared-prefix path (tree attention): the packed rows side by side, then GRPO groups
        "cope_tree": lambda: train("cope_tree", c, shared=True),
        "grpo_shared": lambda: train("grpo_shared", None, shared=True),
        "tree": lambda: run_tree(device, args.smoke),
        "generation": lambda: run_generation(policy(), pad, sizes, device, words, settings["temperature"]),
    }
    failed = False
    for name in names:
        log(f"{name}: start (estimate {PHASES[name].minutes} min)")
        t0 = time.perf_counter()
        try:
            if time.perf_counter() > deadline:
                raise TimeoutError("not started: --max-seconds had passed")
            summary[name] = phases[name]()
        except Exception as e:  # noqa: BLE001 - a failed phase is reported, the others still run
            failed = True
            summary[name] = {**getattr(e, "result", {}), "error": "".join(traceback.format_exception_only(type(e), e)).strip()}
            traceback.print_exc()
        summary[name]["wall_s"] = round(time.perf_counter() - t0, 1)  # the phase's whole time, against its estimate
        gc.collect()  # a failed phase's frames (its batch, optimizer) are gone once its exception is
        if cuda:
            torch.cuda.empty_cache()
        for key, num, den in (("forecast_overhead", "cope", "grpo"), ("cope_tree_vs_cope", "cope_tree", "cope"),
                              ("grpo_shared_vs_grpo", "grpo_shared", "grpo")):
            if name in (num, den) and "step_s" in summary.get(num, {}) and "step_s" in summary.get(den, {}):
                summary[key] = round(summary[num]["step_s"] / summary[den]["step_s"], 3)
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
