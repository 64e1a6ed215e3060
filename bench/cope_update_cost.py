"""Seconds of training per epoch: GRPO, CoPE as its authors built it with a separate forecast step (one row per
sample, and shared prefixes), and joint-packed.

What it measures: one epoch's optimizer steps on ONE stored batch of on-policy episodes (collected once, shared by
every variant), excluding rollouts and the scoring pass:

* GRPO: the epoch's policy-gradient minibatches.
* GRPO (groups shared): the same minibatches with ``data.share_prefix=true``: each minibatch's GRPO groups forward
  every token their episodes share (the system prompt, task, first observation, and more where they agree) once, as
  the trie of their rows (:mod:`cope.train.packing.group_prefix`); the shared fraction of the tokens is printed.
  Groups share only within a minibatch: ``--minibatch-size`` = ``--episodes`` keeps every group whole.
Also per variant: its peak activation memory (bytes autograd saves for backward, :class:`SavedTensorPeak`) and the
training FLOPs the same batch would take at Qwen2.5-7B's shape (:func:`flops_7b`: linear layers over the positions
computed, attention over the score cells computed).

* CoPE (separate): the same minibatches, then the authors' prompted forecast samples of the epoch's winning
  episodes in batches of ``--forecast-minibatch`` samples, one optimizer step each (``cope.update=separate``), one
  row per sample (``data.share_prefix=false``: every sample re-forwards its history).
* CoPE (separate, shared): the same steps on the same samples, each step's samples of one episode as branches of one
  row over its transcript (``data.share_prefix=true``: tree attention, ``"cope_tree"``).
* CoPE (joint, packed): the minibatches with the samples packed after their transcripts and the forecast loss
  summed into the policy step (``cope.update=joint cope.packing=packed``): no extra step. Two attentions: the dense
  (T, T) mask of the rows' prefix trees per forward (``data.share_prefix=false``, the reference) and tree attention (``true``, the
  default: each group's packed rows joined into the group's trie, every token its transcripts share forwarded once,
  the samples as branches, the tries side by side in as few rows as fit: fewer tokens than the dense variant's).

Each variant owns its optimizer and its weights (swapped in outside the timer), starting from the same LoRA weights;
variants are interleaved round-robin (A B C A B C ...) and the first ``--warmup`` rounds are discarded, so drift
hits them alike. ``x / GRPO`` is the cost of CoPE's forecast path per epoch at this batch shape: it grows with the
number of winning episodes (only they give samples), printed beside it. Also printed per variant: tokens forwarded
(real tokens of every batch), padded positions (N x T per batch: what the layers compute, padding included), forwarded
tokens per trained target token (policy-gradient action tokens plus forecast
target tokens), and attention score cells (query-key pairs) the kernels compute: N x T x T per batch for SDPA with a
mask (every cell of the padded rows, the packed joint rows' dense tree masks included), the tree kernels' count
(``PrefixTree.score_cells``) for the shared rows; beside it the cells any exact method needs (causal, unmasked).

``--kept-tiles`` adds each tree variant again with ``PrefixTree.recompute=False``: the tiles kernel keeps every tile's
gathered ancestor keys and values for backward instead of recomputing its tile calls there (the default), so the
two rows side by side give what the recompute saves in activation memory and costs in time.

Usage: ``python bench/cope_update_cost.py [--model-overrides debug=fast ...] [--episodes 32] [--epochs 5]``.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
import weakref
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "bench"))
VARIANTS = ("GRPO", "GRPO (groups shared)", "CoPE (separate)", "CoPE (separate, shared)", "CoPE (joint, dense mask)",
            "CoPE (joint, tree)")


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model-overrides", nargs="*", default=["model=tiny"], help="hydra overrides for model/env/data")
    p.add_argument("--episodes", type=int, default=32)
    p.add_argument("--min-success", type=int, default=4)
    p.add_argument("--max-batches", type=int, default=20)
    p.add_argument("--minibatch-size", type=int, default=None, help="episodes per policy step; None = data.minibatch_size")
    p.add_argument("--forecast-minibatch", type=int, default=16, help="samples per forecast step (cope.minibatch_size)")
    p.add_argument("--K", type=int, default=3)
    p.add_argument("--gate", default="wins", choices=("wins", "all", "mixed"),
                   help="which episodes give samples; 'all' stands in for a trained policy's wins on a cold model")
    p.add_argument("--mask-projected", action=argparse.BooleanOptionalAction, default=True,
                   help="cope.mask_projected: projected answers count as invalid (off for SmolLM2, which is read by projection)")
    p.add_argument("--epochs", type=int, default=5, help="timed epochs per variant")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--variants", nargs="*", default=list(VARIANTS), choices=list(VARIANTS), help="GRPO always runs (the base)")
    p.add_argument("--kept-tiles", action="store_true",
                   help="also run each tree variant with PrefixTree.recompute=False (the tile calls' activations kept)")
    p.add_argument("--out", type=Path, default=REPO / "bench/results/cope_update_cost.md")
    args = p.parse_args(argv)

    from hydra.utils import instantiate
    from step_overhead import collect

    from cope.algos.cope.loss import ForecastLoss
    from cope.algos.cope.packing import collate_chunks, pack_forecasts
    from cope.algos.cope.prompted import PlanPrompt, build_prompted
    from cope.algos.cope.shared_prefix import collate_shared
    from cope.batch import collate
    from cope.train.module import AgentRLModule
    from cope.train.packing.group_prefix import pack_groups
    from cope.train.packing.tree_batch import packs_prefixes, use_tree_attention

    cfg, dm, policy = load_policy(args.model_overrides, args.seed)
    eps = collect(dm, policy, args.episodes, args.min_success, args.max_batches, args.seed)
    chunks, fm = build_prompted(eps, policy.chat, PlanPrompt(policy.tokenizer), K=args.K, max_context=int(cfg.data.max_context),
                                gate=args.gate, mask_projected=args.mask_projected)
    size = args.minibatch_size or int(cfg.data.minibatch_size)
    pg = [collate(eps[s: s + size], dm.pad_id, indices=list(range(s, min(s + size, len(eps))))) for s in range(0, len(eps), size)]
    pg_objs = [instantiate(node) for node in cfg.algo.objectives.values() if node is not None]
    steps = [chunks[s: s + args.forecast_minibatch] for s in range(0, len(chunks), args.forecast_minibatch)]
    separate = [*pg_objs, ForecastLoss(weight=0.01, update="separate")]
    budget = cfg.module.get("max_tokens_per_microbatch")  # as in training: shared rows never exceed a micro-batch
    epochs = {
        "GRPO": (pg, pg_objs),
        "GRPO (groups shared)": ([pack_groups(b, eps, max_row_tokens=budget) for b in pg], pg_objs),
        "CoPE (separate)": (pg + [collate_chunks(eps, c, dm.pad_id) for c in steps], separate),
        "CoPE (separate, shared)": (pg + [collate_shared(eps, c, dm.pad_id, budget) for c in steps], separate),
        "CoPE (joint, dense mask)": ([pack_forecasts(mb, eps, chunks, dm.pad_id) for mb in pg],
                                     [*pg_objs, ForecastLoss(weight=0.01, update="joint")]),
        "CoPE (joint, tree)": ([pack_groups(pack_forecasts(mb, eps, chunks, dm.pad_id), eps, max_row_tokens=budget) for mb in pg],
                               [*pg_objs, ForecastLoss(weight=0.01, update="joint")]),
    }
    epochs = {k: v for k, v in epochs.items() if k == "GRPO" or k in args.variants}
    if args.kept_tiles:  # each tree variant again with its tile calls' activations kept (PrefixTree.recompute=False)
        for name, (batches, objs) in list(epochs.items()):
            if "dense" not in name and any(packs_prefixes(b) for b in batches):
                epochs[name[:-1] + ", tiles kept)"] = ([_tiles_kept(b) for b in batches], objs)
    use_tree_attention(policy.model)  # registers "cope_tree"; each variant runs under its own implementation below
    policy.model.set_attn_implementation("sdpa")
    params = {n: q for n, q in policy.model.named_parameters() if q.requires_grad}
    init = {n: q.detach().clone() for n, q in params.items()}
    clip = cfg.module.get("gradient_clip_val")
    runs = {}
    memory = SavedTensorPeak({q.untyped_storage().data_ptr() for q in policy.model.parameters()})
    for name, (batches, objs) in epochs.items():
        module = AgentRLModule(policy, objs, optimizer=instantiate(cfg.module.optimizer), max_tokens_per_microbatch=budget)
        module.manual_backward = lambda loss: loss.backward()  # no trainer: the plain autograd call
        with torch.no_grad():
            for n, q in params.items():
                q.copy_(init[n])
        # the joint dense variant carries prefix trees too: on SDPA the model gets their dense mask (the reference)
        attn = "cope_tree" if "dense" not in name and any(packs_prefixes(b) for b in batches) else "sdpa"
        policy.model.set_attn_implementation(attn)
        module.score_minibatches([b for b in batches if b.get("kind") != "forecast"])
        runs[name] = dict(module=module, batches=batches, opt=module.optimizer_factory(list(params.values())),
                          state={n: q.detach().clone() for n, q in params.items()}, times=[], steps=len(batches),
                          attn=attn, **_work(batches, budget, attn == "sdpa"))
    interleave(runs, policy, params, memory, clip, args.warmup, args.epochs)
    base = statistics.mean(runs["GRPO"]["times"])
    n_succ = sum(e.success for e in eps)
    lines = [f"{len(eps)} episodes ({n_succ} won), {len(pg)} policy minibatch(es) of <= {size}; {len(chunks)} forecast "
             f"samples (K={args.K}, gate {args.gate}, mask_projected {args.mask_projected}, forecast minibatch "
             f"{args.forecast_minibatch}); micro-batches of <= {budget} tokens; {args.epochs} timed epochs per variant "
             f"after {args.warmup} warmup, interleaved; {torch.get_num_threads()} threads; overrides "
             f"{' '.join(args.model_overrides)}", "",
             "| variant | s/epoch (mean) | std | vs GRPO | optimizer steps | tokens forwarded | tokens vs GRPO | padded positions "
             "| padding per real token | per target token | score cells computed | cells needed | cells vs needed "
             "| activation peak (MiB) | peak vs GRPO | 7B TFLOPs | 7B FLOPs vs GRPO |", "|---|" + "---:|" * 17]
    results = {}
    for name, v in runs.items():
        m = statistics.mean(v["times"])
        g = runs["GRPO"]
        results[name] = dict(mean_s=m, std_s=statistics.stdev(v["times"]) if len(v["times"]) > 1 else 0.0,
                             ratio=m / base, times_s=v["times"], steps=v["steps"], peak_bytes=v["peak_bytes"],
                             **{k: v[k] for k in ("tokens", "positions", "targets", "cells", "visible", "forecast_cells",
                                                  "forecast_visible", "forecast_tokens")})
        lines.append(f"| {name} | {m:.3f} | {results[name]['std_s']:.3f} | {m / base:.2f} | {v['steps']} | {v['tokens']} | "
                     f"{v['tokens'] / g['tokens']:.2f} | {v['positions']} | {(v['positions'] - v['tokens']) / v['tokens']:.2f} | "
                     f"{v['tokens'] / max(v['targets'], 1):.1f} | {v['cells']:.3g} | {v['visible']:.3g} | "
                     f"{v['cells'] / v['visible']:.2f} | {v['peak_bytes'] / 2**20:.0f} | {v['peak_bytes'] / g['peak_bytes']:.2f} | "
                     f"{flops_7b(v['positions'], v['cells']) / 1e12:.1f} | "
                     f"{flops_7b(v['positions'], v['cells']) / flops_7b(g['positions'], g['cells']):.2f} |")
        results[name]["flops_7b"] = flops_7b(v["positions"], v["cells"])
    separate = [f"{name} {v['forecast_cells'] / v['forecast_visible']:.2f}" for name, v in runs.items() if v["forecast_visible"]]
    if separate:
        lines += ["", "Attention work of the separate forecast steps alone (score cells computed / needed): " + ", ".join(separate)]
    floor = forecast_token_floor(eps, chunks)
    fc = {name: v["forecast_tokens"] for name, v in runs.items() if v["forecast_tokens"]}
    if fc:
        g = runs["GRPO"]["tokens"]
        lines += ["", f"Tokens of the separate forecast steps alone vs their floor ({floor}: each sample-giving episode's "
                  f"history once, up to its last anchor, plus every sample's own tokens; {floor / g:.2f}x GRPO's, so "
                  f"a separate update forwards at least {1 + floor / g:.2f}x GRPO's tokens on this batch): "
                  + ", ".join(f"{name} {t / floor:.2f}" for name, t in fc.items())]
    text = "\n".join(lines) + "\n"
    print("\n" + text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    report = dict(argv=sys.argv[1:] if argv is None else argv, episodes=len(eps), won=n_succ, samples=len(chunks),
                  forecast_metrics=fm, forecast_token_floor=floor, variants=results)
    args.out.with_suffix(".json").write_text(json.dumps(report, indent=1))
    return report


#: Qwen2.5-7B: layers, hidden size, matmul parameters a token passes (7 projections per layer and the head; the
#: embedding is a lookup), for :func:`flops_7b`.
QWEN25_7B = dict(layers=28, hidden=3584, matmul_params=28 * (2 * 3584 * 3584 + 2 * 3584 * 512 + 3 * 3584 * 18944) + 3584 * 152064)


def flops_7b(positions: int, cells: int) -> float:
    """Training FLOPs of one epoch of this batch at Qwen2.5-7B's shape: forward = 2 x matmul parameters per position
    computed (padding included) + 4 x hidden x layers per attention score cell computed (Q K^T and the weighted sum
    of V, every head); training = 3 forwards (the backward of a frozen base needs input gradients only, about one
    forward, and the 7B preset's gradient checkpointing recomputes one). The same tokens and cells as measured here
    (SmolLM2's and Qwen2.5's tokenizers are alike in length on this text); LoRA's own FLOPs are left out (<1%)."""
    m = QWEN25_7B
    return 3.0 * (2.0 * m["matmul_params"] * positions + 4.0 * m["hidden"] * m["layers"] * cells)


class SavedTensorPeak:
    """Activation memory of a training step, on any device: the bytes of the tensors autograd saves for backward
    (storages counted once, parameters left out), peak while they are alive. Use as ``with peak: step()``; read and
    reset with :meth:`take_peak`. On CPU this is what grows with the tokens forwarded and the attention's score
    tensors (SDPA's masked math path saves its (T, T) weights); allocator caches and the optimizer state are not in it."""

    def __init__(self, parameter_storages: set[int]):
        self._skip, self._live, self._now, self._peak = parameter_storages, {}, 0, 0
        self._hooks = None

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        key = t.untyped_storage().data_ptr()
        if key and key not in self._skip:
            count, size = self._live.get(key, (0, t.untyped_storage().nbytes()))
            if count == 0:
                self._now += size
                self._peak = max(self._peak, self._now)
            self._live[key] = (count + 1, size)
            weakref.finalize(t, self._release, key)
        return t

    def _release(self, key: int) -> None:
        count, size = self._live[key]
        if count == 1:
            del self._live[key]
            self._now -= size
        else:
            self._live[key] = (count - 1, size)

    def __enter__(self):
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc):
        self._hooks.__exit__(*exc)

    def take_peak(self) -> int:
        peak, self._peak = self._peak, self._now
        return peak


