"""Bad command lines fail fast through the real entry point, naming what is wrong, before a model is built.

Each case runs with a fresh, empty COPE_CACHE: no `tiny/` folder may appear in it (building the tiny model
is the first expensive step, and it comes after every config check). Key/option/path errors go through
`python train.py ...`; bad values through `cope.run.train.train` in-process (same code path after composition)."""
from __future__ import annotations

import logging
import time
from pathlib import Path

import pytest

FAST = 45.0  # seconds: interpreter + torch/lightning import on a loaded 1-thread CPU; a model build would add more


def _run(train_script, tmp_path, args):
    cache = tmp_path / "cache"
    cache.mkdir()
    t0 = time.perf_counter()
    proc = train_script([*args, f"hydra.run.dir={tmp_path / 'run'}"], tmp_path, timeout=120, env={"COPE_CACHE": str(cache)})
    wall = time.perf_counter() - t0
    report = f"exit {proc.returncode} after {wall:.1f}s\n--- stderr ---\n{proc.stderr[-4000:]}"
    assert proc.returncode != 0, report
    assert wall < FAST, report
    assert not (cache / "tiny").exists(), "the tiny model was built before the config error surfaced\n" + report
    return proc, report


@pytest.mark.long
@pytest.mark.parametrize("override, key", [
    ("trainer.max_epoch=3", "trainer.max_epoch"),
    ("data.group_sise=4", "data.group_sise"),
])
def test_mistyped_key(train_script, tmp_path, override, key):
    proc, report = _run(train_script, tmp_path, ["debug=fast", override])
    assert key in proc.stderr, report
    assert "not in struct" in proc.stderr, report


@pytest.mark.long
@pytest.mark.parametrize("override, group, option", [("algo=nope", "algo", "nope"), ("env=nope", "env", "nope")])
def test_unknown_group_option(train_script, tmp_path, override, group, option):
    proc, report = _run(train_script, tmp_path, ["debug=fast", override])
    assert f"'{group}/{option}'" in proc.stderr, report
    assert f"Available options in '{group}'" in proc.stderr, report


@pytest.mark.parametrize("override, key, value", [
    ("data.group_size=0", "data.group_size", "0"),
    ("algo.advantage_mode=bogus", "advantage_mode", "bogus"),
])
def test_bad_value(run_train, tmp_path, monkeypatch, override, key, value):
    # in-process (the entry point prints the same exception): saves an interpreter start per case
    cache = tmp_path / "cache"
    monkeypatch.setenv("COPE_CACHE", str(cache))
    import lightning.pytorch  # noqa: F401  (import time is not what is measured)
    import peft  # noqa: F401  (the config check imports every `_target_`, model.lora's peft.LoraConfig too)

    t0 = time.perf_counter()
    with pytest.raises(Exception) as err:
        run_train([override], tmp_path)
    msg = f"{type(err.value).__name__}: {err.value}"
    assert key in msg and value in msg, msg
    assert "ValueError" in msg, msg
    assert time.perf_counter() - t0 < 10, "the error came late"
    assert not (cache / "tiny").exists(), "the tiny model was built before the config error surfaced"


@pytest.mark.long
def test_missing_model_path(train_script, tmp_path):
    # no debug=fast here: it sets tiny-model sizes (model.hidden_size, ...) that a pretrained model does not take
    proc, report = _run(train_script, tmp_path, ["model=qwen2.5-7b", "model.path=/nonexistent/dir"])
    assert "FileNotFoundError" in proc.stderr, report
    assert "model.path" in proc.stderr and "/nonexistent/dir" in proc.stderr, report


# -- the typed check of the composed config (cope.run.config_check) -----------------------------------------------
CONF = Path(__file__).resolve().parents[1] / "conf"


def _compose_plain(overrides: list[str], tmp_path):
    """The run config without `debug=fast` (its tiny-model sizes are not arguments of a pretrained loader)."""
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(CONF), version_base="1.3", job_name="test"):
        return compose(config_name="config", overrides=[f"paths.output_dir={tmp_path}", *overrides])


