"""Evaluate a policy on an env's split: what ``eval.py`` runs (the base model, an adapter folder, or a checkpoint).

``python eval.py [env=...] [model=...] [adapter=<dir> | ckpt_path=<file>|last] [eval.split=test] [eval.start=0]
[eval.count=null] [eval.n=1] [eval.temperature=0]``: every task ``start .. start+count-1`` of the split (all by
default), ``n`` episodes each, sampled at ``temperature`` (greedy by default), with the run config's rollout engine
(``rollout=hf|vllm``), env workers and waves. Writes into ``eval.out``:

* ``episodes.csv``: one row per episode, the columns of the training run's ``val_episodes`` files plus ``sample``;
* ``trajectories.jsonl``: each episode's actions and observations (decoded, for reading);
* ``summary.json``: success, score, steps and invalid-action rate (means over episodes), pass@1 and pass@k (k = n,
  the unbiased estimator of Chen et al. 2021) over tasks, a 95% interval of the per-task success over tasks
  (percentile bootstrap, 2000 resamples, seed 0), the counts, and whether the evaluation is complete;
* the configured logger (``logger=csv|wandb``, ``~logger`` for none): the summary's numbers as ``eval/*``
  metrics, and with W&B the episodes as a table (``eval/episodes``).

``eval.probes=true`` adds the held-out probes of training (``callbacks.probes``, :mod:`cope.callbacks.probes`) to the
summary (``probe/*``): how well the policy forecasts its own next K actions on the evaluated successes, and its
observation NLL, over the first ``callbacks.probes.max_episodes`` episodes evaluated by this invocation (a resumed
evaluation probes only its new episodes; ``probe/episodes`` says how many were probed).

Resumable and SIGTERM-safe: episodes are appended after every wave, a rerun with the same ``eval.out`` skips the
finished tasks, and a SIGTERM ends the evaluation after the current wave with ``complete: false`` in the summary.
Bad input (a missing folder, an adapter of another base model or LoRA rank, an unknown split, a task range outside
the split) is one clear message before any model is loaded. So is a key nothing reads (``+eval.temprature=1``,
``+foo=1``): the config gets the check ``train.py`` runs (:func:`cope.run.config_check.check_config`), with the keys
this module reads itself, :data:`READS`, added to what training reads. ``conf/eval.yaml`` composes the whole training
tree, so a key only training reads (``trainer.*``, ``callbacks.*``, ``module.optimizer``) is accepted here rather than
refused as unused: one command line serves both entry points, and a training key still gets its type checked, a
misspelling of it is still refused, and training's rules between keys still apply (``trainer=gpu`` on a machine
without a GPU is refused here too, naming ``trainer=cpu``). The same command gives the same ``episodes.csv``
(seeded sampling: each task's seed is derived from ``eval.seed`` and its index, so a resumed wave draws the same).
"""
from __future__ import annotations

import csv
import dataclasses
import json
import logging
import math
import random
import signal
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from cope.run.config_keys import TRAIN_READS, Reads

log = logging.getLogger(__name__)
# What evaluate() reads of the config itself, beyond what training reads (cope.run.config_keys.TRAIN_READS: the component blocks
# env, model, data, module, logger, callbacks.probes and algo.objectives it builds are among those); see the module
# docstring. A key added to the `eval` block of conf/eval.yaml is refused until it is declared here.
READS = Reads(keys=("adapter", "ckpt_path", "eval.split", "eval.start", "eval.count", "eval.n", "eval.temperature",
                    "eval.top_p", "eval.batch_size", "eval.seed", "eval.progress", "eval.probes", "eval.out"))
