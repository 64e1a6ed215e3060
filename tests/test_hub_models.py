"""``model.path`` as a hub id: resolved through the local Hugging Face cache (never the network), a local folder
stays a folder, and a model that is in neither is one message naming both fixes.

The cache is built the way ``huggingface-cli download`` leaves it (``hub/models--Org--Name/`` with ``blobs/``,
``snapshots/<commit>/`` of links into them and ``refs/main`` naming the commit), holding a tiny Qwen2 saved
with ``save_pretrained``. In-process tests point ``huggingface_hub`` at it (``constants.HF_HUB_CACHE``, read at
call time); the entry-point tests set ``HF_HOME`` as a user would."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from hub_fixtures import COMMIT, REPO_ID, hub_cache
from tiny_fixtures import lora_config, save_tiny, tiny_base

from cope.models.policy import load_pretrained


@pytest.fixture
def hf_home(tmp_path, monkeypatch) -> Path:
    """An HF home with ``Org/Name`` cached, and this process's ``huggingface_hub`` reading its cache."""
    from huggingface_hub import constants

    home = tmp_path / "hf_home"
    hub_cache(home)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(home / "hub"))
    return home


def _first_weight(model) -> torch.Tensor:
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return base.model.embed_tokens.weight.detach()


def test_hub_id_loads_from_the_cache_and_stays_the_source(hf_home):
    policy = load_pretrained(REPO_ID, lora=lora_config(), dtype="fp32")
    assert policy.source == REPO_ID  # what the checkpoint and the export record: the id the user asked for
    assert torch.equal(_first_weight(policy.model), _first_weight(tiny_base(0)))


def test_local_folder_stays_a_folder(hf_home, tmp_path, monkeypatch):
    """A folder named like a hub id is that folder (seed 1 here), not the cached model (seed 0)."""
    monkeypatch.chdir(tmp_path)
    save_tiny(tmp_path / REPO_ID, seed=1)
    policy = load_pretrained(REPO_ID, lora=lora_config(), dtype="fp32")
    assert torch.equal(_first_weight(policy.model), _first_weight(tiny_base(1)))


@pytest.mark.parametrize("path", ["Org/Missing", "/nonexistent/model-dir"])
def test_model_in_neither_place_is_one_message_with_both_fixes(hf_home, path):
    with pytest.raises(FileNotFoundError) as err:
        load_pretrained(path, lora=lora_config())
    msg = str(err.value)
    assert f"model.path {path!r}" in msg, msg
    assert "huggingface-cli download" in msg and "HF_HOME" in msg, msg  # fix 1: put it into the cache
    assert "local folder" in msg, msg  # fix 2: point model.path at a folder
    if "/" in path and not path.startswith("/"):
        assert f"huggingface-cli download {path}" in msg and str(hf_home / "hub") in msg, msg
    assert err.value.__cause__ is None and (err.value.__context__ is None or err.value.__suppress_context__), \
        "one message, no chained traceback"


def test_vllm_server_is_given_the_snapshot_folder(hf_home, tmp_path):
    """The managed vLLM server loads the files the trainer loaded: the id's snapshot folder, not a hub lookup."""
    from cope.rollout.vllm.server import ManagedServer

    snap = hf_home / "hub" / f"models--{REPO_ID.replace('/', '--')}" / "snapshots" / COMMIT
    server = ManagedServer(REPO_ID, python=sys.executable, log_path=tmp_path / "server.log")
    cmd = server.command(8000)
    assert Path(cmd[cmd.index("--model") + 1]).resolve() == snap.resolve(), cmd
    local = tmp_path / "folder"
    cmd = ManagedServer(str(local), python=sys.executable, log_path=tmp_path / "server.log").command(8000)
    assert cmd[cmd.index("--model") + 1] == str(local), cmd


# -- through `python train.py`, with HF_HOME set as a user sets it --------------------------------------------------
@pytest.mark.long
def test_train_py_runs_a_hub_id_from_the_cache(train_script, tmp_path):
    """The README's GPU quick start (`huggingface-cli download <id>`, then `model=qwen2.5-7b`), on a tiny model."""
    home = tmp_path / "hf_home"
    hub_cache(home)
    run = tmp_path / "run"
    proc = train_script(["model=qwen2.5-7b", f"model.path={REPO_ID}", "model.dtype=fp32", "debug=fast",
                         "trainer.max_epochs=1", "data.tasks_per_epoch=1", "data.group_size=2", "data.val_tasks=2",
                         f"hydra.run.dir={run}"], tmp_path, timeout=300, env={"HF_HOME": str(home), "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "=== cope-trainer run summary ===" in proc.stdout
    ckpt = torch.load(run / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    assert ckpt["base_model"] == REPO_ID
    assert json.loads((run / "csv" / "adapter" / "cope_export.json").read_text())["base_model"] == REPO_ID


@pytest.mark.long
def test_train_py_names_both_fixes_for_a_missing_id(train_script, tmp_path):
    home = tmp_path / "hf_home"
    (home / "hub").mkdir(parents=True)
    proc = train_script(["model=qwen2.5-7b", "model.path=Org/Missing", f"hydra.run.dir={tmp_path / 'run'}"], tmp_path,
                        timeout=120, env={"HF_HOME": str(home), "HF_HUB_OFFLINE": "1"})
    assert proc.returncode != 0
    err = proc.stderr
    assert err.count("FileNotFoundError: model.path 'Org/Missing'") == 1, err[-4000:]
    assert "huggingface-cli download Org/Missing" in err and "local folder" in err, err[-4000:]
