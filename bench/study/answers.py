"""What a maze study's final policies answer, from their final evaluation's trajectories, after the fact.

Why: study4's SmolLM2 runs end in a band of held-out success (0.45-0.55) where a policy can score by copying the
observation instead of reading the maze. Its prose answers are read by the action projection (``Read as: <move>.``,
the first direction word), so a policy that repeats the observation's ``Goal:`` line walks greedily along the goal's
first axis and stops at the first wall. This script counts that, for every run whose final evaluation kept its
trajectories (``<run>/eval256/trajectories.jsonl``: in the run folder, not in the committed records).

Per run, over the turns after the first (the first turn's observation is in the prompt, not in the trajectory):

- ``goal_line``: the share of answers that contain the previous observation's ``Goal:`` text verbatim
  (``3 north, 2 west``), case-insensitive;
- ``goal_first``: the share whose projected move is the ``Goal:`` line's first direction (the greedy move); with
  ``goal_line`` it tells a copied line from a policy that reads the maze and still moves greedily;
- ``walls``: the share of these turns that hit a wall (the observation after the answer starts with ``Wall.``).

Usage::

    python -m bench.study.answers outputs/study4/smollm2/test --out bench/results/study4/answer_forms.md
"""
from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from pathlib import Path

from bench.study.markdown import write_table
from cope.envs.maze import parse_action, project_action

GOAL = re.compile(r"Goal: ([^.]*)\.")
WALL = re.compile(r"(^|\n)Wall\.")


def answer_forms(trajectories: list[dict]) -> dict[str, float]:
    """``{turns, goal_line, goal_first, walls}`` over the turns after the first of every trajectory that has one
    (the shares are ``nan`` when there is no such turn)."""
    turns = goal_line = goal_first = walls = 0
    for traj in trajectories:
        steps = traj["turns"]
        for prev, turn in zip(steps, steps[1:]):
            goal = GOAL.search(prev["feedback"])
            if goal is None:  # the episode ended on the previous turn's observation: no goal to copy
                continue
            turns += 1
            text = goal.group(1).strip().lower()
            goal_line += bool(text) and text in turn["action"].lower()
            move = parse_action(turn["action"]) or project_action(turn["action"])  # as the env read it
            goal_first += move is not None and move == project_action(text)
            walls += WALL.search(turn["feedback"]) is not None
    share = (lambda n: n / turns) if turns else (lambda n: float("nan"))
    return {"turns": turns, "goal_line": share(goal_line), "goal_first": share(goal_first), "walls": share(walls)}


def read_trajectories(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def table(rows: list[dict]) -> str:
    """One row per run, then per arm the mean over its seeds."""
    out = ["| arm | seed | greedy success | turns after the first | repeat the Goal line | move = the Goal line's "
           "first direction | hit a wall |", "|---|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        out.append(f"| {r['arm']} | {r['seed']} | {r['success']:.3f} | {r['turns']} | {r['goal_line']:.2f} "
                   f"| {r['goal_first']:.2f} | {r['walls']:.2f} |")
    arms: dict[str, list[dict]] = {}
    for r in rows:
        arms.setdefault(r["arm"], []).append(r)
    out += ["", "| arm | seeds | repeat the Goal line, mean (min-max) | move = first direction, mean (min-max) |",
            "|---|---|---|---|"]
    cell = lambda v: f"{statistics.fmean(v):.2f} ({min(v):.2f}-{max(v):.2f})"  # noqa: E731
    for arm, rs in arms.items():
        out.append(f"| {arm} | {', '.join(str(r['seed']) for r in rs)} | {cell([r['goal_line'] for r in rs])} "
                   f"| {cell([r['goal_first'] for r in rs])} |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("root", type=Path, help="a study's test runs: <root>/<arm>/<setting>/seed<N>/eval256/trajectories.jsonl")
    p.add_argument("--out", type=Path, required=True, help="the markdown table (a .json beside it holds every run's row)")
    args = p.parse_args(argv)
    rows = []
    for path in sorted(args.root.glob("*/*/seed*/eval256/trajectories.jsonl")):
        run = path.parents[1]
        summary = json.loads((path.parent / "summary.json").read_text()) if (path.parent / "summary.json").is_file() else {}
        if not summary.get("complete"):
            print(f"skipped {run}: its evaluation is not complete", flush=True)
            continue
        arm = run.relative_to(args.root).parts[0]
        rows.append({"arm": arm, "seed": int(run.name.removeprefix("seed")), "success": summary["success"],
                     **answer_forms(read_trajectories(path))})
    if not rows:
        p.error(f"no complete final evaluation under {args.root} (<arm>/<setting>/seed<N>/eval256/)")
    head = (f"# What the final policies answer (`python -m bench.study.answers {args.root}`)\n\n"
            "Each run's final evaluation (greedy), the turns after the first: the share of answers that repeat the "
            "previous observation's `Goal:` line, the share whose projected move is that line's first direction "
            "(the greedy move), the share that hit a wall.\n\n")
    write_table(args.out, rows, head, table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
