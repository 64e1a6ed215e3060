"""Branched rollouts against the flat group at equal leaves: env steps, generated tokens and wall time per leaf.

For the same tasks (the epoch's task stream of one seed), each setting collects one epoch through the DataModule's
collector: ``flat`` (the default collector, G independent episodes per task) and ``branching`` with each of
``--roots`` (``+collector=branching``: G leaves grown from that many roots, ``--trigger``). Settings are interleaved
over ``--rounds`` (seeds 0..rounds-1) and the medians are printed, with each branching setting's ratio to flat. The
policy is the tiny model (``debug=fast``: a micro model; ``--overrides`` changes it, e.g. ``model=smollm2-135m
experiment=smollm2_maze``); the env is ``--env`` (an env that forks: the maze, TextWorld).

It also prints what training the epoch forwards per leaf: the leaves' rows unpacked (``trained``), and with
``data.share_prefix=true`` (``forwarded``: each group packed as a prefix trie by
:func:`cope.train.packing.group_prefix.pack_groups`, every shared token once, a child's shared turns included; one
group per packing, no micro-batch cap), and the seconds of the update's forward and backward over those tries
(``update``: each group one micro-batch, the tempered log-probs of its action tokens, T=0.7).

Each round first runs one untimed flat collection of its tasks, so that no setting pays for making them (TextWorld
compiles a game on its first use). What it measures is the cost, not learning: a random or barely trained
policy runs its episodes to the step budget, where a trained one ends earlier, so the savings of a trained policy
may differ.

Usage: ``python -m bench.branch_cost [--env maze] [--group-size 8] [--tasks 8] [--roots 2 4 6] [--rounds 3]
[--out bench/results/branch_cost/maze.md]``
"""
from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _collect(cfg, factory, policy, seed: int, collector: dict | None) -> dict[str, float]:
    from hydra.utils import instantiate
    from omegaconf import OmegaConf

    data = OmegaConf.merge(cfg.data, {"seed": seed, "val_tasks": 1, "progress": False})
    if collector is not None:
        data = OmegaConf.merge(data, {"collector": collector})
    dm = instantiate(data, env=factory)
    dm.connect(policy)
    try:
        t0 = time.perf_counter()
        rec = dm.collect_epoch(0)
        seconds = time.perf_counter() - t0
    finally:
        dm.teardown("fit")
    leaves = dm.tasks_per_epoch * dm.group_size  # the budget: G leaves per task (dedup may train fewer of them)
    m = rec.metrics
    trained, forwarded, update = _training_tokens(rec.episodes, policy.model)
    return {"env_steps": m["counters/env_steps"] / leaves, "tokens": m["counters/generated_tokens"] / leaves,
            "seconds": seconds / leaves, "leaves": leaves, "trained": trained / leaves, "forwarded": forwarded / leaves,
            "update": update / leaves}


def _training_tokens(episodes, model=None) -> tuple[int, int, float]:
    """(tokens of the leaves' rows, tokens their groups' prefix tries forward, seconds of the update's forward and
    backward over those tries), over the epoch's groups; the seconds only with ``model`` (else 0)."""
    from cope.batch import collate
    from cope.train.packing.group_prefix import pack_groups
    from cope.train.packing.tree_batch import packed_logprobs

    trained = forwarded = 0
    seconds = 0.0
    for g in sorted({e.group for e in episodes}):
        group = [e for e in episodes if e.group == g]
        batch = pack_groups(collate(group, 0), group)
        trained += int(batch["attention_mask"].sum())
        forwarded += batch["packed"].tokens
        if model is not None:  # the policy-gradient forward and backward of the group, as one micro-batch
            t0 = time.perf_counter()
            scores = packed_logprobs(model, batch["packed"], None, None, {}, 0.7, False)
            (scores.logprobs * batch["action_mask"]).sum().backward()
            seconds += time.perf_counter() - t0
            model.zero_grad(set_to_none=True)
    return trained, forwarded, seconds


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--env", default="maze")
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--tasks", type=int, default=8)
    ap.add_argument("--roots", type=int, nargs="+", default=[2, 4, 6])
    ap.add_argument("--trigger", default="uniform")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--overrides", nargs="*", default=[])
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--cache-dir", default=os.environ.get("COPE_CACHE", str(Path.home() / ".cache/cope-trainer")))
    args = ap.parse_args(argv)

    from hydra import compose, initialize_config_dir
    from hydra.utils import instantiate

    from cope.run.train import instantiate_plain
    from cope.train.packing.tree_batch import use_tree_attention

    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3", job_name="bench"):
        cfg = compose(config_name="config", overrides=[
            "debug=fast", f"env={args.env}", "paths.output_dir=/tmp/cope-bench", f"paths.cache_dir={args.cache_dir}",
            f"data.group_size={args.group_size}", f"data.tasks_per_epoch={args.tasks}", "+collector=branching",
            f"branch.trigger={args.trigger}", *args.overrides])
    branching = dict(cfg.data.collector)
    cfg.data.collector = None  # flat: the default collector
    factory = instantiate(cfg.env)
    policy = instantiate_plain(cfg.model)(env_factory=factory)
    use_tree_attention(policy.model)  # what data.share_prefix=true switches on: the trees' attention kernels
    settings = {"flat": None, **{f"branching roots={r}": {**branching, "roots": r} for r in args.roots}}
    runs: dict[str, list[dict]] = {name: [] for name in settings}
    for seed in range(args.rounds):  # interleaved: every setting once per round
        _collect(cfg, factory, policy, seed, None)  # untimed: the round's tasks made first (TextWorld compiles its games)
        for name, collector in settings.items():
            runs[name].append(_collect(cfg, factory, policy, seed, collector))
    med = {name: {k: statistics.median(r[k] for r in rs) for k in ("env_steps", "tokens", "seconds", "trained", "forwarded", "update")}
           for name, rs in runs.items()}
    flat = med["flat"]
    lines = [f"# Branched rollouts vs flat at equal leaves: env={args.env}, G={args.group_size}, {args.tasks} tasks, "
             f"trigger={args.trigger}, {args.rounds} rounds (medians per leaf)", "",
             "| setting | env steps / leaf | tokens / leaf | seconds / leaf | env steps vs flat | tokens vs flat | time vs flat "
             "| trained / leaf | forwarded / leaf (share_prefix) | forwarded vs flat's | update seconds / leaf | update vs flat |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for name, m in med.items():
        ratio = [m[k] / flat[k] if flat[k] else float("nan") for k in ("env_steps", "tokens", "seconds")]
        lines.append(f"| {name} | {m['env_steps']:.2f} | {m['tokens']:.1f} | {m['seconds']:.4f} | "
                     f"{ratio[0]:.2f}x | {ratio[1]:.2f}x | {ratio[2]:.2f}x | {m['trained']:.1f} | {m['forwarded']:.1f} | "
                     f"{m['forwarded'] / flat['forwarded']:.2f}x | {m['update']:.4f} | {m['update'] / flat['update']:.2f}x |")
    lines += ["", f"overrides: {' '.join(args.overrides) or '(none)'}; policy: {cfg.model._target_}"]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)


if __name__ == "__main__":
    main()
