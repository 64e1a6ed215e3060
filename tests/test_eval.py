"""``eval.py``: an exported adapter reproduces its training run's last held-out numbers on the same panel; the base
model differs; the same command gives the same per-task CSV; a rerun resumes; bad input fails before the model loads."""
from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

CONF = Path(__file__).resolve().parents[1] / "conf"
RUN = ["trainer.max_epochs=2", "model.warm_start_steps=150", "env.sizes=[5]", "env.min_distance=1"]


def _eval(overrides: list[str], out: Path) -> dict:
    from hydra import compose, initialize_config_dir

    from cope.run.evaluate import evaluate

    with initialize_config_dir(config_dir=str(CONF), version_base="1.3", job_name="test"):
        cfg = compose("eval", overrides=["debug=fast", *RUN[1:], f"paths.output_dir={out}", f"eval.out={out}", *overrides])
    return evaluate(cfg)


def _rows(path: Path) -> list[dict]:
    with path.open(newline="") as f:
        return list(csv.DictReader(f))


@pytest.fixture(scope="module")
def trained(run_train, tmp_path_factory):
    out = tmp_path_factory.mktemp("trained")
    result = run_train(RUN, out)
    return out, result


@pytest.mark.long
def test_the_exported_adapter_reproduces_the_last_validation(trained, tmp_path):
    run, result = trained
    panel = ["eval.start=0", "eval.count=8"]  # debug=fast's held-out panel: test tasks 0..7
    s = _eval([f"adapter={run / 'csv' / 'adapter'}", *panel], tmp_path / "a")
    assert s["complete"] and s["tasks"] == 8 and s["success"] == result["val/success"]
    last = sorted((run / "csv" / "val_episodes").glob("episodes*.csv"), key=lambda p: int(p.stem[8:]))[-1]
    keys = ("index", "success", "steps", "invalid", "end_reason")
    assert [{k: r[k] for k in keys} for r in _rows(tmp_path / "a" / "episodes.csv")] == [{k: r[k] for k in keys} for r in _rows(last)]
    assert {"pass@1", "success_ci95", "invalid_rate", "score", "steps"} <= set(s)
    again = _eval([f"adapter={run / 'csv' / 'adapter'}", *panel], tmp_path / "b")  # deterministic
    assert (tmp_path / "a" / "episodes.csv").read_text() == (tmp_path / "b" / "episodes.csv").read_text() and again == s
    resumed = _eval([f"adapter={run / 'csv' / 'adapter'}", *panel], tmp_path / "a")  # the same folder: nothing to run
    assert resumed == s and len(_rows(tmp_path / "a" / "episodes.csv")) == 8
    _eval(panel, tmp_path / "base")  # the base model, without the adapter: other trajectories
    assert (tmp_path / "base" / "trajectories.jsonl").read_text() != (tmp_path / "a" / "trajectories.jsonl").read_text()
    assert json.loads((tmp_path / "base" / "summary.json").read_text())["adapter"] is None
    metrics = _rows(tmp_path / "a" / "csv" / "metrics.csv")  # the configured logger (csv) got the summary
    assert float(metrics[-1]["eval/success"]) == s["success"] and "eval/pass@1" in metrics[-1]


@pytest.mark.long
def test_probes_reproduce_the_last_validations_probes(trained, tmp_path):
    """``eval.probes=true``: the training run's held-out probes, on the same adapter and panel, give the numbers
    its last validation logged (the same greedy episodes, the same forecast samples and scoring)."""
    run, _ = trained
    s = _eval([f"adapter={run / 'csv' / 'adapter'}", "eval.start=0", "eval.count=8", "eval.probes=true"], tmp_path)
    logged = [r for r in _rows(run / "csv" / "metrics.csv") if r.get("probe/obs_nll")][-1]
    keys = [k for k in logged if k.startswith("probe/")]
    assert len(keys) == 7 and s["probe/episodes"] == 8.0 and s["probe/obs_tokens"] > 0 and s["probe/forecast_chunks"] > 0
    for k in keys:
        assert s[k] == pytest.approx(float(logged[k]), rel=1e-4, abs=1e-6), k
    assert json.loads((tmp_path / "summary.json").read_text())["probe/obs_nll"] == s["probe/obs_nll"]


