"""`model=smollm2-135m` for real, through `python train.py` on CPU: SmolLM2-135M-Instruct converted from the GGUF
file of the installed package (once per session, `tests/smollm2_fixtures.py`), a few maze episodes with the
action projection on (it answers in prose), one GRPO step and one CoPE step, the adapter export reloaded with
plain peft onto the converted folder, and the held-out validation before and after.

Kept small for CI (about a minute per run on 2 busy cores): 1 task x 2 episodes of 3 moves, 8-token actions,
2 held-out episodes. The CoPE run sets `cope.gate=all cope.invalid=keep` so its forecast has targets
without a success (a cold 135M model rarely solves a maze in 3 moves)."""
from __future__ import annotations

import pytest
import torch
from smollm2_fixtures import smollm2_folder

pytestmark = pytest.mark.long

SMALL = ["model=smollm2-135m", "env.action_parsing=project", "env.sizes=[6]", "env.max_steps=3", "trainer.max_epochs=1",
         "trainer.check_val_every_n_epoch=1", "data.tasks_per_epoch=1", "data.group_size=2", "data.minibatch_size=2",
         "data.val_tasks=2", "data.val_batch_size=2", "data.sampling.max_action_tokens=8", "data.max_context=1024",
         "data.progress=false", "trainer.enable_progress_bar=false", "callbacks.probes.max_episodes=2"]
# CoPE on every episode (gate=all), with the moves the env read out of free text counted as valid
ALGOS = {"grpo": ["algo=grpo"], "cope": ["algo=cope", "cope.gate=all", "cope.mask_projected=false"]}


@pytest.fixture(scope="module")
def folder():
    return smollm2_folder()  # converted here once, so the train.py runs below only load it


@pytest.fixture(scope="module", params=sorted(ALGOS))
def run(request, folder, train_script, tmp_path_factory):
    tmp = tmp_path_factory.mktemp(f"smollm2_{request.param}")
    run_dir = tmp / "run"
    proc = train_script([*SMALL, *ALGOS[request.param], f"hydra.run.dir={run_dir}"], tmp, timeout=300)
    report = f"exit {proc.returncode}\n--- stdout ---\n{proc.stdout[-2000:]}\n--- stderr ---\n{proc.stderr[-5000:]}"
    assert proc.returncode == 0, report
    return request.param, proc, run_dir, report


def test_trains_and_validates(run, read_metrics):
    algo, proc, run_dir, report = run
    assert "=== cope-trainer run summary ===" in proc.stdout and "after epoch 0" in proc.stdout, report
    cols = read_metrics(run_dir / "csv" / "metrics.csv")
    assert len(cols["val/success"]) == 2  # held-out before fit and after the epoch
    assert cols["counters/episodes"] == [2.0] and cols["rollout/len"] == [3.0]
    assert 0.0 <= cols["rollout/projected_actions"][0] <= 1.0 and "val/projected_actions" in cols
    assert len(cols["loss/pg"]) == 1  # one optimizer step
    if algo == "cope":
        assert cols["forecast/samples"][0] > 0 and cols["loss/forecast"][0] > 0, {k: v for k, v in cols.items() if "forecast" in k}


def test_adapter_reloads_with_plain_peft(run, folder):
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    algo, _, run_dir, _ = run
    adapter = run_dir / "csv" / "adapter"
    saved = load_file(str(adapter / "adapter_model.safetensors"))
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(str(folder), local_files_only=True), str(adapter))
    loaded = {k.replace(".default", ""): v for k, v in model.state_dict().items() if "lora_" in k}
    assert len(saved) == len(loaded) == 30 * 7 * 2  # 30 layers x 7 projections x (A, B)
    for k, v in saved.items():
        assert torch.equal(loaded[k], v), k
    if algo == "cope":  # the forecast loss moved the adapter (LoRA B starts at zero)
        assert any(v.abs().sum() > 0 for k, v in saved.items() if "lora_B" in k)
    assert (run_dir / "checkpoints" / "last.ckpt").is_file()
