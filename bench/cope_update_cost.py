"""Seconds of training per epoch: GRPO, CoPE as its authors built it with a separate forecast step (one row per
sample, and shared prefixes), and joint-packed.

What it measures: one epoch's optimizer steps on ONE stored batch of on-policy episodes (collected once, shared by
every variant), excluding rollouts and the scoring pass:

* GRPO: the epoch's policy-gradient minibatches.
* CoPE (separate): the same minibatches, then the authors' prompted forecast samples of the epoch's winning
  episodes in batches of ``--forecast-minibatch`` samples, one optimizer step each (``cope.update=separate``), one
  row per sample (``cope.share_prefix=false``: every sample re-forwards its history).
* CoPE (separate, shared): the same steps on the same samples, each step's samples of one episode as branches of one
  row over its transcript (``cope.share_prefix=true``, the default: tree attention, ``"cope_tree"``).
* CoPE (joint, packed): the minibatches with the samples packed after their transcripts and the forecast loss
  summed into the policy step (``cope.update=joint cope.packing=packed``): no extra step.

Each variant owns its optimizer and its weights (swapped in outside the timer), starting from the same LoRA weights;
variants are interleaved round-robin (A B C A B C ...) and the first ``--warmup`` rounds are discarded, so drift
hits them alike. ``x / GRPO`` is the cost of CoPE's forecast path per epoch at this batch shape: it grows with the
number of winning episodes (only they give samples), printed beside it. Also printed per variant: tokens forwarded
(real tokens of every batch), padded positions (N x T per batch: what the layers compute, padding included), forwarded
tokens per trained target token (policy-gradient action tokens plus forecast
target tokens), and attention score cells (query-key pairs) the kernels compute: N x T x T per batch for SDPA with a
mask (every cell of the padded rows, the packed joint layout's segment mask included), the tree kernels' count
(``TreeLayout.score_cells``) for the shared rows; beside it the cells any exact method needs (causal, unmasked).

Usage: ``python bench/cope_update_cost.py [--model-overrides debug=fast ...] [--episodes 32] [--epochs 5]``.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "bench"))
VARIANTS = ("GRPO", "CoPE (separate)", "CoPE (separate, shared)", "CoPE (joint, packed)")


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model-overrides", nargs="*", default=["model=tiny"], help="hydra overrides for model/env/data")
    p.add_argument("--episodes", type=int, default=32)
    p.add_argument("--min-success", type=int, default=4)
    p.add_argument("--max-batches", type=int, default=20)
    p.add_argument("--minibatch-size", type=int, default=None, help="episodes per policy step; None = data.minibatch_size")
    p.add_argument("--forecast-minibatch", type=int, default=16, help="samples per forecast step (cope.minibatch_size)")
    p.add_argument("--K", type=int, default=3)
    p.add_argument("--epochs", type=int, default=5, help="timed epochs per variant")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=REPO / "bench/results/cope_update_cost.md")
    args = p.parse_args(argv)

    from hydra import compose, initialize_config_dir
    from hydra.utils import instantiate
    from step_overhead import collect

    from cope.algos.cope.layouts import collate_chunks, pack_forecasts
    from cope.algos.cope.loss import ForecastLoss
    from cope.algos.cope.prompted import PlanPrompt, build_prompted
    from cope.algos.cope.shared_prefix import collate_shared
    from cope.run.train import instantiate_plain
    from cope.train.batch import collate
    from cope.train.module import AgentRLModule
    from cope.train.objectives import combine
    from cope.train.tree_batch import use_tree_attention

    torch.manual_seed(args.seed)
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=[*args.model_overrides, "algo=grpo", f"paths.output_dir={tempfile.mkdtemp()}",
                                           f"seed={args.seed}"])
    env_factory = instantiate(cfg.env)
    dm = instantiate(cfg.data, env=env_factory, progress=False)
    policy = instantiate_plain(cfg.model)(env_factory=env_factory)
    dm.connect(policy)
    eps = collect(dm, policy, args.episodes, args.min_success, args.max_batches, args.seed)
    chunks, fm = build_prompted(eps, policy.chat, PlanPrompt(policy.tokenizer), K=args.K, max_context=int(cfg.data.max_context))
    size = args.minibatch_size or int(cfg.data.minibatch_size)
    pg = [collate(eps[s: s + size], dm.pad_id, indices=list(range(s, min(s + size, len(eps))))) for s in range(0, len(eps), size)]
    pg_objs = [instantiate(node) for node in cfg.algo.objectives.values() if node is not None]
    steps = [chunks[s: s + args.forecast_minibatch] for s in range(0, len(chunks), args.forecast_minibatch)]
    separate = [*pg_objs, ForecastLoss(weight=0.01, update="separate")]
    epochs = {
        "GRPO": (pg, pg_objs),
        "CoPE (separate)": (pg + [collate_chunks(eps, c, dm.pad_id) for c in steps], separate),
        "CoPE (separate, shared)": (pg + [collate_shared(eps, c, dm.pad_id) for c in steps], separate),
        "CoPE (joint, packed)": ([pack_forecasts(mb, eps, chunks, dm.pad_id) for mb in pg],
                                 [*pg_objs, ForecastLoss(weight=0.01, update="joint")]),
    }
    use_tree_attention(policy.model)  # registers "cope_tree"; each variant runs under its own implementation below
    policy.model.set_attn_implementation("sdpa")
    params = {n: q for n, q in policy.model.named_parameters() if q.requires_grad}
    init = {n: q.detach().clone() for n, q in params.items()}
    clip = cfg.module.get("gradient_clip_val")
    runs = {}
    for name, (batches, objs) in epochs.items():
        module = AgentRLModule(policy, objs, optimizer=instantiate(cfg.module.optimizer))
        with torch.no_grad():
            for n, q in params.items():
                q.copy_(init[n])
        module.score_minibatches([b for b in batches if b.get("kind") != "forecast"])
        runs[name] = dict(module=module, batches=batches, opt=module.optimizer_factory(list(params.values())),
                          state={n: q.detach().clone() for n, q in params.items()}, times=[], steps=len(batches),
                          attn="cope_tree" if any("tree_layout" in b for b in batches) else "sdpa", **_work(batches))
    policy.model.train()
    for r in range(args.warmup + args.epochs):
        for v in runs.values():
            with torch.no_grad():
                for n, q in params.items():
                    q.copy_(v["state"][n])
            policy.model.set_attn_implementation(v["attn"])
            t0 = time.perf_counter()
            for step, batch in enumerate(v["batches"]):
                total, _ = combine(v["module"].objectives, v["module"](batch), batch, step)
                total.backward()
                if clip:
                    torch.nn.utils.clip_grad_norm_(params.values(), float(clip))
                v["opt"].step()
                v["opt"].zero_grad(set_to_none=True)
            dt = time.perf_counter() - t0
            v["state"] = {n: q.detach().clone() for n, q in params.items()}
            if r >= args.warmup:
                v["times"].append(dt)
        print(f"round {r + 1}/{args.warmup + args.epochs}" + (" (warmup)" if r < args.warmup else ""), flush=True)
    base = statistics.mean(runs["GRPO"]["times"])
    n_succ = sum(e.success for e in eps)
    lines = [f"{len(eps)} episodes ({n_succ} won), {len(pg)} policy minibatch(es) of <= {size}; {len(chunks)} forecast "
             f"samples (K={args.K}, forecast minibatch {args.forecast_minibatch}); {args.epochs} timed epochs per variant "
             f"after {args.warmup} warmup, interleaved; {torch.get_num_threads()} threads; overrides "
             f"{' '.join(args.model_overrides)}", "",
             "| variant | s/epoch (mean) | std | vs GRPO | optimizer steps | tokens forwarded | padded positions "
             "| per target token | score cells computed | cells needed |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    results = {}
    for name, v in runs.items():
        m = statistics.mean(v["times"])
        results[name] = dict(mean_s=m, std_s=statistics.stdev(v["times"]) if len(v["times"]) > 1 else 0.0,
                             ratio=m / base, times_s=v["times"], steps=v["steps"],
                             **{k: v[k] for k in ("tokens", "positions", "targets", "cells", "visible")})
        lines.append(f"| {name} | {m:.3f} | {results[name]['std_s']:.3f} | {m / base:.2f} | {v['steps']} | {v['tokens']} | "
                     f"{v['positions']} | {v['tokens'] / max(v['targets'], 1):.1f} | {v['cells']:.3g} | {v['visible']:.3g} |")
    text = "\n".join(lines) + "\n"
    print("\n" + text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    report = dict(argv=sys.argv[1:] if argv is None else argv, episodes=len(eps), won=n_succ, samples=len(chunks),
                  forecast_metrics=fm, variants=results)
    args.out.with_suffix(".json").write_text(json.dumps(report, indent=1))
    return report


def _work(batches: list[dict]) -> dict[str, int]:
    """Per epoch: real tokens forwarded, positions the model computes (N x T per batch: padding too), trained target
    tokens (action tokens of the policy gradient, forecast targets), attention score cells computed (N*T*T per SDPA
    call with a mask; the tree kernels' own count for a batch with a tree layout) and the cells an exact method needs
    (each real token's visible keys)."""
    out = dict(tokens=0, positions=0, targets=0, cells=0, visible=0)
    for b in batches:
        out["tokens"] += int(b["attention_mask"].ne(0).sum())
        out["positions"] += b["input_ids"].numel()
        out["targets"] += int(b["action_mask"].sum()) + int(b["forecast_mask"].sum() if "forecast_mask" in b else 0)
        if "tree_layout" in b:
            cells = b["tree_layout"].score_cells()
            out["cells"] += cells.tree
            out["visible"] += cells.visible
            continue
        N, T = b["input_ids"].shape
        out["cells"] += N * T * T
        if "attn_context_end" in b:  # segment attention: query i sees j < context_end[i] and segment_start[i] <= j <= i
            i = torch.arange(T)
            real = b["attention_mask"].ne(0)
            seen = b["attn_context_end"] + (i - b["attn_segment_start"] + 1)  # (N, T)
            out["visible"] += int(seen[real].sum())
        else:  # causal rows, right padded
            out["visible"] += sum(n * (n + 1) // 2 for n in b["attention_mask"].ne(0).sum(-1).tolist())
    return out


if __name__ == "__main__":
    main()
