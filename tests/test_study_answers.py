"""bench.study.answers: a maze study's policies against the scripted goal walk, and their final answers."""
import csv
import json
import math

from bench.study.answers import answer_forms, goal_walk, main
from cope.envs.maze import DIRECTIONS, MazeEnv

USER = "\n<|im_start|>user\n"
ENV = {"_target_": "cope.envs.maze.MazeEnv", "_partial_": True, "sizes": [6], "wall_density": 0.25, "max_steps": 8,
       "min_distance": 2, "num_train_tasks": 100, "num_test_tasks": 100, "name": "maze", "compass": True,
       "action_parsing": "project"}


def obs(goal: str, wall: bool = False, read: str | None = None) -> str:
    """An observation as the maze's chat template feeds it back (harness line when the projection read the answer)."""
    return f"{USER}{'Wall. ' if wall else ''}Goal: {goal}. Closer: north. Open: north, south.\n" + (
        f"Read as: {read}. Answer with one word.<|im_end|>" if read else "<|im_end|>")


def test_copying_and_reading_policies_are_told_apart():
    copier = {"turns": [
        {"action": "The answer is 3 north, 2 west.", "feedback": obs("2 north, 2 west", read="north")},
        {"action": "The answer is 2 north, 2 west.", "feedback": obs("2 north, 2 west", wall=True, read="north")},
        {"action": "The answer is 2 north, 2 west.", "feedback": obs("2 north, 2 west", wall=True, read="north")},
    ]}
    reader = {"turns": [
        {"action": "west", "feedback": obs("2 north, 1 west")},
        {"action": "west", "feedback": obs("2 north")},           # the line's first direction is north: not greedy
        {"action": "North", "feedback": obs("1 north")},          # greedy, a bare word (parsed, no projection)
        {"action": "north", "feedback": f"{USER}You reached the goal.<|im_end|>"},
    ]}
    f = answer_forms([copier, reader])
    assert f["turns"] == 5
    assert f["goal_line"] == 2 / 5                 # only the copier's two later answers hold the line verbatim
    assert f["goal_first"] == 4 / 5                # copier 2, reader's "North" and last "north"
    assert f["walls"] == 2 / 5
    f = answer_forms([{"turns": [{"action": "north", "feedback": obs("1 north")}]}])
    assert f["turns"] == 0 and math.isnan(f["goal_line"])


def _walk_on_layout(env: MazeEnv, index: int) -> int:
    """The goal walk, played on the layout itself (the oracle): the goal's first axis (north/south first), one move a
    turn, a wall leaves the walker in place."""
    lay = env.generate("test", index)
    (r, c), steps = lay.start, 0
    while (r, c) != lay.goal and steps < env.max_steps:
        dr, dc = lay.goal[0] - r, lay.goal[1] - c
        move = ("south" if dr > 0 else "north") if dr else ("east" if dc > 0 else "west")
        target = (r + DIRECTIONS[move][0], c + DIRECTIONS[move][1])
        r, c = target if lay.is_open(target) else (r, c)
        steps += 1
    return int((r, c) == lay.goal)


def test_goal_walk_matches_the_layouts():
    env = MazeEnv(**{k: v for k, v in ENV.items() if not k.startswith("_")})
    walk = goal_walk(env, "test", list(range(40)))
    assert walk == {i: _walk_on_layout(env, i) for i in range(40)}
    assert 0 < sum(walk.values()) < 40             # walls stop it on some mazes, not all
    open_env = MazeEnv(**{**{k: v for k, v in ENV.items() if not k.startswith("_")}, "wall_density": 0.0})
    assert set(goal_walk(open_env, "test", list(range(10))).values()) == {1}  # no wall: always there


def _episodes(path, outcomes: dict[int, int]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["split", "index", "success"])
        w.writerows(["test", i, s] for i, s in outcomes.items())


def test_cli_compares_every_run_with_the_goal_walk(tmp_path, capsys):
    env = MazeEnv(**{k: v for k, v in ENV.items() if not k.startswith("_")})
    walk = goal_walk(env, "test", list(range(8)))
    records, evals = tmp_path / "runs", tmp_path / "outputs"
    for arm, flip in (("grpo", None), ("echo", 3)):
        run = records / arm / "s" / "seed0"
        (run / ".hydra").mkdir(parents=True)
        (run / ".hydra/config.yaml").write_text(json.dumps({"env": ENV}))
        _episodes(run / "csv/val_episodes/episodes0.csv", {i: 0 for i in walk})      # before training: not compared
        _episodes(run / "csv/val_episodes/episodes48.csv", walk)
        _episodes(run / "csv/val_episodes/episodes96.csv", {i: s ^ (i == flip) for i, s in walk.items()})
        ev = evals / arm / "s" / "seed0" / "eval256"
        _episodes(ev / "episodes.csv", walk)
        ev.joinpath("summary.json").write_text(json.dumps({"complete": arm == "grpo", "success": 0.5}))
        turns = [{"action": "Goal: 2 east.", "feedback": obs("2 east", read="east")}] * 3
        ev.joinpath("trajectories.jsonl").write_text(json.dumps({"turns": turns}) + "\n")
    out = tmp_path / "answer_forms.md"
    assert main([str(records), "--evals", str(evals), "--out", str(out)]) == 0
    rows = json.loads(out.with_suffix(".json").read_text())
    val = {r["arm"]: r for r in rows["validations"]}
    assert (val["grpo"]["identical"], val["grpo"]["validations"], val["grpo"]["agree"]) == (2, 2, 1.0)
    assert (val["echo"]["identical"], val["echo"]["agree"]) == (1, 7 / 8)   # its last validation differs on one maze
    assert [(r["arm"], r["walk_agree"], r["goal_line"]) for r in rows["evaluations"]] == [("grpo", 1.0, 1.0)]
    assert "skipped" in capsys.readouterr().out                             # echo's evaluation is incomplete
    text = out.read_text()
    assert "| grpo | 1 of 1 | 1.00 |" in text and "| echo | 0 of 1 | 0.88 |" in text
    assert "within 0.05 of the goal walk's: 1 of 2 (echo 0 of 1, grpo 1 of 1)." in text   # echo's is 1/8 off
