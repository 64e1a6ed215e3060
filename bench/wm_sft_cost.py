"""Seconds of training per epoch: GRPO against GRPO + WM-SFT (``algo=wm_sft``) in its two sample layouts.

What it measures: one epoch's optimizer steps on ONE stored batch of on-policy episodes (collected once, shared by
every variant), excluding rollouts and the scoring pass, as ``bench/cope_update_cost.py`` does for CoPE:

* GRPO: the epoch's policy-gradient minibatches.
* WM-SFT (plain): every transition of every episode a world-model sample, one extra row per sample
  (``wm_sft.layout=plain``): each row re-forwards its episode's history up to the sample, so the tokens grow with
  the square of an episode's turns. The reference layout (study5's WM-SFT runs used it).
* WM-SFT (packed, dense mask): the same samples as segments after their transcript in the same row
  (``wm_sft.layout=packed``, the default): the history once per episode. The rows' prefix trees as a dense (T, T)
  mask on SDPA (``data.share_prefix=false``).
* WM-SFT (packed, tree): the same rows joined into their group's trie and forwarded with tree attention
  (``data.share_prefix=true``): the tokens a group's transcripts share once, score cells only where a query sees.

The loss and gradient of the three WM-SFT variants are the same (``tests/test_wm_sft.py``). Printed per variant: time
per epoch (mean of the timed epochs, variants interleaved round-robin after ``--warmup`` discarded rounds, each from
the same LoRA weights with its own optimizer), tokens forwarded, padded positions, attention score cells computed,
the bytes autograd saves for backward (peak), and the training FLOPs of the same tokens and cells at Qwen2.5-7B's
shape (:func:`cope_update_cost.flops_7b`). ``x / GRPO`` is WM-SFT's extra cost per epoch at this batch shape; it grows
with the episodes' turns (printed: the mean turns per episode).

Usage: ``python bench/wm_sft_cost.py [--model-overrides model=tiny ...] [--episodes 32] [--epochs 3]``.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "bench"))
VARIANTS = ("GRPO", "WM-SFT (plain)", "WM-SFT (packed, dense mask)", "WM-SFT (packed, tree)")


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model-overrides", nargs="*", default=["model=tiny"], help="hydra overrides for model/env/data")
    p.add_argument("--episodes", type=int, default=32)
    p.add_argument("--max-batches", type=int, default=1, help="rollout batches to collect (no success needed)")
    p.add_argument("--minibatch-size", type=int, default=None, help="episodes per policy step; None = data.minibatch_size")
    p.add_argument("--epochs", type=int, default=3, help="timed epochs per variant")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=REPO / "bench/results/wm_sft_cost.md")
    args = p.parse_args(argv)

    from cope_update_cost import SavedTensorPeak, _work, flops_7b, interleave, load_policy
    from hydra.utils import instantiate
    from step_overhead import collect

    from cope.algos.rwml.prompt import WorldModelPrompt
    from cope.algos.rwml.wm_loss import WorldModelNLL
    from cope.algos.rwml.wm_sft import append_samples, build_samples
    from cope.batch import collate
    from cope.train.module import AgentRLModule
    from cope.train.packing.group_prefix import pack_groups
    from cope.train.packing.tree_batch import use_tree_attention

    cfg, dm, policy = load_policy(args.model_overrides, args.seed)
    eps = collect(dm, policy, args.episodes, 0, args.max_batches, args.seed)
    samples, wm_metrics = build_samples(eps, policy.chat, WorldModelPrompt(policy.tokenizer),
                                        max_context=int(cfg.data.max_context))
    size = args.minibatch_size or int(cfg.data.minibatch_size)
    budget = cfg.module.get("max_tokens_per_microbatch")
    pg = [collate(eps[s: s + size], dm.pad_id, indices=list(range(s, min(s + size, len(eps))))) for s in range(0, len(eps), size)]
    pg_objs = [instantiate(node) for node in cfg.algo.objectives.values() if node is not None]
    wm_objs = [*pg_objs, WorldModelNLL(weight=0.01)]
    epochs = {
        "GRPO": (pg, pg_objs, "sdpa"),
        "WM-SFT (plain)": ([append_samples(mb, eps, samples, dm.pad_id, "plain") for mb in pg], wm_objs, "sdpa"),
        "WM-SFT (packed, dense mask)": ([append_samples(mb, eps, samples, dm.pad_id, "packed") for mb in pg], wm_objs,
                                        "sdpa"),
        "WM-SFT (packed, tree)": ([pack_groups(append_samples(mb, eps, samples, dm.pad_id, "packed"), eps,
                                               max_row_tokens=budget) for mb in pg], wm_objs, "cope_tree"),
    }
    use_tree_attention(policy.model)  # registers "cope_tree"; each variant runs under its own implementation below
    params = {n: q for n, q in policy.model.named_parameters() if q.requires_grad}
    init = {n: q.detach().clone() for n, q in params.items()}
    clip = cfg.module.get("gradient_clip_val")
    memory = SavedTensorPeak({q.untyped_storage().data_ptr() for q in policy.model.parameters()})
    runs = {}
    for name, (batches, objs, attn) in epochs.items():
        module = AgentRLModule(policy, objs, optimizer=instantiate(cfg.module.optimizer), max_tokens_per_microbatch=budget)
        module.manual_backward = lambda loss: loss.backward()  # no trainer: the plain autograd call
        with torch.no_grad():
            for n, q in params.items():
                q.copy_(init[n])
        policy.model.set_attn_implementation(attn)
        module.score_minibatches(batches)
        runs[name] = dict(module=module, batches=batches, attn=attn, opt=module.optimizer_factory(list(params.values())),
                          state={n: q.detach().clone() for n, q in params.items()}, times=[],
                          **_work(batches, budget, attn == "sdpa"))
    interleave(runs, policy, params, memory, clip, args.warmup, args.epochs)
    g = runs["GRPO"]
    base = statistics.mean(g["times"])
    turns = sum(e.num_steps for e in eps) / len(eps)
    lines = [f"{len(eps)} episodes ({sum(e.success for e in eps)} won, {turns:.1f} turns each on average, "
             f"{max(len(e.tokens) for e in eps)} tokens the longest), {len(pg)} policy minibatch(es) of <= {size}; "
             f"{len(samples)} world-model samples ({int(wm_metrics['wm/target_tokens'])} target tokens); micro-batches "
             f"of <= {budget} tokens; {args.epochs} timed epochs per variant after {args.warmup} warmup, interleaved; "
             f"{torch.get_num_threads()} threads; overrides {' '.join(args.model_overrides)}", "",
             "| variant | s/epoch (mean) | std | vs GRPO | tokens forwarded | tokens vs GRPO | padded positions "
             "| score cells computed | activation peak (MiB) | peak vs GRPO | 7B TFLOPs | 7B FLOPs vs GRPO |",
             "|---|" + "---:|" * 11]
    results = {}
    for name, v in runs.items():
        m = statistics.mean(v["times"])
        f7 = flops_7b(v["positions"], v["cells"])
        results[name] = dict(mean_s=m, std_s=statistics.stdev(v["times"]) if len(v["times"]) > 1 else 0.0,
                             ratio=m / base, times_s=v["times"], peak_bytes=v["peak_bytes"], flops_7b=f7,
                             **{k: v[k] for k in ("tokens", "positions", "targets", "cells", "visible")})
        lines.append(f"| {name} | {m:.3f} | {results[name]['std_s']:.3f} | {m / base:.2f} | {v['tokens']} | "
                     f"{v['tokens'] / g['tokens']:.2f} | {v['positions']} | {v['cells']:.3g} | "
                     f"{v['peak_bytes'] / 2**20:.0f} | {v['peak_bytes'] / g['peak_bytes']:.2f} | {f7 / 1e12:.1f} | "
                     f"{f7 / flops_7b(g['positions'], g['cells']):.2f} |")
    plain, packed, base_flops = results["WM-SFT (plain)"], results["WM-SFT (packed, tree)"], results["GRPO"]["flops_7b"]
    extra = {k: (packed[k] - results["GRPO"][k], plain[k] - results["GRPO"][k]) for k in ("mean_s", "tokens", "flops_7b")}
    lines += ["", f"WM-SFT's extra cost over GRPO, packed with tree attention vs plain rows: time "
              f"{packed['ratio'] - 1:+.2f} vs {plain['ratio'] - 1:+.2f} of GRPO's epoch; tokens "
              f"{packed['tokens'] / g['tokens'] - 1:+.2f} vs {plain['tokens'] / g['tokens'] - 1:+.2f}; 7B FLOPs "
              f"{packed['flops_7b'] / base_flops - 1:+.2f} vs {plain['flops_7b'] / base_flops - 1:+.2f}. "
              f"Packing cuts the extra time {extra['mean_s'][1] / max(extra['mean_s'][0], 1e-9):.1f}x, the extra tokens "
              f"{extra['tokens'][1] / max(extra['tokens'][0], 1):.1f}x, the extra 7B FLOPs "
              f"{extra['flops_7b'][1] / max(extra['flops_7b'][0], 1e-9):.1f}x; what it leaves is the samples' own tokens, "
              f"{extra['tokens'][0] / max(len(samples), 1):.0f} a sample (the repeated anchor token included)"]
    text = "\n".join(lines) + "\n"
    print("\n" + text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    report = dict(argv=sys.argv[1:] if argv is None else argv, episodes=len(eps), turns=turns, samples=len(samples),
                  variants=results)
    args.out.with_suffix(".json").write_text(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    main()
