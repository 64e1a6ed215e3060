"""The study's per-maze-size breakdown (bench.study.report), on hand-made per-task validation files."""
from __future__ import annotations

from pathlib import Path

import pytest

from bench.study.markdown import delta_cell as _delta_cell
from bench.study.report import _by_size, maze_sizes, size_curves

SIZES = [6, 7, 8]


def _write(run: Path, n: int, outcomes: dict[int, int]) -> None:
    d = run / "csv/val_episodes"
    d.mkdir(parents=True, exist_ok=True)
    rows = ["split,index,success,score,reward,steps,invalid,end_reason"]
    rows += [f"test,{i},{s},{s},{s},3,0,done" for i, s in sorted(outcomes.items())]
    (d / f"episodes{n}.csv").write_text("\n".join(rows) + "\n")


def test_maze_sizes_are_the_envs():
    from cope.envs.base import Task
    from cope.envs.maze import MazeEnv

    got = maze_sizes(list(range(12)), SIZES)
    env = MazeEnv(sizes=SIZES)
    assert got == {i: env.reset(Task("maze", "test", i)).info["size"] for i in range(12)}
    assert set(got.values()) <= set(SIZES)


def test_size_curves_and_paired_deltas(tmp_path):
    size = maze_sizes(list(range(40)), SIZES)
    six = [i for i in range(40) if size[i] == 6][:2]
    eight = [i for i in range(40) if size[i] == 8][:2]
    panel = six + eight
    runs = {}
    for arm, seed, final in (("grpo", 0, {six[0]: 1}), ("grpo", 1, {}), ("echo", 0, {six[0]: 1, six[1]: 1}),
                             ("echo", 1, {six[0]: 1, eight[0]: 1})):
        run = tmp_path / arm / str(seed)
        _write(run, 0, dict.fromkeys(panel, 0))
        _write(run, 64, {i: final.get(i, 0) for i in panel})
        runs.setdefault(arm, {})[seed] = size_curves(run, SIZES)
    c = runs["echo"][1]
    assert set(c) == {6, 8}  # no 7x7 task in this panel
    assert c[6]["episodes"] == [0, 64] and c[6]["success"] == [0.0, 0.5] and c[8]["success"] == [0.0, 0.5]
    assert c[6]["auc"] == pytest.approx(0.25) and c[6]["tasks"] == 2
    table = _by_size({arm: {"size_runs": r} for arm, r in runs.items()}, SIZES)
    six_echo = table[6]["echo"]
    assert six_echo["n"] == 2 and six_echo["final"][0] == pytest.approx(0.75)  # (1.0 + 0.5) / 2
    mean, lo, hi, pairs = six_echo["delta_final"]
    assert pairs == 2 and mean == pytest.approx(((1.0 - 0.5) + (0.5 - 0.0)) / 2) and lo == pytest.approx(0.5)
    t_mean, t_lo, t_hi, t_pairs = six_echo["delta_final_t"]  # differences 0.5, 0.5: sd 0, a zero-width t interval
    assert t_pairs == 2 and t_mean == t_lo == t_hi == pytest.approx(0.5)
    assert _delta_cell(six_echo, "delta_final") == "+0.500 [+0.500, +0.500] better (t: better)"
    assert _delta_cell({}, "delta_auc") == "–"
    assert table[8]["grpo"]["final"][0] == 0.0 and table[8]["echo"]["delta_final"][0] == pytest.approx(0.25)
    assert 7 not in table


def test_a_run_without_files_has_no_sizes(tmp_path):
    assert size_curves(tmp_path, SIZES) == {}