def load_policy(model_overrides: list[str], seed: int):
    """(cfg, DataModule connected to its policy, policy) of ``algo=grpo`` with ``model_overrides``."""
    from hydra import compose, initialize_config_dir
    from hydra.utils import instantiate

    from cope.run.train import instantiate_plain

    torch.manual_seed(seed)
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=[*model_overrides, "algo=grpo", f"paths.output_dir={tempfile.mkdtemp()}",
                                           f"seed={seed}"])
    env_factory = instantiate(cfg.env)
    dm = instantiate(cfg.data, env=env_factory, progress=False)
    policy = instantiate_plain(cfg.model)(env_factory=env_factory)
    dm.connect(policy)
    return cfg, dm, policy


def interleave(runs: dict, policy, params: dict, memory: SavedTensorPeak, clip, warmup: int, epochs: int) -> None:
    """Times ``warmup + epochs`` rounds of every run's epoch (``runs[name]``: ``module``, ``batches``, ``attn``,
    ``opt``, ``state``, ``times``), round-robin, each from its own weights (swapped into ``params`` outside the
    timer); appends the timed rounds' seconds to ``times`` and keeps the peak of ``memory`` in ``peak_bytes``."""
    from cope.train.step.backward import backward_microbatched


    policy.model.train()
    for r in range(warmup + epochs):
        for v in runs.values():
            with torch.no_grad():
                for n, q in params.items():
                    q.copy_(v["state"][n])
            policy.model.set_attn_implementation(v["attn"])
            t0 = time.perf_counter()
            for batch in v["batches"]:
                with memory:  # micro-batched as training_step does (the model's token budget)
                    backward_microbatched(v["module"], batch)
                if clip:
                    torch.nn.utils.clip_grad_norm_(params.values(), float(clip))
                v["opt"].step()
                v["opt"].zero_grad(set_to_none=True)
            dt = time.perf_counter() - t0
            v["state"] = {n: q.detach().clone() for n, q in params.items()}
            v["peak_bytes"] = max(v.get("peak_bytes", 0), memory.take_peak())
            if r >= warmup:
                v["times"].append(dt)
        print(f"round {r + 1}/{warmup + epochs}" + (" (warmup)" if r < warmup else ""), flush=True)