@pytest.mark.long
def test_study_probes_on_a_finished_run_folder(trained, tmp_path, capsys):
    """bench.study.probes on a study-shaped run folder (overrides, done marker, final adapter): eval.py with the
    run's episode-shaping overrides and panel gives the run's last validation and its probes; a rerun reuses them."""
    import shutil

    from bench.study import probes as study_probes

    run, result = trained
    folder = tmp_path / "test" / "grpo" / "lr1e-3" / "seed0"
    (folder / ".hydra").mkdir(parents=True)
    shutil.copytree(run / "csv" / "adapter", folder / "csv" / "adapter")
    shutil.copy(run / "csv" / "learning_curve.csv", folder / "csv" / "learning_curve.csv")
    (folder / "done").write_text(json.dumps({"wall_s": 1.0}))  # as the study launcher writes it
    lines = ["debug=fast", *RUN, "seed=0", "trainer.check_val_every_n_epoch=1", "data.val_offset=0", "data.val_tasks=8",
             "hydra.run.dir=elsewhere"]  # seed, trainer and hydra keys do not shape the held-out episodes: dropped
    (folder / ".hydra" / "overrides.yaml").write_text("".join(f"- {x}\n" for x in lines))
    assert study_probes.run_overrides(folder)[0] == ["debug=fast", *RUN[1:]]
    out = tmp_path / "probes.md"
    assert study_probes.main([str(tmp_path / "test"), "--layouts", "list", "--out", str(out)]) == 0
    (row,) = json.loads(out.with_suffix(".json").read_text())
    logged = [r for r in _rows(run / "csv" / "metrics.csv") if r.get("probe/obs_nll")][-1]
    assert row["success"] == row["last_val_success"] == result["val/success"] and row["probe/episodes"] == 8.0
    for k in ("probe/forecast_action_acc", "probe/forecast_chunks", "probe/obs_nll"):
        assert row[k] == pytest.approx(float(logged[k]), rel=1e-4, abs=1e-6), k
    assert "| grpo | list | 1 |" in out.read_text()
    summary = folder / "probe_eval" / "list" / "summary.json"
    before = summary.stat().st_mtime_ns
    assert study_probes.main([str(tmp_path / "test"), "--layouts", "list", "--out", str(out)]) == 0
    assert summary.stat().st_mtime_ns == before  # reused, not evaluated again


@pytest.mark.long
def test_sampling_n_per_task_gives_pass_at_k(trained, tmp_path):
    run, _ = trained
    s = _eval([f"adapter={run / 'csv' / 'adapter'}", "eval.count=4", "eval.n=3", "eval.temperature=1.0"], tmp_path)
    assert s["episodes"] == 12 and s["samples_per_task"] == 3 and s["pass@1"] <= s["pass@3"] <= 1.0


def test_pass_at_k_and_the_summary():
    from cope.run.evaluate import pass_at_k, summarize

    assert pass_at_k(5, 0, 1) == 0.0 and pass_at_k(5, 5, 3) == 1.0 and pass_at_k(4, 1, 1) == pytest.approx(0.25)
    assert pass_at_k(4, 1, 2) == pytest.approx(0.5)  # 1 - C(3,2)/C(4,2)
    rows = [{"index": i, "sample": j, "success": int(i == 0 or j == 0), "score": 0, "steps": 2, "invalid": 1}
            for i in range(2) for j in range(2)]
    s = summarize(rows, 2, 2)
    assert s["complete"] and s["success"] == 0.75 and s["pass@1"] == 0.75 and s["pass@2"] == 1.0 and s["invalid_rate"] == 0.5