@pytest.mark.parametrize("overrides, layout, masked", [
    (["algo=grpo"], "list", True), (["algo=cope", "cope.layout=turns"], "turns", True),
    (["algo=cope", "experiment=smollm2_maze", "model=smollm2-135m"], "list", False),  # SmolLM2's answers are projected
])
def test_probes_follow_the_run(tmp_path, overrides, layout, masked):
    """The held-out probe forecasts in the run's ``cope.layout`` (``list`` without one); the SmolLM2 preset probes
    the answers the projection read, which the default mask would skip (no chunk at all)."""
    from cope.run.train import instantiate_plain

    cfg = _compose_plain(overrides, tmp_path)
    probes = instantiate_plain(cfg.callbacks.probes)
    assert (probes.layout, probes.mask_projected) == (layout, masked)
    if "cope" in cfg:  # no two keys disagree: the forecasts and the probes read one switch
        assert cfg.algo.callbacks.forecasts.mask_projected == masked
    with pytest.raises(Exception, match="callbacks.probes.layout must be one of"):  # hydra wraps the ValueError
        instantiate_plain(_compose_plain([*overrides, "callbacks.probes.layout=grid"], tmp_path).callbacks.probes)


def _fails_fast(run, tmp_path, monkeypatch) -> str:
    """Run ``run()`` (a train call) with an empty COPE_CACHE: it must raise a ValueError quickly, before the
    tiny model is built. Returns the message."""
    cache = tmp_path / "cache"
    monkeypatch.setenv("COPE_CACHE", str(cache))
    import lightning.pytorch  # noqa: F401  (import time is not what is measured)
    import peft  # noqa: F401  (the check imports every `_target_`, model.lora's peft.LoraConfig too)

    t0 = time.perf_counter()
    with pytest.raises(Exception) as err:
        run()
    msg = f"{type(err.value).__name__}: {err.value}"
    assert isinstance(err.value, ValueError) or "ValueError(" in msg, msg  # a constructor's, wrapped by Hydra
    assert time.perf_counter() - t0 < 10, "the error came late\n" + msg
    assert not (cache / "tiny").exists(), "the tiny model was built before the config error surfaced\n" + msg
    return msg


@pytest.mark.parametrize("overrides, key, value, expected", [
    (["data.group_size=abc"], "data.group_size", "'abc'", "expected int"),
    (["seed=abc"], "seed", "'abc'", "expected int"),
    (["algo=cope", "cope.weight=abc"], "cope.weight", "'abc'", "expected float"),  # a knob, typed where it lands
    (["module.optimizer.lr=fast"], "module.optimizer.lr", "'fast'", "expected float"),
    (["trainer.max_epochs=two"], "trainer.max_epochs", "'two'", "expected int"),
    (["data.progress=maybe"], "data.progress", "'maybe'", "expected bool"),
    (["ckpt_path=5"], "ckpt_path", "5", "expected str | null"),
    (["data.env_runtime.workers=many"], "data.env_runtime.workers", "'many'", "expected int"),  # nested settings records
    (["data.sampling.top_p=high"], "data.sampling.top_p", "'high'", "expected float"),
    # closed sets of the model builders (Literal annotations, cope.models.choices): once refused only by the loader,
    # after the tiny model's build and warm start
    (["model.quantization=3bit"], "model.quantization", "'3bit'", "expected one of '4bit', '8bit' | null"),
    (["model.dtype=fp64"], "model.dtype", "'fp64'", "expected one of 'fp32', 'bf16', 'fp16'"),
    (["model.finetune=everything"], "model.finetune", "'everything'", "expected one of 'lora', 'full'"),
    (["model.warm_start_policy=greedy"], "model.warm_start_policy", "'greedy'", "expected one of 'random', 'expert'"),
])
def test_wrong_type_names_key(run_train, tmp_path, monkeypatch, overrides, key, value, expected):
    msg = _fails_fast(lambda: run_train(overrides, tmp_path), tmp_path, monkeypatch)
    assert "ConfigError" in msg and key in msg and value in msg and expected in msg, msg


