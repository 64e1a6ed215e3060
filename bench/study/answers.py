"""What a maze study's policies do, after the fact: their held-out outcomes against a scripted *goal walk*, and
their final evaluation's answers.

Why: study4's SmolLM2 runs end in a band of held-out success (0.45-0.55) where a policy can score by copying the
observation instead of reading the maze. Its prose answers are read by the action projection (the first direction
word), so a policy that repeats the observation's ``Goal:`` line ("Goal: 3 north, 2 west.") moves along the goal's
first axis until it reaches the goal or runs into a wall for the rest of its moves. The *goal walk* is that policy,
scripted: :func:`goal_walk` plays it on the same mazes (the run's env config, this checkout's maze generator).

Two tables:

- **Every run** (the committed records: ``<records>/<arm>/<setting>/seed<N>/csv/val_episodes/episodes<M>.csv``): at
  each held-out validation after training began, whether the run's per-maze outcomes (reached the goal or not) are
  exactly the goal walk's on the same mazes, and at the last one, the share of mazes where they agree.
- **Final evaluations** (``--evals``: run folders with ``eval256/trajectories.jsonl``, which the records do not
  keep), over the turns after the first (the first turn's observation is in the prompt, not in the trajectory):
  ``goal_line``, the share of answers that contain the previous observation's ``Goal:`` text verbatim
  (case-insensitive); ``goal_first``, the share whose move (as the env read it) is that line's first direction;
  ``walls``, the share that hit a wall; ``walk_agree``, over the evaluated mazes, the share whose outcome is the goal
  walk's.

Usage::

    python -m bench.study.answers bench/results/study4/runs/smollm2/test --evals outputs/study4/smollm2/test \\
        --out bench/results/study4/answer_forms.md
"""
from __future__ import annotations

import argparse
import csv
import json
import re
import statistics
import sys
from pathlib import Path

from bench.study.markdown import write_table
from bench.study.report import validation_files
from cope.envs.base import Env, Task
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


def goal_walk(env: Env, split: str, indices: list[int]) -> dict[int, int]:
    """{task index: 1 if the goal was reached}: the scripted policy that always moves the observation's ``Goal:``
    line's first direction, on ``env``'s tasks ``indices`` of ``split``."""
    out = {}
    for i in indices:
        obs, done, success = env.reset(Task(env.name, split, i)).observation, False, False
        while not done:
            step = env.step(project_action(GOAL.search(obs).group(1)) or "north")
            obs, done, success = step.observation, step.done, step.success
        out[i] = int(success)
    return out


def outcomes(episodes_csv: Path) -> tuple[str, dict[int, int]]:
    """(split, {task index: 1 if reached}) of a per-task episodes file (validation or evaluation)."""
    with episodes_csv.open(newline="") as f:
        rows = list(csv.DictReader(f))
    return rows[0]["split"], {int(r["index"]): int(float(r["success"])) for r in rows}


def run_env(run: Path) -> Env:
    """The run's env, built from its Hydra config (``.hydra/config.yaml``'s ``env`` block)."""
    from hydra.utils import instantiate
    from omegaconf import OmegaConf

    return instantiate(OmegaConf.load(run / ".hydra" / "config.yaml").env)()


def _agree(got: dict[int, int], walk: dict[int, int]) -> float:
    return sum(got[i] == walk[i] for i in got) / len(got)


def validation_row(run: Path, env: Env) -> dict | None:
    """A run's validations after training began against the goal walk on the same mazes (None: it has none yet)."""
    later = [outcomes(p) for n, p in validation_files(run) if n > 0]
    if not later:
        return None
    walks = [goal_walk(env, split, sorted(got)) for split, got in later]
    last, walk = later[-1][1], walks[-1]
    return {"validations": len(later), "identical": sum(got == w for (_, got), w in zip(later, walks)),
            "success": sum(last.values()) / len(last), "walk_success": sum(walk.values()) / len(walk),
            "agree": _agree(last, walk)}


def _runs(root: Path, marker: str) -> list[tuple[str, int, Path]]:
    return [(p.relative_to(root).parts[0], int(p.relative_to(root).parts[2].removeprefix("seed")), root.joinpath(
        *p.relative_to(root).parts[:3])) for p in sorted(root.glob(f"*/*/seed*/{marker}"))]


NEAR = 0.05  # a last validation this close to the goal walk's success counts as ending at it (a few mazes of 64)


