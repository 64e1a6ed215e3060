"""Full fine-tuning (``model.finetune=full``): every weight trains, the KL reference is a frozen copy of the starting
weights, checkpoints hold every weight and resume exactly, the export is a plain HF model folder that ``eval.py``
loads as ``model.path`` (the same episodes as from the checkpoint), and what cannot combine with it is refused before
any work."""
from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
import torch
from lightning.pytorch import Callback

CONF = Path(__file__).resolve().parents[1] / "conf"
# a warm-started model on small mazes finishes some episodes (non-zero policy gradients); the KL term on
FULL = ["model.finetune=full", "algo=grpo", "algo.objectives.kl.weight=0.05", "model.warm_start_steps=150",
        "env.sizes=[5]", "env.min_distance=1", "validate_before_fit=false", "trainer.check_val_every_n_epoch=3"]


class Probe(Callback):
    """Test-only: the weights at fit start, each epoch's first scored minibatch (old and reference log-probs), the
    reference copy at fit end."""

    def __init__(self):
        self.start, self.scored, self.reference, self.end = {}, [], {}, {}

    def on_train_start(self, trainer, pl_module):
        self.start = {n: p.detach().clone() for n, p in pl_module.policy.model.named_parameters()}

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if batch_idx == 0:
            mb = trainer.datamodule.train_record.minibatches[0]
            self.scored.append((mb["old_logprobs"].clone(), mb["ref_logprobs"].clone(), mb["attention_mask"].clone()))

    def on_fit_end(self, trainer, pl_module):
        self.reference = {n: p.detach().clone() for n, p in pl_module.policy.reference_model.named_parameters()}
        self.end = {n: p.detach().clone() for n, p in pl_module.policy.model.named_parameters()}


def _train(compose, tmp_path, overrides):
    from cope.run.train import train

    probe = Probe()
    cfg = compose([*FULL, *overrides], tmp_path)
    with pytest.MonkeyPatch.context() as mp:  # the probe joins the run's callbacks
        import cope.run.train as run

        real = run.instantiate_named
        mp.setattr(run, "instantiate_named", lambda node, key: real(node, key) + ([probe] if key == "callbacks" else []))
        train(cfg)
    return probe


@pytest.fixture(scope="module")
def straight(compose, tmp_path_factory):
    out = tmp_path_factory.mktemp("full")
    probe = _train(compose, out, ["trainer.max_epochs=3", "callbacks.checkpoint.every_n_epochs=1"])
    return out, probe


@pytest.mark.long
def test_every_weight_trains_against_a_frozen_reference(straight, read_metrics):
    out, probe = straight
    names = set(probe.start)
    assert any("embed_tokens" in n for n in names) and not any("lora_" in n for n in names)
    moved = {n for n in names if not torch.equal(probe.start[n], probe.end[n])}
    assert moved == names, names - moved  # every weight trained, the (tied) embedding and head included
    for n in names:  # the reference is the starting weights, untouched by three epochs
        assert torch.equal(probe.reference[n], probe.start[n]), n
    (old0, ref0, _), (old2, ref2, mask2) = probe.scored[0], probe.scored[-1]
    assert torch.equal(old0, ref0)  # before any update the policy is its reference
    real = mask2.bool()
    assert not torch.equal(old2[real], ref2[real])  # after two epochs it is not
    cols = read_metrics(out / "csv" / "metrics.csv")
    assert max(cols["loss/kl"]) > 0 and max(cols["train/grad_norm"]) > 0


@pytest.mark.long
def test_checkpoint_holds_every_weight_and_resumes_exactly(straight, compose, tmp_path):
    out, probe = straight
    ckpt = torch.load(out / "checkpoints" / "last.ckpt", weights_only=False)
    assert ckpt["finetune"] == "full"
    assert {k.removeprefix("model.") for k in ckpt["state_dict"]} == set(probe.start)
    # resume the epoch-2 state: the straight run's checkpoint after epoch 1 is gone, so make one (2 epochs) and go on
    first = tmp_path / "resume"
    _train(compose, first, ["trainer.max_epochs=2"])
    resumed = _train(compose, first, ["trainer.max_epochs=3", f"ckpt_path={first / 'checkpoints' / 'last.ckpt'}"])
    for n, w in probe.end.items():
        assert torch.equal(resumed.end[n], w), n
    for n, w in probe.start.items():  # the resumed run's reference is the starting weights, not the checkpoint's
        assert torch.equal(resumed.reference[n], w), n


@pytest.mark.long
def test_export_is_a_model_folder_that_eval_loads(straight, tmp_path):
    """``<run>/csv/model`` is a plain HF folder with the trained weights; ``eval.py`` on it (as ``model.path``) plays
    the same greedy episodes as ``eval.py`` on the run's checkpoint."""
    from hydra import compose, initialize_config_dir
    from transformers import AutoModelForCausalLM

    from cope.run.evaluate import evaluate

    out, probe = straight
    folder = out / "csv" / "model"
    assert json.loads((folder / "cope_export.json").read_text())["format"] == "hf"
    loaded = dict(AutoModelForCausalLM.from_pretrained(folder).named_parameters())
    for n, w in probe.end.items():
        assert torch.equal(loaded[n], w), n
    common = ["debug=fast", "env.sizes=[5]", "env.min_distance=1", "eval.count=4", "~logger"]
    runs = {"ckpt": ["model.finetune=full", "model.warm_start_steps=150", f"ckpt_path={out / 'checkpoints' / 'last.ckpt'}"],
            "folder": ["model=qwen2.5-7b", f"model.path={folder}", "model.finetune=full", "model.dtype=fp32",
                       "model.gradient_checkpointing=false"]}
    episodes = {}
    for name, args in runs.items():
        with initialize_config_dir(config_dir=str(CONF), version_base="1.3", job_name="test"):
            cfg = compose("eval", overrides=[*common, *args, f"paths.output_dir={tmp_path / name}",
                                             f"eval.out={tmp_path / name}"])
        evaluate(cfg)
        with open(tmp_path / name / "episodes.csv", newline="") as f:
            episodes[name] = list(csv.DictReader(f))
    assert len(episodes["ckpt"]) == 4 and episodes["ckpt"] == episodes["folder"]


@pytest.mark.parametrize("override,key", [
    ("model.quantization=4bit", "model.quantization"),
    ("model.adapter=/nonexistent", "model.adapter"),
    ("model.dtype=bf16", "model.dtype"),  # AdamW on bf16 weights rounds small updates away
    ("rollout=vllm", "data.engine"),
    ("callbacks.adapter_export.merged=true", "callbacks.adapter_export.merged"),
])
def test_refused_before_any_work(compose, tmp_path, override, key):
    from cope.run.config_check import ConfigError, check_config

    with pytest.raises(ConfigError) as err:
        check_config(compose(["model.finetune=full", override], tmp_path))
    msg = str(err.value)
    assert key in msg and "model.finetune" in msg, msg


def test_unknown_mode_and_other_mode_checkpoint_are_refused(compose, tmp_path):
    from cope.run.checkpoint_io import CheckpointMismatchError, check_resume_matches
    from cope.run.config_check import ConfigError, check_config

    with pytest.raises(ConfigError, match="model.finetune"):
        check_config(compose(["model.finetune=everything"], tmp_path))
    path = tmp_path / "lora.ckpt"
    torch.save({"state_dict": {}, "base_model": "x"}, path)  # an older LoRA checkpoint records no mode
    with pytest.raises(CheckpointMismatchError, match="model.finetune=lora, this config has model.finetune=full"):
        check_resume_matches(path, None, None, finetune="full")
    check_resume_matches(path, None, None, finetune="lora")
