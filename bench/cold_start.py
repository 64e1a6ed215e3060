"""Format cold start of a real instruct model on the maze: first-turn answers, strict vs projected.

A pretrained instruct model does not answer "with exactly one word" at first; it explains. This samples
the maze's first turn (the env's own system prompt and first observation, the model's chat template, the
rollout engine's token-in/token-out path) for ``--samples`` train tasks at each ``--temperatures`` (0 is
greedy) with ``--max-tokens`` per answer, and counts per temperature:

* ``strict``: the answer parses under the strict maze grammar (``env.action_parsing=strict``);
* ``projectable``: the projection finds a direction word in it (``env.action_parsing=project``);
* ``projected_open``: ... and that move is open (a valid step, not a wall);
* ``projected_closer``: ... and it is one of the observation's ``Closer:`` moves;
* ``substring``: a direction appears anywhere in the lower-cased text, inside words too ("northern"): a
  looser count than the projection's whole words, for comparison with counts made that way.

Usage: ``OMP_NUM_THREADS=2 python -m bench.cold_start [--samples 64] [--temperatures 1.0 0.7 0]
[--max-tokens 16] [--seed 0] [--out bench/results/cold_start_smollm2.json]``. The model is
``model=smollm2-135m`` (converted once into ``$COPE_CACHE/gguf``).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def first_turn(policy, task, env) -> tuple[list[int], object]:
    """The context of the first action, laid out as the rollout engine lays it out (cope.rollout.loop.run_episodes)."""
    chat, tok = policy.chat, policy.tokenizer

    def enc(text: str) -> list[int]:
        return tok(text, add_special_tokens=False, split_special_tokens=True)["input_ids"]

    first = env.reset(task)
    ctx = [*chat.system_open, *enc(env.instructions), *chat.turn_end, *chat.newline, *chat.user_open,
           *enc(first.observation), *chat.close_turn()]
    return ctx, first


def measure(policy, samples: int, temperature: float, max_tokens: int, seed: int) -> dict:
    from cope.envs.base import Task
    from cope.envs.maze import MazeEnv, parse_action, project_action
    from cope.rollout.hf_actor import CachedSamplingActor

    env = MazeEnv(action_parsing="project")  # the training config's mazes (sizes 6-8, 20 moves)
    tasks = [Task("maze", "train", i) for i in range(samples)]
    turns = [first_turn(policy, t, env) for t in tasks]
    actor = CachedSamplingActor(policy.model.eval(), policy.pad_id, policy.chat.stop_ids, max_tokens, temperature,
                                seed=seed if temperature > 0 else None)
    t0 = time.perf_counter()
    actions = actor([ctx for ctx, _ in turns])
    seconds = time.perf_counter() - t0
    counts = dict(strict=0, projectable=0, projected_open=0, projected_closer=0, substring=0)
    examples = []
    for ids, (_, first) in zip(actions, turns):
        closed = bool(ids) and ids[-1] in policy.chat.stop_ids
        text = policy.tokenizer.decode(ids[:-1] if closed else ids, skip_special_tokens=True)
        closer = re.search(r"Closer: ([a-z, ]+)\.", first.observation).group(1).split(", ")
        move = project_action(text)
        counts["strict"] += parse_action(text) is not None
        counts["projectable"] += move is not None
        counts["projected_open"] += move in first.admissible_actions
        counts["projected_closer"] += move in closer
        counts["substring"] += any(d in text.lower() for d in ("north", "south", "east", "west"))
        if len(examples) < 8:
            examples.append(text)
    return dict(temperature=temperature, samples=samples, max_tokens=max_tokens, seconds=round(seconds, 1),
                **counts, examples=examples)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--samples", type=int, default=64)
    ap.add_argument("--temperatures", type=float, nargs="+", default=[1.0, 0.7, 0.0])
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--cache-dir", default=os.environ.get("COPE_CACHE", str(Path.home() / ".cache/cope-trainer")))
    ap.add_argument("--out", default=str(REPO / "bench" / "results" / "cold_start_smollm2.json"))
    args = ap.parse_args()

    from peft import LoraConfig

    from cope.models.gguf import gguf_policy

    t0 = time.perf_counter()
    lora = LoraConfig(r=16, lora_alpha=32, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    policy = gguf_policy(lora, cache_dir=str(Path(args.cache_dir) / "gguf"))  # zero-initialized LoRA: the base model
    load_s = time.perf_counter() - t0
    rows = [measure(policy, args.samples, t, args.max_tokens, args.seed) for t in args.temperatures]
    print(f"SmolLM2-135M-Instruct, maze first turn, {args.samples} train tasks, {args.max_tokens} tokens "
          f"(policy ready in {load_s:.0f} s)")
    print(f"{'temperature':>11} {'strict':>7} {'projectable':>11} {'proj. open':>10} {'proj. closer':>12} {'substring':>9} "
          f"{'seconds':>7}")
    for r in rows:
        n = r["samples"]
        print(f"{r['temperature']:>11} {r['strict']:>4}/{n} {r['projectable']:>8}/{n} {r['projected_open']:>7}/{n} "
              f"{r['projected_closer']:>9}/{n} {r['substring']:>6}/{n} {r['seconds']:>7}")
    for r in rows:
        print(f"T={r['temperature']} examples: {r['examples'][:4]}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(dict(model="smollm2-135m", load_seconds=round(load_s, 1), rows=rows), indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
