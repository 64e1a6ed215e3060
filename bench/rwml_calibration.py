"""RWML's reward on a real model, before any RWML run: how often does the policy's world-model prediction score 1?

RWML (``algo=rwml``) trains only where a triplet's G predictions disagree in reward (GRPO's advantage is 0 in a group
of equal rewards). Whether a given model, env, reward and threshold give it anything to train on is a fact to
measure, not to assume: a threshold that no prediction meets (or that every one meets) makes the RWML stage a
no-op. This script measures it on the configuration a run would use, through the same pieces the collector uses:

1. the run's config (``--overrides``, e.g. the study's) with the default collector; ``--epochs`` epochs of task
   episodes on the training split (seed ``--seed``: pick one the runs being calibrated do not use), sampled by the
   untrained policy;
2. every transition cut into triplets (:func:`cope.algos.rwml.triplets.extract_triplets`), ``--triplets`` of them
   drawn, the world-model prompt built (:func:`cope.algos.rwml.prompt.prompt_ids`) and ``--predictions`` (G)
   predictions sampled by the rollout engine (``engine.complete``, the training sampling);
3. each prediction scored by the three rewards' underlying quantities: the cosine distance under the run's embedder
   (``rwml.reward.embedder``), the ROUGE-L F1 and exact match.

Printed per threshold: the mean reward, the share of triplets whose G predictions have a reward spread (what GRPO
trains on; also its expectation at the run's own group size ``--train-group``, drawn from the G sampled here) and
the share all-correct (what the too-easy filter drops 90% of), for the distance and the ROUGE-L rewards; beside them
the same for two trivial predictors that know nothing of the action: **copy** (the observation seen right before the
action, as ``rwml/copy_reward`` scores it) and **constant** (the most frequent observation of the sample). A threshold
at which copying scores as often as the policy's predictions rewards a world model that ignores the action. Also the
distance quantiles and a few predictions next to their targets.

Usage: ``python -m bench.rwml_calibration --overrides model=smollm2-135m experiment=smollm2_maze ...
[--epochs 2] [--triplets 32] [--predictions 8] [--seed 100] [--out bench/results/rwml_calibration]``
"""
from __future__ import annotations

import argparse
import collections
import json
import math
import os
import random
import statistics
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TAUS = (0.05, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.6)
ROUGES = (0.5, 0.6, 0.7, 0.8, 0.9, 1.0)


def subset_spread(row: list[float], g: int) -> float:
    """The probability that ``g`` of the row's predictions drawn without replacement disagree in reward (the spread
    of a triplet trained with G = g, from a sample of more): 1 - P(all g are 1) - P(all g are 0)."""
    n, k = len(row), int(sum(row))
    if g > n:
        raise ValueError(f"--train-group {g} is more than the {n} predictions sampled per triplet")
    return 1.0 - (math.comb(k, g) + math.comb(n - k, g)) / math.comb(n, g)


def group_shares(rewards: list[list[float]], train_group: int | None = None) -> dict[str, float]:
    """Mean reward, share of groups with a reward spread, share of groups all 1, over ``rewards`` (groups x G); with
    ``train_group``, also the expected share with a spread at that group size (``spread_at_g``)."""
    n = max(len(rewards), 1)
    flat = [r for row in rewards for r in row]
    out = {"reward": sum(flat) / max(len(flat), 1), "spread": sum(min(row) != max(row) for row in rewards) / n,
           "all_correct": sum(min(row) == 1.0 for row in rewards) / n}
    if train_group is not None:
        out["spread_at_g"] = sum(subset_spread(row, train_group) for row in rewards) / n
    return out


def baselines(episodes, triplets, tokenizer, targets: list[str]) -> dict[str, list[str]]:
    """The trivial predictors' answer per triplet: ``copy`` (the observation the agent saw right before the action,
    :func:`cope.algos.rwml.triplets.previous_observation`: what ``rwml/copy_reward`` scores in a run) and
    ``constant`` (the sample's most frequent target, ``targets`` holding each triplet's)."""
    from cope.algos.rwml.triplets import previous_observation

    copy = [tokenizer.decode(list(previous_observation(episodes[tr.episode], tr.step)), skip_special_tokens=True)
            for tr in triplets]
    constant = collections.Counter(targets).most_common(1)[0][0] if targets else ""
    return {"copy": copy, "constant": [constant] * len(targets)}