@pytest.mark.parametrize("override, key, value, rule", [
    ("trainer.check_val_every_n_epoch=0", "trainer.check_val_every_n_epoch", "0", ">= 1"),
    ("trainer.max_epochs=0", "trainer.max_epochs", "0", "-1 (no limit) or >= 1"),
    ("algo.objectives.kl.weight=-0.5", "algo.objectives.kl", "-0.5", "weight must be >= 0"),
    ("data.env_runtime.max_live_episodes=0", "data.env_runtime.max_live_episodes", "0", "null (all at once) or >= 1"),
    ("data.sampling.temperature=-1", "data.sampling.temperature", "-1", "must be >= 0"),
    # the module runs the optimizer step itself (micro-batches): clipping and accumulation are its settings
    ("trainer.gradient_clip_val=1.0", "trainer.gradient_clip_val", "1.0", "module.gradient_clip_val"),
    ("+trainer.accumulate_grad_batches=2", "trainer.accumulate_grad_batches", "2", "module.max_tokens_per_microbatch"),
    ("module.max_tokens_per_microbatch=0", "module.max_tokens_per_microbatch", "0", "null or >= 1"),
    ("data.env_runtime.step_timeout_s=0", "data.env_runtime.step_timeout_s", "0", "must be > 0"),
    ("data.max_context=100000", "data.max_context", "100000", "exceeds the model's 2048 positions (model.max_context)"),
    # without a reload every epoch the module would train on the first epoch's (already scored) rollouts again
    ("trainer.reload_dataloaders_every_n_epochs=0", "trainer.reload_dataloaders_every_n_epochs", "0", "fresh on-policy"),
    # the optimizer and the adapter config are built after the model (configure_optimizers, get_peft_model): they
    # once failed there, minutes in, without the key ("Invalid learning rate: -1", "`r` should be a positive integer")
    ("module.optimizer.lr=-1", "module.optimizer.lr", "-1", "must be >= 0"),
    ("module.optimizer.weight_decay=-0.1", "module.optimizer.weight_decay", "-0.1", "must be >= 0"),
    ("model.lora.r=0", "model.lora.r", "0", "must be >= 1"),
    ("model.lora.lora_dropout=1.0", "model.lora.lora_dropout", "1.0", "must be in [0, 1)"),
])
def test_bad_range_names_key(run_train, tmp_path, monkeypatch, override, key, value, rule):
    msg = _fails_fast(lambda: run_train([override], tmp_path), tmp_path, monkeypatch)
    assert key in msg and value in msg and rule in msg, msg


def test_max_context_beyond_pretrained_positions(tmp_path, monkeypatch):
    """A pretrained model's limit is read from <model.path>/config.json, without loading the model."""
    from cope.run.train import train

    model_dir = tmp_path / "model"
    model_dir.mkdir()
    (model_dir / "config.json").write_text('{"model_type": "qwen2", "max_position_embeddings": 512}')
    cfg = _compose_plain(["model=qwen2.5-7b", f"model.path={model_dir}", "data.max_context=1024"], tmp_path)
    msg = _fails_fast(lambda: train(cfg), tmp_path, monkeypatch)
    assert "data.max_context = 1024" in msg and "512 positions" in msg and str(model_dir / "config.json") in msg, msg


@pytest.mark.long
def test_entry_point_names_key(train_script, tmp_path):
    """Through `python train.py`: the key and the type, not Lightning's bare AssertionError."""
    proc, report = _run(train_script, tmp_path, ["debug=fast", "trainer.max_epochs=two"])
    assert "trainer.max_epochs = 'two': expected int | null" in proc.stderr, report
    assert "AssertionError" not in proc.stderr, report


@pytest.mark.parametrize("overrides, problem", [
    (["+callbacks.probes.bogus=1"], "callbacks.probes.bogus: not an argument of cope.callbacks.probes.HeldOutProbes"),
    (["model.lora.r=abc"], "model.lora.r = 'abc': expected int (peft."),
    (["model.lora.target_modules=[q_proj,5]"], "model.lora.target_modules = ['q_proj', 5]: expected list[str] | str | null"),
    (["env.max_steps=abc"], "env.max_steps = 'abc': expected int (cope.envs.maze.MazeEnv)"),
    (["algo=empg", "algo.callbacks.empg.k=abc"], "algo.callbacks.empg.k = 'abc': expected float"),
    (["algo.advantage_mode=3"], "algo.advantage_mode = 3: expected str (read as data.advantage_mode by cope.train."),
    (["trainer.precision=bogus"], "trainer.precision = 'bogus': expected one of 64, 32, 16"),
    (["env._target_=nope.Env"], "env._target_ = 'nope.Env': cannot be imported"),
    (["validate_before_fit=maybe"], "validate_before_fit = 'maybe': expected bool"),
    (["seed=abc"], "seed = 'abc'"),  # reported once: data.seed and forecast seeds interpolate it
    (["+data.env_runtime.wokers=2"], "data.env_runtime.wokers: not an argument of cope.rollout.engine.EnvRuntime"),
    (["+data.engine.bogus=1"], "data.engine.bogus: not an argument of cope.rollout.engine.HFEngine"),  # the rollout group
])
def test_check_names_key_in_every_block(compose, tmp_path, overrides, problem):
    from cope.run.config_check import ConfigError, check_config

    with pytest.raises(ConfigError) as err:
        check_config(compose(overrides, tmp_path))
    assert problem in str(err.value), str(err.value)
    assert len(err.value.problems) == 1, str(err.value)