def test_gradient_diagnostics_read_only_the_measured_steps(tmp_path):
    """every_n_steps=4: the rows of steps 1-3 (an older run's repeats of step 0's value) are not measurements."""
    from bench.study.report import run_curve

    (tmp_path / ".hydra").mkdir()
    (tmp_path / ".hydra/config.yaml").write_text("callbacks:\n  grad_stats:\n    every_n_steps: 4\n")
    (tmp_path / "csv").mkdir()
    rows = ["step,grad/pg_norm,grad/echo_norm,grad/cos_echo_pg,grad/ratio_echo_pg"]
    rows += [f"{s},1.0,0.5,{0.2 if s < 4 else -0.4},0.5" for s in range(8)]  # measured at 0 and 4, held between
    (tmp_path / "csv/metrics.csv").write_text("\n".join(rows) + "\n")
    c = run_curve(tmp_path, aux="echo")
    assert c["grad/measured_steps"] == 2 and [s for s, _ in c["grad/cos_echo_pg"]] == [0, 4]
    assert c["grad/cos_echo_pg/mean"] == pytest.approx(-0.1)
    (tmp_path / ".hydra/config.yaml").unlink()  # no config: every row counts
    assert run_curve(tmp_path, aux="echo")["grad/measured_steps"] == 8


def test_separate_forecast_steps_are_read_on_their_own_rows(tmp_path):
    """CoPE's separate update: the policy step (a multiple of every_n_steps) logs grad/pg_norm; the forecast step
    after it logs its norm, cosine and ratio against the kept PG gradient on its own (odd) step, with no pg norm.
    A forecast row whose ratio is 0 (a zero PG gradient kept) is no measurement of the angle."""
    from bench.study.report import run_curve

    (tmp_path / ".hydra").mkdir()
    (tmp_path / ".hydra/config.yaml").write_text("callbacks:\n  grad_stats:\n    every_n_steps: 4\n")
    (tmp_path / "csv").mkdir()
    rows = ["step,grad/pg_norm,grad/total_norm,grad/forecast_norm,grad/cos_forecast_pg,grad/ratio_forecast_pg",
            "0,1.0,1.0,,,", "5,,,0.5,0.3,0.5", "8,2.0,2.0,,,", "13,,,0.5,-0.1,0.25", "16,0.0,0.0,,,", "21,,,0.5,0.0,0.0"]
    (tmp_path / "csv/metrics.csv").write_text("\n".join(rows) + "\n")
    c = run_curve(tmp_path, aux="forecast")
    assert c["grad/measured_steps"] == 2 and [s for s, _ in c["grad/cos_forecast_pg"]] == [5, 13]
    assert c["grad/cos_forecast_pg/mean"] == pytest.approx(0.1) and c["grad/ratio_forecast_pg/mean"] == pytest.approx(0.375)


def test_invalid_rate_is_read_from_the_last_validation(tmp_path):
    from bench.study.report import invalid_rate

    assert invalid_rate(tmp_path) is None
    d = tmp_path / "csv/val_episodes"
    d.mkdir(parents=True)
    head = "split,index,success,score,reward,steps,invalid,end_reason\n"
    (d / "episodes0.csv").write_text(head + "test,0,0,0,0,20,0,max_steps\n")
    (d / "episodes1024.csv").write_text(head + "test,0,0,0,0,20,20,max_steps\ntest,1,1,1,1,5,0,done\n")
    (d / "episodes256.csv").write_text(head + "test,0,0,0,0,20,1,max_steps\n")
    assert invalid_rate(tmp_path) == pytest.approx(20 / 25)  # the newest file by episodes, not by name


def test_between_pairs_the_non_grpo_arms_by_seed():
    """CoPE turns vs CoPE list: the later arm minus the earlier one, on the seeds both have, both intervals."""
    from bench.study.report import _between

    def runs(finals: dict[int, float]) -> dict:
        return {"runs": {s: {"auc": f / 2, "final": f} for s, f in finals.items()}}

    arms = {"grpo": runs({0: 0.5, 1: 0.5}), "cope_authors": runs({0: 0.6, 1: 0.4, 2: 0.9}), "cope_turns": runs({0: 0.7, 1: 0.6})}
    (pair,) = _between(arms)
    assert (pair["arm"], pair["base"]) == ("cope_turns", "cope_authors")
    mean, lo, hi, n = pair["delta_final"]
    assert n == 2 and mean == pytest.approx((0.1 + 0.2) / 2) and lo > 0  # seed 2 has no turns run: not paired
    assert pair["delta_auc"][0] == pytest.approx(0.075) and pair["delta_final_t"][3] == 2
    assert _between({"grpo": arms["grpo"], "cope_turns": arms["cope_turns"]}) == []