def _work(batches: list[dict], budget: int | None, dense: bool = False) -> dict[str, int]:
    """Per epoch, over the micro-batches the module cuts under ``budget`` tokens: real tokens forwarded, positions the
    model computes (rows x columns of each micro-batch: padding too), trained target tokens (action tokens of the
    policy gradient, forecast targets), attention score cells computed (rows x columns squared per SDPA call with a
    mask, prefix trees on SDPA (``dense``) included; the tree kernels' own count for packed rows under tree attention)
    and the cells an exact method needs (each real
    token's visible keys); the last two also for the separate forecast steps alone (``forecast_*``)."""
    out = dict(tokens=0, positions=0, targets=0, cells=0, visible=0, forecast_cells=0, forecast_visible=0, forecast_tokens=0)
    for b in batches:
        cells0, visible0, tokens0 = out["cells"], out["visible"], out["tokens"]
        _batch_work(b, budget, out, dense)
        if b.get("kind") == "forecast":
            out["forecast_cells"] += out["cells"] - cells0
            out["forecast_visible"] += out["visible"] - visible0
            out["forecast_tokens"] += out["tokens"] - tokens0
    return out


def _tiles_kept(batch: dict) -> dict:
    """``batch`` with its prefix tree's ``recompute`` off (the tiles kernel keeps its gathered keys for backward)."""
    from dataclasses import replace

    out = dict(batch)
    if out.get("packed") is not None:
        out["packed"] = replace(out["packed"], tree=out["packed"].tree.replace(recompute=False))
    return out