def test_check_reports_every_problem_at_once(compose, tmp_path):
    from cope.run.config_check import ConfigError, check_config

    with pytest.raises(ConfigError) as err:
        check_config(compose(["data.group_size=abc", "trainer.max_epochs=two", "data.progress=maybe"], tmp_path))
    assert sorted(p.split(" ")[0] for p in err.value.problems) == ["data.group_size", "data.progress", "trainer.max_epochs"]


@pytest.mark.parametrize("overrides, warning", [
    (["data.group_size=1"], "data.group_size=1: one episode per group, so every group-relative advantage is 0"),
    (["algo.objectives.pg.weight=0"], "every algo.objectives.*.weight is 0: training changes nothing"),
    (["module.optimizer.lr=0"], "module.optimizer.lr=0: the adapter never changes"),
])
def test_noop_settings_warn(compose, tmp_path, caplog, overrides, warning):
    from cope.run.config_check import check_config

    with caplog.at_level(logging.WARNING, logger="cope.run.config_check"):
        check_config(compose(overrides, tmp_path))
    got = [r.getMessage() for r in caplog.records if r.name == "cope.run.config_check"]
    assert len(got) == 1 and warning in got[0], got


def _options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF / group).glob("*.yaml"))


SHIPPED = (
    [["debug=fast", f"algo={o}"] for o in _options("algo")]
    + [["debug=fast", f"env={o}"] for o in _options("env")]
    + [["debug=fast", f"trainer={o}"] for o in _options("trainer")]
    + [["debug=fast", f"logger={o}"] for o in _options("logger")]
    + [["debug=fast", "algo=cope_continuation", *o] for o in (
        ["cope.normalize=adaptive"], ["cope.normalize=per_step"], ["cope.K=1"], ["cope.packing=plain"], ["cope.anchors=sample"],
        ["cope.gate=all", "cope.invalid=keep"], ["cope.invalid=cut"], ["data.share_prefix=true"])]
    + [["debug=fast", "algo=cope", *o] for o in (["cope.update=joint"], ["cope.update=joint", "cope.packing=plain"],
                                                  ["cope.layout=turns"], ["cope.gate=mixed"], ["cope.invalid=cut"],
                                                  ["cope.schedule=power", "cope.schedule_steps=10"], ["cope.lr_scale=3"],
                                                  ["data.share_prefix=true"], ["cope.update=joint", "data.share_prefix=true"])]
    + [["debug=fast", "data.share_prefix=true"], ["debug=fast", "+collector=branching"]]
    + [[]]  # `python train.py` as shipped
    + [[f"model={o}"] for o in _options("model")]
    # presets are for pretrained models; the tiny model's 2048 positions are too few for their contexts
    + [[f"experiment={o}", "model=qwen2.5-7b"] for o in _options("experiment")]
)


@pytest.mark.long
@pytest.mark.parametrize("overrides", SHIPPED, ids=lambda o: " ".join(o) or "defaults")
def test_shipped_configs_validate(tmp_path, caplog, monkeypatch, overrides):
    from cope.run import config_rules
    from cope.run.config_check import check_config

    monkeypatch.setattr(config_rules, "_cuda_available", lambda: True)  # trainer=gpu is refused on a machine without one

    with caplog.at_level(logging.WARNING, logger="cope.run.config_check"):
        check_config(_compose_plain(overrides, tmp_path))
    assert not [r for r in caplog.records if r.name == "cope.run.config_check"], caplog.text