def _cell(v: list[float]) -> str:
    return f"{statistics.fmean(v):.2f} ({min(v):.2f}-{max(v):.2f})" if len(v) > 1 else f"{v[0]:.2f}"


def tables(val_rows: list[dict], eval_rows: list[dict]) -> str:
    out = ["Every run's held-out validations after training began (the reported panel), against the goal walk on the "
           "same mazes:", "",
           "| arm | seed | validations identical to the goal walk's outcomes | last validation's success | the goal "
           "walk's | mazes where they agree |", "|---|---|---|---:|---:|---:|"]
    out += [f"| {r['arm']} | {r['seed']} | {r['identical']} of {r['validations']} | {r['success']:.3f} "
            f"| {r['walk_success']:.3f} | {r['agree']:.2f} |" for r in val_rows]
    arms: dict[str, list[dict]] = {}
    for r in val_rows:
        arms.setdefault(r["arm"], []).append(r)
    out += ["", "| arm | runs whose last validation is the goal walk's, maze for maze | mazes where they agree |",
            "|---|---|---|"]
    out += [f"| {arm} | {sum(r['agree'] == 1.0 for r in rs)} of {len(rs)} | {_cell([r['agree'] for r in rs])} |"
            for arm, rs in arms.items()]
    near = {arm: sum(abs(r["success"] - r["walk_success"]) <= NEAR + 1e-9 for r in rs) for arm, rs in arms.items()}
    out += ["", f"Runs whose last validation's success is within {NEAR} of the goal walk's: {sum(near.values())} of "
            f"{len(val_rows)} (" + ", ".join(f"{arm} {n} of {len(arms[arm])}" for arm, n in near.items()) + ")."]
    if eval_rows:
        out += ["", "Final evaluations (greedy) that kept their trajectories; shares over the turns after the first:", "",
                "| arm | seed | tasks | greedy success | the goal walk's | repeat the Goal line | move = its first "
                "direction | hit a wall | mazes where the outcome is the goal walk's |",
                "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
        out += [f"| {r['arm']} | {r['seed']} | {r['tasks']} | {r['success']:.3f} | {r['walk_success']:.3f} "
                f"| {r['goal_line']:.2f} | {r['goal_first']:.2f} | {r['walls']:.2f} | {r['walk_agree']:.2f} |"
                for r in eval_rows]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("records", type=Path, help="a study's test records: <records>/<arm>/<setting>/seed<N> (csv/, .hydra/)")
    p.add_argument("--evals", type=Path, help="run folders with eval256/trajectories.jsonl (same layout)")
    p.add_argument("--out", type=Path, required=True, help="the markdown tables (a .json beside it holds every row)")
    args = p.parse_args(argv)
    val_rows, eval_rows = [], []
    for arm, seed, run in _runs(args.records, "csv/val_episodes"):
        env = run_env(run)
        try:
            row = validation_row(run, env)
            if row is None:
                print(f"skipped {run}: no held-out validation after training began", flush=True)
                continue
            val_rows.append({"arm": arm, "seed": seed, **row})
            traj = args.evals.joinpath(*run.relative_to(args.records).parts, "eval256") if args.evals else None
            if traj is None or not (traj / "trajectories.jsonl").is_file():
                continue
            summary = json.loads((traj / "summary.json").read_text()) if (traj / "summary.json").is_file() else {}
            if not summary.get("complete"):
                print(f"skipped {traj}: the evaluation is not complete", flush=True)
            else:
                split, got = outcomes(traj / "episodes.csv")
                walk = goal_walk(env, split, sorted(got))
                forms = answer_forms([json.loads(x) for x in (traj / "trajectories.jsonl").read_text().splitlines() if x])
                eval_rows.append({"arm": arm, "seed": seed, "tasks": len(got), "success": summary["success"],
                                  "walk_success": sum(walk.values()) / len(walk), **forms, "walk_agree": _agree(got, walk)})
        finally:
            env.close()
    if not val_rows:
        p.error(f"no run with held-out validations under {args.records} (<arm>/<setting>/seed<N>/csv/val_episodes)")
    head = (f"# The policies against the goal walk (`python -m bench.study.answers {args.records}"
            f"{f' --evals {args.evals}' if args.evals else ''}`)\n\nThe goal walk: a scripted policy that always moves "
            "the observation's `Goal:` line's first direction, what a policy that repeats that line does when the "
            "action projection reads it.\n\n")
    write_table(args.out, {"validations": val_rows, "evaluations": eval_rows}, head, tables(val_rows, eval_rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