COLUMNS = ["split", "index", "sample", "success", "score", "reward", "steps", "invalid", "end_reason"]


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased pass@k of one task with ``c`` successes in ``n`` samples: 1 - C(n-c, k) / C(n, k)."""
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def summarize(rows: list[dict], n: int, expected_tasks: int, seed: int = 0) -> dict[str, Any]:
    """The summary of ``episodes.csv`` rows (see the module docstring)."""
    by_task: dict[int, list[dict]] = {}
    for r in rows:
        by_task.setdefault(int(r["index"]), []).append(r)
    per_task = [sum(int(r["success"]) for r in rs) / len(rs) for rs in by_task.values()]
    rng = random.Random(seed)
    boots = sorted(sum(rng.choice(per_task) for _ in per_task) / len(per_task) for _ in range(2000)) if per_task else []
    mean = lambda key: sum(float(r[key]) for r in rows) / len(rows) if rows else 0.0  # noqa: E731
    steps = sum(int(r["steps"]) for r in rows)
    out = {"tasks": len(by_task), "episodes": len(rows), "samples_per_task": n,
           "complete": len(by_task) == expected_tasks and all(len(rs) == n for rs in by_task.values()),
           "success": mean("success"), "score": mean("score"), "steps": mean("steps"),
           "invalid_rate": sum(int(r["invalid"]) for r in rows) / steps if steps else 0.0,
           "success_ci95": [boots[49], boots[1949]] if boots else [0.0, 0.0],
           "pass@1": sum(pass_at_k(len(rs), sum(int(r["success"]) for r in rs), 1) for rs in by_task.values()) / max(len(by_task), 1)}
    if n > 1:
        out[f"pass@{n}"] = sum(pass_at_k(len(rs), sum(int(r["success"]) for r in rs), n)
                               for rs in by_task.values()) / max(len(by_task), 1)
    return out


def _task_range(cfg: DictConfig, num_tasks: int) -> list[int]:
    e = cfg.eval
    start, count = int(e.start), e.get("count")
    count = num_tasks - start if count is None else int(count)
    if start < 0 or count < 1 or start + count > num_tasks:
        raise ValueError(f"eval.start={start} eval.count={e.get('count')}: tasks {start}..{start + count - 1} are not in "
                         f"the {e.split!r} split of env {cfg.env.get('_target_')} ({num_tasks} tasks, 0..{num_tasks - 1})")
    return list(range(start, start + count))


def accepted_reads() -> Reads:
    """What the config check of ``eval.py`` accepts: every key training reads
    (:data:`cope.run.config_keys.TRAIN_READS`) plus this module's own, :data:`READS`."""
    return dataclasses.replace(TRAIN_READS, keys=(*TRAIN_READS.keys, *READS.keys))