def test_stability_skips_unmeasured_stop_probabilities_and_the_cold_start(tmp_path):
    """SmolLM2's prose answers have no complete action: its stop p rows (logged 0) measure nothing, by count or, in
    older records without the count, by the exact 0; all-invalid validations before the first readable one are a
    cold start, not a collapse (a collapse is all invalid after a validation that was not)."""
    from bench.study.report import run_curve

    (tmp_path / "csv").mkdir()
    rows = ["epoch,step,val/invalid_rate,stop/prob_val,stop/positions_val",
            "0,0,0.994,0.0,0", "2,5,0.994,0.0,0", "5,11,0.6,0.42,7", "8,17,0.99,0.9,", "11,23,0.5,0.9,"]
    (tmp_path / "csv/metrics.csv").write_text("\n".join(rows) + "\n")
    c = run_curve(tmp_path)
    assert c["stop/prob_val/min"] == pytest.approx(0.42) and c["collapsed_validations"] == 1  # step 17 only
    (tmp_path / "csv/metrics.csv").write_text("epoch,step,stop/prob_val\n0,0,0.0\n2,5,0.0\n")
    assert run_curve(tmp_path)["stop/prob_val/min"] is None and run_curve(tmp_path)["success_drop"] is None


def test_a_late_collapse_is_the_fall_from_the_best_validation_to_the_last(tmp_path):
    """GRPO seed 3 of study4: 0.484 at epoch 8, 0.078 at epoch 11; the arm's row: mean and worst drop over seeds."""
    from bench.study.markdown import markdown
    from bench.study.report import run_curve, summarize

    runs = {}
    for seed, curve in ((0, (0.016, 0.25, 0.484, 0.078)), (1, (0.0, 0.2, 0.3, 0.4))):
        d = tmp_path / f"seed{seed}"
        (d / "csv").mkdir(parents=True)
        (d / "csv/learning_curve.csv").write_text("episodes,env_steps,val_success\n" + "".join(
            f"{48 * i},{300 * i},{y}\n" for i, y in enumerate(curve)))
        (d / "csv/metrics.csv").write_text("epoch,step\n0,0\n")
        runs[seed] = d
    assert run_curve(runs[0])["success_drop"] == pytest.approx(0.406) and run_curve(runs[1])["success_drop"] == 0.0
    from bench.study.launch import Job

    info = {"title": "t", "threshold": 0.4, "overrides": [], "arm_overrides": {}, "tuned_in": None, "by_size": None,
            "budget": [], "panels": {"tune": [], "test": []}, "seeds": {"tune": [100], "test": [0, 1]}}
    meta = {"regimes": {"r": info}, "choice": {}, "common": []}
    summary = summarize([{"rc": 0, "dir": str(d), "job": Job("r", "test", "grpo", "s", s)} for s, d in runs.items()], meta)
    assert summary["test"]["r"]["grpo"]["success_drop"] == pytest.approx((0.203, 0.406))
    assert "| 0.203 (worst 0.406) |" in markdown(summary, meta)