@pytest.mark.parametrize("overrides, match", [
    (["adapter=/nonexistent/adapter"], "model.adapter=.*no adapter_config.json"),
    (["eval.split=valid"], "eval.split='valid'"),
    (["eval.start=5", "eval.count=1000"], "are not in the 'test' split"),
    (["ckpt_path=/nonexistent.ckpt"], "no such checkpoint file"),
    (["eval.probes=true", "callbacks.probes.layout=grid"], "callbacks.probes.*layout must be one of"),
    (["eval.probes=true", "~callbacks.probes"], "eval.probes=true needs callbacks.probes"),
])
def test_bad_input_fails_before_the_model_loads(tmp_path, monkeypatch, overrides, match):
    import cope.models.tiny as tiny

    monkeypatch.setattr(tiny, "build_once", lambda *a, **k: (_ for _ in ()).throw(AssertionError("a model was built")))
    with pytest.raises((ValueError, FileNotFoundError), match=match):
        _eval(overrides, tmp_path)


def test_wandb_gets_the_metrics_and_an_episode_table(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    from lightning.pytorch.loggers import WandbLogger

    from cope.run.evaluate import _log, summarize

    logger = WandbLogger(offline=True, save_dir=str(tmp_path))
    seen = {}
    monkeypatch.setattr(logger, "log_metrics", lambda m, step=None: seen.update(metrics=m))
    monkeypatch.setattr(logger, "log_table", lambda key, columns, data, step=None: seen.update(table=(key, columns, data)))
    monkeypatch.setattr(logger, "finalize", lambda status: None)
    rows = [{"split": "test", "index": i, "sample": 0, "success": i % 2, "score": 0.0, "reward": 0.0, "steps": 3,
             "invalid": 0, "end_reason": "done"} for i in range(4)]
    _log(logger, summarize(rows, 1, 4), rows)
    assert seen["metrics"]["eval/success"] == 0.5 and "eval/success_ci95_low" in seen["metrics"]
    key, columns, data = seen["table"]
    assert key == "eval/episodes" and len(data) == 4 and columns[:3] == ["split", "index", "sample"]


@pytest.mark.long
def test_sigterm_keeps_the_finished_waves_and_a_rerun_completes(trained, tmp_path, monkeypatch, capsys):
    """SIGTERM ends the evaluation after its current wave: the written episodes stay, the summary says incomplete, and
    the same command finishes the rest. The signal is a real SIGTERM to this process, sent right after the first wave
    is written (a subprocess killed on a timer raced the evaluation: on a fast machine all 32 tasks finished first)."""
    import os
    import signal

    from cope.run import evaluate as ev

    run, _ = trained
    out = tmp_path / "eval"
    args = [f"adapter={run / 'csv' / 'adapter'}", "eval.count=32", "eval.batch_size=4", "eval.progress=false"]
    append, calls = ev._append, []

    def append_then_terminate(path, rows):
        append(path, rows)
        calls.append(len(rows))
        if len(calls) == 1:
            os.kill(os.getpid(), signal.SIGTERM)  # the handler eval installed runs here, at the next bytecode

    monkeypatch.setattr(ev, "_append", append_then_terminate)
    def guard(*_):  # reached only if eval did not install its own handler: the test fails instead of pytest dying
        calls.append("unhandled")

    previous = signal.signal(signal.SIGTERM, guard)
    try:
        first = _eval(args, out)
        assert signal.getsignal(signal.SIGTERM) is guard  # eval restored the previous handler
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert calls == [4] and not first["complete"] and first["tasks"] == 4
    assert "INCOMPLETE" in capsys.readouterr().out
    assert not json.loads((out / "summary.json").read_text())["complete"]
    monkeypatch.setattr(ev, "_append", append)
    done = _eval(args, out)
    assert done["complete"] and done["tasks"] == 32 and len(_rows(out / "episodes.csv")) == 32
