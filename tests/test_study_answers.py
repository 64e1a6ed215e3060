"""bench.study.answers: the answer forms of a study's final policies, from their evaluation's trajectories."""
import json
import math

from bench.study.answers import answer_forms, main

USER = "\n<|im_start|>user\n"


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


def test_no_later_turn_gives_nan_shares():
    f = answer_forms([{"turns": [{"action": "north", "feedback": obs("1 north")}]}])
    assert f["turns"] == 0 and math.isnan(f["goal_line"])


def test_cli_reads_complete_evaluations_only(tmp_path, capsys):
    def run(arm: str, seed: int, complete: bool, action: str):
        d = tmp_path / arm / "lr1" / f"seed{seed}" / "eval256"
        d.mkdir(parents=True)
        (d / "summary.json").write_text(json.dumps({"complete": complete, "success": 0.5}))
        turns = [{"action": action, "feedback": obs("2 east", read="east")}] * 3
        (d / "trajectories.jsonl").write_text(json.dumps({"turns": turns}) + "\n")

    run("grpo", 0, True, "Goal: 2 east.")
    run("echo", 0, False, "east")
    out = tmp_path / "answer_forms.md"
    assert main([str(tmp_path), "--out", str(out)]) == 0
    rows = json.loads(out.with_suffix(".json").read_text())
    assert [(r["arm"], r["seed"], r["goal_line"]) for r in rows] == [("grpo", 0, 1.0)]
    assert "skipped" in capsys.readouterr().out and "| grpo | 0 | 0.500 | 2 | 1.00 | 1.00 | 0.00 |" in out.read_text()