# the presets that leave the model to the user (the others name theirs: the authors' setting is Qwen2.5-7B)
FOR_ANY_MODEL = [o for o in _options("experiment") if "override /model" not in (CONF / "experiment" / f"{o}.yaml").read_text()]


@pytest.mark.parametrize("name", FOR_ANY_MODEL)
def test_preset_on_tiny_model_is_refused(tmp_path, name):
    from cope.run.config_check import ConfigError, check_config

    with pytest.raises(ConfigError, match=r"data.max_context = \d+: exceeds the model's 2048 positions"):
        check_config(_compose_plain([f"experiment={name}"], tmp_path))


def test_context_too_small_for_an_action_names_the_sampling_key():
    """The rollout's refusal names the key a user sets, ``data.sampling.max_action_tokens`` (it once said
    ``data.max_action_tokens``, which does not exist: setting it is refused as "not in struct")."""
    from tiny_fixtures import Scripted, maze_factory, maze_tasks, tiny_chat, tiny_tokenizer

    from cope.rollout.loop import run_episodes

    with pytest.raises(ValueError) as err:
        run_episodes([maze_factory()], maze_tasks(1), [0], Scripted({0: [[1]]}), tiny_tokenizer(), tiny_chat(),
                     max_context=64, max_action_tokens=32)
    msg = str(err.value)
    assert "data.max_context=64" in msg and "data.sampling.max_action_tokens=32" in msg, msg


def _refused_naming(cfg, *needles: str) -> None:
    """``cfg`` fails the config check with exactly one problem, whose message holds every one of ``needles``."""
    from cope.run.config_check import ConfigError, check_config

    with pytest.raises(ConfigError) as err:
        check_config(cfg)
    msg = str(err.value)
    assert len(err.value.problems) == 1 and all(n in msg for n in needles), msg


@pytest.mark.parametrize("attn", ["flash_attention_2", "flash_attention_3"])
def test_flash_attention_refuses_the_packed_forecast_layout(compose, tmp_path, attn):
    """CoPE's packed rows attend through a (N, 1, T, T) mask per forward (or tree attention, which is SDPA); flash
    attention takes no 4D mask (transformers drops or rejects it deep in the first forward, after rollouts). Refused
    at config time, with the fix."""
    from cope.run.config_check import ConfigError, check_config

    _refused_naming(compose(["algo=cope_continuation", f"model.attn_implementation={attn}"], tmp_path),
                    f"model.attn_implementation = '{attn}'", "algo.callbacks.forecast_targets.packing=packed",
                    "cope.packing=plain", "model.attn_implementation=sdpa")
    check_config(compose(["algo=cope_continuation", f"model.attn_implementation={attn}", "cope.packing=plain"], tmp_path))
    with pytest.raises(ConfigError, match=r"algo\.callbacks\.forecasts\.packing=packed \(update=joint\).*cope\.update=separate"):
        check_config(compose(["algo=cope", "cope.update=joint", f"model.attn_implementation={attn}"], tmp_path))
    check_config(compose(["algo=cope", f"model.attn_implementation={attn}"], tmp_path))  # separate steps: plain rows
    check_config(compose([f"model.attn_implementation={attn}"], tmp_path))  # GRPO: no forecast segments


@pytest.mark.parametrize("algo", [[], ["algo=cope"], ["algo=cope", "cope.update=joint"], ["algo=cope_continuation"]])
def test_shared_prefix_refuses_another_attention(compose, tmp_path, algo):
    """``data.share_prefix=true`` (GRPO groups, CoPE's separate steps and packed rows) runs tree attention, SDPA without
    a tree: a model configured with another implementation is refused before any work, naming the key and both
    fixes; without sharing the implementation stays the user's."""
    from cope.run.config_check import check_config

    _refused_naming(compose([*algo, "data.share_prefix=true", "model.attn_implementation=eager"], tmp_path),
                    "model.attn_implementation = 'eager'", "data.share_prefix=false", "model.attn_implementation=sdpa")
    check_config(compose([*algo, "data.share_prefix=false", "model.attn_implementation=eager"], tmp_path))
    check_config(compose([*algo, "data.share_prefix=true"], tmp_path))  # sdpa, as every model preset ships