def forecast_token_floor(episodes: list, chunks: list) -> int:
    """The fewest tokens a separate forecast update can forward for ``chunks``: each episode that gives samples
    forwards its history once, up to its last sample's anchor (the policy step changed the weights, so the policy
    forward's activations cannot be reused), and every sample its own tokens (the plan-ahead prompt and the targets)."""
    last: dict[int, int] = {}
    for c in chunks:
        last[c.episode] = max(last.get(c.episode, 0), c.anchor)
    return sum(last.values()) + sum(len(c.tokens) for c in chunks)  # a sample's row: tokens[:anchor] + its tokens


def _batch_work(b: dict, budget: int | None, out: dict, dense: bool = False) -> None:
    """Adds one batch's counts to ``out`` (see :func:`_work`)."""
    from cope.batch import microbatch_plan
    from cope.train.packing.prefix_tree import PrefixTree
    from cope.train.packing.tree_batch import packed_view

    out["targets"] += int(b["action_mask"].sum()) + sum(int(b[k].sum()) for k in ("forecast_mask", "wm_mask") if k in b)
    pack = packed_view(b)  # what the model forwards: the packed rows (a plain batch's own), in micro-batches of whole rows
    out["tokens"] += pack.tokens
    lengths = list(pack.lengths)
    for r0, r1, n in microbatch_plan(lengths, budget) if budget else [(0, len(lengths), max(lengths))]:
        out["positions"] += (r1 - r0) * n
        if pack.tree is not None:
            cells = PrefixTree(rows=pack.tree.rows[r0:r1], length=n).score_cells()
            out["cells"] += cells.dense if dense else cells.tree
            out["visible"] += cells.visible
            continue
        out["cells"] += (r1 - r0) * n * n
        out["visible"] += sum(k * (k + 1) // 2 for k in lengths[r0:r1])  # causal rows, right padded


if __name__ == "__main__":
    main()