def table(name: str, thresholds, predicted: list[list[float]], trivial: dict[str, list[float]], passes,
          train_group: int) -> list[str]:
    """Markdown rows: per threshold, the policy's shares and the trivial predictors' mean reward."""
    lines = [f"| {name} | mean reward | groups with a spread | with a spread at G={train_group} | groups all-correct | "
             "copy's reward | constant's reward |", "|---|---:|---:|---:|---:|---:|---:|"]
    for th in thresholds:
        got = group_shares([[float(passes(v, th)) for v in row] for row in predicted], train_group)
        triv = {k: sum(passes(v, th) for v in vals) / max(len(vals), 1) for k, vals in trivial.items()}
        lines.append(f"| {th} | {got['reward']:.3f} | {got['spread']:.3f} | {got['spread_at_g']:.3f} | "
                     f"{got['all_correct']:.3f} | {triv['copy']:.3f} | {triv['constant']:.3f} |")
    return lines


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--overrides", nargs="*", default=[])
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--triplets", type=int, default=32)
    ap.add_argument("--predictions", type=int, default=8)
    ap.add_argument("--train-group", type=int, default=4, help="the G a run trains with (rwml.predictions)")
    ap.add_argument("--seed", type=int, default=100)
    ap.add_argument("--prompt", default=None, help="the world-model instruction (rwml.prompt; default: the config's)")
    ap.add_argument("--examples", type=int, default=6)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--cache-dir", default=os.environ.get("COPE_CACHE", str(Path.home() / ".cache/cope-trainer")))
    args = ap.parse_args(argv)

    import torch
    from hydra import compose, initialize_config_dir
    from hydra.utils import instantiate
    from omegaconf import OmegaConf

    from cope.algos.rwml.prompt import WorldModelPrompt, prompt_ids
    from cope.algos.rwml.rewards import EmbeddingCosine, exact_match, rouge_l_f1
    from cope.algos.rwml.triplets import extract_triplets
    from cope.rollout.engine import Sampling
    from cope.rollout.loop import Sampled
    from cope.run.train import instantiate_plain

    torch.manual_seed(args.seed)
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3", job_name="bench"):
        cfg = compose(config_name="config", overrides=[
            "algo=rwml", "paths.output_dir=/tmp/cope-bench", f"paths.cache_dir={args.cache_dir}", *args.overrides])
    reward_cfg = OmegaConf.to_container(cfg.rwml.reward, resolve=True)
    embedder = instantiate(reward_cfg["embedder"]) if "embedder" in reward_cfg else None
    cosine = EmbeddingCosine(embedder, tau_d=0.2)  # the distances only: the thresholds are swept below
    factory = instantiate(cfg.env)
    policy = instantiate_plain(cfg.model)(env_factory=factory)
    data = OmegaConf.merge(cfg.data, {"seed": args.seed, "val_tasks": 1, "progress": False, "collector": None})
    dm = instantiate(data, env=factory)
    dm.connect(policy)
    try:
        episodes = []
        for epoch in range(args.epochs):
            episodes += [e for e in dm.collect_epoch(epoch).episodes if not e.aborted]
        tok, chat = policy.tokenizer, policy.chat
        triplets = extract_triplets(episodes, chat)
        targets = [tok.decode(list(tr.observation), skip_special_tokens=True) for tr in triplets]
        trivial_text = baselines(episodes, triplets, tok, targets)
        rng = random.Random(args.seed)
        chosen = sorted(rng.sample(range(len(triplets)), min(args.triplets, len(triplets))))
        wm = WorldModelPrompt(tok, args.prompt if args.prompt is not None else cfg.rwml.prompt)
        prompts = [prompt_ids(episodes[triplets[i].episode], triplets[i], chat, wm) for i in chosen]
        s = dm.sampling
        sampling = Sampling(temperature=s.temperature, top_p=s.top_p, max_action_tokens=cfg.rwml.max_prediction_tokens,
                            seed=args.seed)
        rows = dm.engine.complete(prompts, sampling, n=args.predictions) if prompts else []
    finally:
        dm.teardown("fit")
    preds: list[list[str]] = []
    for row in rows:
        texts = []
        for item in row:
            ids = item.ids if isinstance(item, Sampled) else list(item)
            closed = bool(ids) and ids[-1] in chat.stop_ids
            texts.append(tok.decode(ids[:-1] if closed else ids, skip_special_tokens=True))
        preds.append(texts)
    tgt = [targets[i] for i in chosen]
    dist = [cosine.distances(p, [t] * len(p)).tolist() for p, t in zip(preds, tgt)]
    rouge = [[rouge_l_f1(x, t) for x in p] for p, t in zip(preds, tgt)]
    exact = [[float(exact_match(x, t)) for x in p] for p, t in zip(preds, tgt)]
    triv_dist = {k: cosine.distances([v[i] for i in chosen], tgt).tolist() for k, v in trivial_text.items()}
    triv_rouge = {k: [rouge_l_f1(v[i], t) for i, t in zip(chosen, tgt)] for k, v in trivial_text.items()}
    flat = sorted(d for row in dist for d in row)
    q = {f"q{int(p * 100)}": flat[min(int(p * len(flat)), len(flat) - 1)] for p in (0.05, 0.25, 0.5, 0.75, 0.95)} if flat else {}
    lines = [f"# RWML's reward on the untrained policy: {len(episodes)} episodes, {len(triplets)} triplets, "
             f"{len(chosen)} drawn x G = {args.predictions} predictions (seed {args.seed})", "",
             f"overrides: {' '.join(args.overrides) or '(none)'}; embedder: {reward_cfg.get('embedder', {}).get('_target_')}",
             f"prompt: {wm.text!r}", "",
             "Cosine distance (reward 1 if d < tau_d):", "",
             *table("tau_d", TAUS, dist, triv_dist, lambda v, th: v < th, args.train_group), "",
             "ROUGE-L F1 (reward 1 if F1 >= threshold):", "",
             *table("threshold", ROUGES, rouge, triv_rouge, lambda v, th: v >= th, args.train_group), "",
             f"Exact match: {group_shares(exact)}", "",
             "Distance quantiles of the predictions: " + ", ".join(f"{k} {v:.3f}" for k, v in q.items()),
             "Copy's distance median: " + (f"{statistics.median(triv_dist['copy']):.3f}" if chosen else "-"), "",
             "Examples (prediction | target, distance):", ""]
    for k in range(min(args.examples, len(chosen))):
        lines.append(f"- target: {tgt[k]!r}")
        for x, d in list(zip(preds[k], dist[k]))[:3]:
            lines.append(f"  - {d:.3f}: {x!r}")
    text = "\n".join(lines) + "\n"
    print(text)
    result = {"episodes": len(episodes), "triplets": len(triplets), "chosen": len(chosen), "G": args.predictions,
              "seed": args.seed, "overrides": args.overrides, "prompt": wm.text, "quantiles": q,
              "train_group": args.train_group,
              "distance": {str(t): group_shares([[float(v < t) for v in row] for row in dist], args.train_group)
                           for t in TAUS},
              "rouge": {str(t): group_shares([[float(v >= t) for v in row] for row in rouge], args.train_group)
                        for t in ROUGES},
              "exact": group_shares(exact),
              "copy_distance": {str(t): sum(v < t for v in triv_dist["copy"]) / max(len(chosen), 1) for t in TAUS},
              "samples": [{"target": t, "predictions": p, "distances": d} for t, p, d in zip(tgt, preds, dist)]}
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "calibration.md").write_text(text)
        (args.out / "calibration.json").write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