def test_study_md_prints_the_seeds_that_ran_and_their_count():
    """A regime planned for seeds 0-4 of which 3 ran: study.md says which ran, which did not, and the count."""
    from bench.study.markdown import markdown

    row = {"setting": "lr1e-3", "seeds": [0, 1, 2], "start": 0.1, "episodes_to": (96.0, 96.0, 96.0),
           "env_steps_to": (500.0, 400.0, 600.0), "final": (0.5, 0.4, 0.6), "auc": (0.3, 0.2, 0.4), "wall_s": 10.0,
           "runs": {"0": {"wall_s": 10.0}, "1": {"wall_s": 10.0}, "2": {"wall_s": 10.0}}}
    info = {"title": "t", "threshold": 0.4, "overrides": [], "tuned_in": None, "budget": ["trainer.max_epochs=2"],
            "panels": {"tune": ["a=1"], "test": ["b=2"]}, "seeds": {"tune": [100], "test": [0, 1, 2, 3, 4]}}
    text = markdown({"test": {"r": {"grpo": row}}, "tuning": {}}, {"common": [], "regimes": {"r": info}, "choice": {}})
    assert "test [0, 1, 2] (planned [0, 1, 2, 3, 4]; 3, 4 did not run)" in text
    assert "at 3 seeds the bootstrap interval is narrow" in text and "5 seeds" not in text
    info["seeds"]["test"] = [0, 1, 2]
    text = markdown({"test": {"r": {"grpo": row}}, "tuning": {}}, {"common": [], "regimes": {"r": info}, "choice": {}})
    assert "test [0, 1, 2]." in text and "planned" not in text


def test_tuning_line_names_a_tie_and_how_it_was_broken():
    """Two settings with the same tuning AUC: the chosen one (the first in the grid) is marked, and the tie is said."""
    from bench.study.markdown import markdown

    row = {"setting": "lam0.005", "seeds": [0], "start": 0.0, "episodes_to": (96.0,) * 3, "env_steps_to": (500.0,) * 3,
           "final": (0.5, 0.5, 0.5), "auc": (0.3, 0.3, 0.3), "wall_s": 1.0, "runs": {"0": {"wall_s": 1.0}}}
    info = {"title": "t", "threshold": 0.4, "overrides": [], "tuned_in": None, "budget": [],
            "panels": {"tune": [], "test": []}, "seeds": {"tune": [100], "test": [0]}}
    tune = {"echo": {"lam0.005": [{"auc": 0.414, "final": 0.469, "wall_s": 1.0}],
                     "lam0.05": [{"auc": 0.414, "final": 0.469, "wall_s": 1.0, "probe/obs_nll/last": 0.722}],
                     "lam0.5": [{"auc": 0.2, "final": 0.1, "wall_s": 1.0}]}}
    meta = {"common": [], "regimes": {"r": info}, "choice": {"r/echo": {"setting": "lam0.005"}}}
    text = markdown({"test": {"r": {"echo": row}}, "tuning": {"r": tune}}, meta)
    assert ("- ECHO: **`lam0.005` 0.414 / 0.469**, `lam0.05` 0.414 / 0.469 (obs NLL 0.722), `lam0.5` 0.200 / 0.100 "
            "(a tie with `lam0.05`: the first in the grid's order)") in text
    tune["echo"]["lam0.05"][0]["auc"] = 0.4
    assert "tie" not in markdown({"test": {"r": {"echo": row}}, "tuning": {"r": tune}}, meta)


def test_groups_without_a_reward_spread_are_averaged_over_epochs(tmp_path):
    """``rollout/zero_signal_groups`` (logged on epoch rows) becomes the run's mean share, and study.md's column."""
    from bench.study.launch import Job
    from bench.study.markdown import markdown
    from bench.study.report import run_curve, summarize

    (tmp_path / "csv").mkdir()
    (tmp_path / "csv/learning_curve.csv").write_text("episodes,env_steps,val_success\n0,0,0.0\n48,300,0.5\n")
    (tmp_path / "csv/metrics.csv").write_text("epoch,step,rollout/zero_signal_groups\n0,0,1.0\n0,1,\n1,2,0.5\n2,4,0.0\n")
    assert run_curve(tmp_path)["zero_signal_groups"] == pytest.approx(0.5)
    info = {"title": "t", "threshold": 0.4, "overrides": [], "arm_overrides": {}, "tuned_in": None, "by_size": None,
            "budget": [], "panels": {"tune": [], "test": []}, "seeds": {"tune": [100], "test": [0]}}
    meta = {"regimes": {"r": info}, "choice": {}, "common": []}
    summary = summarize([{"rc": 0, "dir": str(tmp_path), "job": Job("r", "test", "grpo", "s", 0)}], meta)
    assert "| GRPO | – | – | – | 0.50 | – |" in markdown(summary, meta)