def test_gpu_trainer_without_a_gpu_names_the_fix(run_train, tmp_path, monkeypatch):
    """``trainer=gpu`` on a machine without CUDA: refused before the model build naming the key and ``trainer=cpu``
    (Lightning would say only "No supported gpu backend found!", after the config check)."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    msg = _fails_fast(lambda: run_train(["trainer=gpu"], tmp_path), tmp_path, monkeypatch)
    assert "trainer.accelerator = 'gpu'" in msg and "trainer=cpu" in msg and "trainer.accelerator=cpu" in msg, msg
    assert "No supported gpu backend" not in msg, msg
    from cope.run import config_rules
    from cope.run.config_check import check_config

    monkeypatch.setattr(config_rules, "_cuda_available", lambda: True)  # with a GPU the same config passes the check
    check_config(_compose_plain(["trainer=gpu", "debug=fast"], tmp_path))


@pytest.mark.parametrize("overrides, needles", [
    # the probes follow cope.layout: the error names the key the user set, not callbacks.probes.layout
    (["algo=cope", "cope.layout=bogus"], ["cope.layout (read as callbacks.probes.layout) must be one of ('list', 'turns')",
                                          "got 'bogus'"]),
    (["callbacks.probes.layout=bogus"], ["callbacks.probes.layout must be one of ('list', 'turns')"]),  # set directly
    # a wrong type is named once, by its source, for every block that reads it
    (["algo=cope", "cope.mask_projected=maybe"], ["cope.mask_projected = 'maybe': expected bool (read as "]),
])
def test_error_names_the_key_the_user_set(run_train, tmp_path, monkeypatch, overrides, needles):
    msg = _fails_fast(lambda: run_train(overrides, tmp_path), tmp_path, monkeypatch)
    assert all(n in msg for n in needles), msg
    if overrides[0] == "algo=cope":  # never the key the user did not set
        assert "callbacks.probes.layout must" not in msg and "callbacks.probes.mask_projected =" not in msg, msg


def test_name_sources_follows_only_interpolations_the_user_can_set(compose, tmp_path):
    from cope.run.config_keys import name_sources

    text = "callbacks.probes.layout must be one of ('list', 'turns'), callbacks.probes.layout_x is fine"
    cfg = compose(["algo=cope", "cope.layout=turns"], tmp_path)
    assert name_sources(text, cfg.callbacks.probes, "callbacks.probes") == text.replace(
        "callbacks.probes.layout must", "cope.layout (read as callbacks.probes.layout) must")
    # without a `cope` group the probes' layout is oc.select's default: no key of the user's to name
    assert name_sources(text, compose([], tmp_path).callbacks.probes, "callbacks.probes") == text


@pytest.mark.parametrize("overrides", [["data.max_context=16"], ["data.max_context=40", "data.sampling.max_action_tokens=32"]])
def test_context_too_small_for_the_rules_fails_before_the_model_build(run_train, tmp_path, monkeypatch, overrides):
    """The rollout's own check needs the tokenizer (built with the tiny model): a context that cannot hold even the
    env's rules (at least a token per word) and one action is refused before, naming the key and the fix."""
    msg = _fails_fast(lambda: run_train(overrides, tmp_path), tmp_path, monkeypatch)
    ctx = overrides[0].split("=")[1]
    assert f"data.max_context = {ctx}: too small for the first prompt" in msg and "raise data.max_context" in msg, msg
    assert "data.sampling.max_action_tokens=" in msg, msg


def test_context_floor_counts_the_instructions_that_replace_the_rules(compose, tmp_path):
    from cope.envs.maze import MazeEnv
    from cope.run.config_check import ConfigError
    from cope.run.context_limits import check_context_floor

    cfg = compose(["data.max_context=30"], tmp_path)
    check_context_floor(MazeEnv, cfg.data)  # the maze's rules (21 words) and an action of 8 tokens + 1 fit in 30
    cfg.data.max_context = 29
    with pytest.raises(ConfigError, match="at least 21 tokens"):
        check_context_floor(MazeEnv, cfg.data)
    cfg.data.max_context, cfg.data.instructions = 64, " ".join(["word"] * 60)
    with pytest.raises(ConfigError, match="at least 60 tokens"):
        check_context_floor(MazeEnv, cfg.data)