def evaluate(cfg: DictConfig) -> dict[str, Any]:
    """Run the evaluation the config describes; returns the summary (also written to ``summary.json``)."""
    from cope.envs.base import SPLITS, Task, env_facts
    from cope.models.source import base_model_of
    from cope.rollout.engine import Sampling
    from cope.run.checkpoint_io import check_resume_matches
    from cope.run.config_check import check_config
    from cope.run.train import instantiate_plain, resolve_ckpt_path

    check_config(cfg, accepted_reads())  # every key typed and read, before any instantiation or model load
    e = cfg.eval
    if e.split not in SPLITS:
        raise ValueError(f"eval.split={e.split!r}: must be one of {SPLITS} (an env's own splits are env settings, e.g. "
                         "env.test_split=valid_unseen for ALFWorld)")
    if int(e.n) < 1 or float(e.temperature) < 0:
        raise ValueError(f"eval.n must be >= 1 and eval.temperature >= 0, got {e.n}, {e.temperature}")
    if cfg.get("adapter") and cfg.get("ckpt_path"):
        raise ValueError("give adapter=<dir> or ckpt_path=<file>, not both")
    probes = _probes(cfg) if e.get("probes") else None  # a bad probe setting fails before any rollout
    env_factory = instantiate_plain(cfg.env)
    facts = env_facts(env_factory)
    tasks = _task_range(cfg, facts.train_tasks if e.split == "train" else facts.test_tasks)
    model_factory = instantiate_plain(cfg.model)
    base = base_model_of(model_factory, env_factory)
    ckpt = None
    if cfg.get("ckpt_path"):
        ckpt = resolve_ckpt_path(cfg.ckpt_path, Path(cfg.paths.output_dir) / "checkpoints")
        check_resume_matches(ckpt, base, getattr(model_factory.keywords.get("lora"), "r", None),
                             finetune=cfg.model.get("finetune", "lora"))
    adapter = cfg.get("adapter")
    if adapter:
        from cope.models.policy import check_adapter

        check_adapter(adapter, base.source if base else "", model_factory.keywords.get("lora"), bool(base and base.keyed))
    out = Path(e.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = _read(out / "episodes.csv")
    done = {int(r["index"]) for r in rows}
    todo = [i for i in tasks if i not in done]

    policy = model_factory(env_factory=env_factory, adapter=adapter) if adapter else model_factory(env_factory=env_factory)
    # (without `adapter=`, model.adapter applies if the model config sets one)
    if ckpt is not None:
        _load_checkpoint_adapter(policy, ckpt)
    dm = instantiate_plain(cfg.data, env=env_factory, progress=False)
    dm.connect(policy)
    probed: list = []  # this invocation's episodes that eval.probes scores
    stop = {"now": False}
    previous = signal.signal(signal.SIGTERM, lambda *_: stop.update(now=True))
    from tqdm.auto import tqdm

    bar = tqdm(total=len(todo) * int(e.n), desc="evaluation", unit="episode", dynamic_ncols=True, disable=not e.progress)
    try:
        size = max(1, int(e.batch_size) // int(e.n))
        for s in range(0, len(todo), size):
            if stop["now"]:
                log.warning("SIGTERM: evaluation stopped after %d of %d tasks (rerun the same command to finish)",
                            len({int(r['index']) for r in rows}), len(tasks))
                break
            wave = todo[s: s + size]
            batch = [Task(facts.name, e.split, i) for i in wave for _ in range(int(e.n))]
            seed = random.Random(f"{e.seed}/{wave[0]}").randrange(2**31)  # the same wave draws the same, also resumed
            sampling = Sampling(temperature=float(e.temperature), top_p=float(e.top_p),
                                max_action_tokens=dm.sampling.max_action_tokens, seed=seed)
            episodes, _ = dm.engine.rollout(batch, list(range(len(batch))), sampling, progress=bar.update)
            if probes is not None:  # only what the probe reads: its first max_episodes finished episodes
                probed += [ep for ep in episodes if not ep.aborted][: probes.max_episodes - len(probed)]
            new = [_row(ep, j % int(e.n)) for j, ep in enumerate(episodes)]
            _append(out / "episodes.csv", new)
            _append_jsonl(out / "trajectories.jsonl", episodes, policy.tokenizer)
            rows += new
            log.info("evaluated %d/%d tasks", len({int(r["index"]) for r in rows}), len(tasks))
    finally:
        bar.close()
        signal.signal(signal.SIGTERM, previous)
        dm.engine.close()
    rows = [r for r in _read(out / "episodes.csv") if int(r["index"]) in set(tasks)]
    summary = {**summarize(rows, int(e.n), len(tasks)), "split": e.split, "adapter": adapter, "ckpt_path": ckpt,
               "base_model": str(policy.source), "temperature": float(e.temperature)}
    if probes is not None:
        summary.update(_probe(cfg, probes, policy, probed, resumed=bool(done)))
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    if cfg.get("logger"):
        _log(instantiate_plain(cfg.logger), summary, rows)
    print(_table(summary), flush=True)
    return summary


def _log(logger, summary: dict, rows: list[dict]) -> None:
    """The summary's numbers as ``eval/*`` metrics; with W&B also the episodes as a table."""
    from lightning.pytorch.loggers import WandbLogger

    numbers = {f"eval/{k}": float(v) for k, v in summary.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
    numbers.update({"eval/success_ci95_low": summary["success_ci95"][0], "eval/success_ci95_high": summary["success_ci95"][1]})
    logger.log_metrics(numbers, step=0)
    if isinstance(logger, WandbLogger):
        logger.log_table(key="eval/episodes", columns=COLUMNS, data=[[r[c] for c in COLUMNS] for r in rows], step=0)
    logger.finalize("success")


def _probes(cfg: DictConfig):
    """``callbacks.probes``, built (the training run's held-out probes) for ``eval.probes``."""
    from cope.run.train import instantiate_named

    if not cfg.get("callbacks") or not cfg.callbacks.get("probes"):
        raise ValueError("eval.probes=true needs callbacks.probes in the config (conf/config.yaml has it)")
    return instantiate_named({"probes": cfg.callbacks.probes}, "callbacks")[0]


def _probe(cfg: DictConfig, probes, policy, episodes: list, resumed: bool) -> dict[str, float]:
    """``eval.probes``: ``probes`` on this invocation's episodes, scored in the module's micro-batches
    (``module.max_tokens_per_microbatch``)."""
    from cope.run.train import instantiate_named, instantiate_plain

    if resumed:
        log.warning("eval.probes: a resumed evaluation probes only the %d episodes it ran now", len(episodes))
    module = instantiate_plain(cfg.module, _partial_=True)(policy=policy, objectives=instantiate_named(cfg.algo.objectives,
                                                                                                        "algo.objectives"))
    module.to(next(policy.model.parameters()).device)  # what Lightning does before fit: the batches follow module.device
    return {**probes.probe(module, episodes, policy.chat, policy.pad_id), "probe/episodes": float(len(episodes))}


def _load_checkpoint_adapter(policy, path: str) -> None:
    """The trained weights of a training checkpoint (the module's ``model.*`` keys: the adapter, or every weight under
    ``model.finetune=full``) into ``policy.model``."""
    import torch

    from cope.train.fsdp import checkpoint as sharded_checkpoint

    if sharded_checkpoint.complete_path(path).is_dir():  # trainer.strategy.distributed_checkpoint=true: read its shards
        trained = {f"model.{k}": p.detach() for k, p in policy.model.named_parameters() if p.requires_grad}
        sd = sharded_checkpoint.load_trained_tensors(path, trained)
    else:
        sd = torch.load(path, map_location="cpu", weights_only=False)["state_dict"]
    weights = {k[len("model."):]: v for k, v in sd.items() if k.startswith("model.")}
    missing = [k for k, p in policy.model.named_parameters() if p.requires_grad and k not in weights]
    if missing:
        raise ValueError(f"checkpoint {path} lacks {len(missing)} trainable tensors of this model, e.g. {missing[:2]} "
                         "(another LoRA config, or another model.finetune?)")
    policy.model.load_state_dict(weights, strict=False)


def _row(ep, sample: int) -> dict:
    return {"split": ep.task.split, "index": ep.task.index, "sample": sample, "success": int(bool(ep.success)),
            "score": float(ep.score), "reward": float(ep.reward), "steps": ep.num_steps,
            "invalid": sum(not s.valid for s in ep.steps), "end_reason": ep.end_reason}


def _read(path: Path) -> list[dict]:
    if not path.exists():
        return []
    with path.open(newline="") as f:
        return list(csv.DictReader(f))


def _append(path: Path, rows: list[dict]) -> None:
    new = not path.exists()
    with path.open("a", newline="") as f:
        w = csv.DictWriter(f, fieldnames=COLUMNS)
        if new:
            w.writeheader()
        w.writerows(rows)
        f.flush()


def _append_jsonl(path: Path, episodes, tokenizer) -> None:
    with path.open("a") as f:
        for ep in episodes:
            turns = [{"action": s.action_text, "valid": s.valid,
                      "feedback": tokenizer.decode(ep.tokens[s.obs_start:s.obs_end]) if s.obs_start >= 0 else ""}
                     for s in ep.steps]
            f.write(json.dumps({"task": ep.task.id, "success": bool(ep.success), "score": ep.score, "turns": turns}) + "\n")


def _table(s: dict) -> str:
    ci = s["success_ci95"]
    keys = [k for k in s if k.startswith("pass@")]
    lines = ["", f"=== cope-trainer evaluation{'' if s['complete'] else ' (INCOMPLETE: rerun to finish)'} ===",
             f"tasks {s['tasks']}, episodes {s['episodes']} ({s['samples_per_task']} per task), split {s['split']}",
             f"success {s['success']:.3f} [95% {ci[0]:.3f}, {ci[1]:.3f}], score {s['score']:.3f}, steps {s['steps']:.2f}, "
             f"invalid rate {s['invalid_rate']:.3f}, " + ", ".join(f"{k} {s[k]:.3f}" for k in keys)]
    return "\n".join(lines)
