"""The compatibility rules read capabilities, not names (:mod:`cope.run.config_rules`, :mod:`cope.capabilities`).

Engines and strategies defined here, subclasses of the project's own, are named by their ``_target_``
(``test_config_rules.<Class>``: the tests folder is on ``sys.path``); each must follow its parent's rules. Lightning's
own sharding strategies, named by registry string or ``_target_``, are refused before any work, naming the key and
``trainer=fsdp``.
"""
from __future__ import annotations

import re
import subprocess
import time
from pathlib import Path

import pytest

from cope.capabilities import can
from cope.rollout.engine import HFEngine
from cope.rollout.vllm.engine import VLLMEngine
from cope.run.config_check import check_config
from cope.run.config_keys import ConfigError
from cope.train.fsdp.strategy import FSDPStrategy

SRC = Path(__file__).resolve().parents[1] / "src"


class InProcess(HFEngine):
    """An in-process engine under another name: samples the trained weights in process, as its parent."""


class Server(VLLMEngine):
    """A server engine under another name: serves each version as a LoRA adapter, as its parent."""


class NoCompletions(HFEngine):
    """An in-process engine that declares it cannot complete token contexts."""

    completes = False


class Sharded(FSDPStrategy):
    """The project's sharding strategy under another name."""


def _problems(compose, tmp_path, overrides) -> list[str]:
    try:
        check_config(compose(overrides, tmp_path))
    except ConfigError as e:
        return e.problems
    return []


def _keys(problems: list[str]) -> list[str]:
    return [re.split(r"[ :]", p, maxsplit=1)[0] for p in problems]


def test_capabilities_are_read_from_the_class():
    from lightning.pytorch.strategies import DDPStrategy, DeepSpeedStrategy, ModelParallelStrategy
    from lightning.pytorch.strategies import FSDPStrategy as LightningFSDP

    assert can(HFEngine, "samples_in_process") and not can(HFEngine, "serves_adapters")
    assert can(VLLMEngine, "serves_adapters") and not can(VLLMEngine, "samples_in_process")
    assert can(InProcess, "samples_in_process") and can(Server, "serves_adapters")  # inherited
    assert can(FSDPStrategy, "shards_weights") and can(Sharded, "gathers_for_rollouts")
    for cls in (LightningFSDP, ModelParallelStrategy, DeepSpeedStrategy):  # not ours: from what they are
        assert can(cls, "shards_weights") and not can(cls, "gathers_for_rollouts"), cls
    assert not can(DDPStrategy, "shards_weights") and not can(None, "shards_weights")
    assert not can(lambda: None, "overlaps")  # a factory function declares nothing
    with pytest.raises(KeyError, match="shards_weight"):
        can(FSDPStrategy, "shards_weight")


def test_no_rule_matches_a_class_name():
    """The patterns the name-matching rules had (``"FSDP" in strategy``, ``endswith(".HFEngine")``, a ``_target_``
    compared with a name) appear nowhere in the package."""
    proc = subprocess.run(["grep", "-rnE", r'"FSDP" in|endswith\("\.(HF|VLLM)Engine|_target_"\) ==', str(SRC)],
                          capture_output=True, text=True)
    assert proc.stdout == "", proc.stdout


@pytest.mark.parametrize("overrides, key", [
    (["trainer.strategy=fsdp"], "trainer.strategy"),
    (["trainer.strategy=fsdp_cpu_offload"], "trainer.strategy"),
    (["trainer.strategy={_target_:lightning.pytorch.strategies.ModelParallelStrategy}"], "trainer.strategy"),
])
def test_lightning_sharding_strategies_are_refused_naming_trainer_fsdp(compose, tmp_path, overrides, key):
    problems = _problems(compose, tmp_path, ["trainer=ddp", *overrides])
    assert key in _keys(problems) and any("use trainer=fsdp" in p for p in problems), problems


def test_lightning_fsdp_with_lag_and_the_in_process_engine_is_refused(compose, tmp_path):
    """``trainer.strategy=fsdp`` (Lightning's FSDP, not the project's) with ``data.max_lag=1`` and ``rollout=hf``: a
    sampler copy of sharded weights; refused before any work, naming the key (the old rule matched it only because
    the string happened to contain "FSDP")."""
    problems = _problems(compose, tmp_path, ["trainer=ddp", "trainer.strategy=fsdp", "data.max_lag=1", "rollout=hf"])
    assert _keys(problems) == ["trainer.strategy", "trainer.strategy"], problems
    assert "sampler copy" in problems[1] and "trainer=fsdp" in problems[0], problems


def test_plain_strategies_pass(compose, tmp_path):
    for strategy in ("ddp", "auto", "ddp_spawn"):
        assert _problems(compose, tmp_path, ["trainer=ddp", f"trainer.strategy={strategy}", "data.max_lag=1"]) == []


@pytest.mark.parametrize("overrides, key", [
    (["model.finetune=full"], None),  # full fine-tuning samples in process: fits
    (["trainer=fsdp"], None),  # sharded weights roll out in process: fits
    (["model.finetune=full", "data.max_lag=1"], "model.finetune"),  # a sampler copy would be a whole model
    (["trainer=fsdp", "data.max_lag=1"], "trainer.strategy"),  # a sampler copy of sharded weights
])
def test_a_subclass_of_the_in_process_engine_follows_its_rules(compose, tmp_path, overrides, key):
    problems = _problems(compose, tmp_path, [*overrides, "data.engine._target_=test_config_rules.InProcess"])
    assert _keys(problems) == ([key] if key else []), problems


@pytest.mark.parametrize("overrides, key", [
    (["model.finetune=full"], "data.engine"),
    (["trainer=fsdp"], "data.engine"),
    (["data.max_lag=1"], "data.engine.max_loras"),
    (["data.max_lag=1", "data.engine.max_loras=2"], None),
])
def test_a_subclass_of_the_server_engine_follows_its_rules(compose, tmp_path, overrides, key):
    problems = _problems(compose, tmp_path, ["rollout=vllm", *overrides, "data.engine._target_=test_config_rules.Server"])
    assert _keys(problems) == ([key] if key else []), problems


@pytest.mark.parametrize("override, key", [
    ("model.quantization=4bit", "model.quantization"),
    ("rollout=vllm", "data.engine"),
    ("callbacks.adapter_export.merged=true", "callbacks.adapter_export.merged"),
    ("callbacks.grad_stats.every_n_steps=2", "callbacks.grad_stats.every_n_steps"),
    ("data.max_lag=1", "trainer.strategy"),
])
def test_a_subclass_of_the_sharding_strategy_follows_its_rules(compose, tmp_path, override, key):
    problems = _problems(compose, tmp_path, ["trainer=fsdp", override,
                                              "trainer.strategy._target_=test_config_rules.Sharded"])
    assert key in _keys(problems) and all("trainer=fsdp" in p for p in problems), problems
    assert _problems(compose, tmp_path, ["trainer=fsdp", "trainer.strategy._target_=test_config_rules.Sharded"]) == []


def test_callbacks_are_found_by_class_not_by_entry_name(compose, tmp_path):
    """The merged export under another entry name is refused under sharding all the same."""
    problems = _problems(compose, tmp_path, [
        "trainer=fsdp", "+callbacks.my_export._target_=cope.callbacks.adapter_export.AdapterExport",
        "+callbacks.my_export.merged=true"])
    assert _keys(problems) == ["callbacks.my_export.merged"], problems


@pytest.mark.long
def test_a_bad_model_setting_fails_before_the_model_is_built(train_script, tmp_path):
    """``python train.py model.quantization=3bit`` with an empty model cache: the typed check refuses the value (the
    builders' ``Literal`` annotations) in seconds, naming the key; nothing is built, cached or warm-started (it used to
    fail in the loader, after the tiny model's warm start, minutes in)."""
    cache = tmp_path / "cache"
    cache.mkdir()
    t0 = time.perf_counter()
    proc = train_script(["model.quantization=3bit", f"hydra.run.dir={tmp_path / 'run'}"], tmp_path, timeout=180,
                        env={"COPE_CACHE": str(cache)})
    wall = time.perf_counter() - t0
    report = f"exit {proc.returncode} after {wall:.1f}s\n{proc.stderr[-3000:]}"
    assert proc.returncode != 0 and "model.quantization = '3bit'" in proc.stderr, report
    assert wall < 45, report  # interpreter and imports on a loaded 1-thread CPU; the default warm start takes minutes
    assert list(cache.iterdir()) == [], report


@pytest.mark.parametrize("precision, refused", [("bf16-true", True), ("16-true", True), ("bf16-mixed", False),
                                                ("32-true", False)])
def test_full_finetuning_refuses_a_precision_that_casts_the_master_weights(compose, tmp_path, precision, refused):
    """``trainer.precision=bf16-true`` casts every weight to bf16, the fp32 master weights of full fine-tuning included:
    refused before any work, naming the key; the mixed precisions keep fp32 weights and pass. Under LoRA it is no
    concern of this rule."""
    problems = _problems(compose, tmp_path, ["model.finetune=full", f"trainer.precision={precision}"])
    assert ("trainer.precision" in _keys(problems)) is refused, problems
    assert "trainer.precision" not in _keys(_problems(compose, tmp_path, [f"trainer.precision={precision}"]))


def test_a_collector_that_needs_completions_refuses_an_engine_that_cannot(compose, tmp_path):
    """algo=rwml's collector samples world-model predictions with engine.complete: the rule reads the collector's
    needs_completions and the engine's `completes` capability (an in-process subclass declaring it cannot)."""
    assert can(HFEngine, "completes") and can(VLLMEngine, "completes") and not can(NoCompletions, "completes")
    problems = _problems(compose, tmp_path, ["algo=rwml", "data.engine._target_=test_config_rules.NoCompletions"])
    assert "data.engine" in _keys(problems), problems
    assert _problems(compose, tmp_path, ["algo=rwml", "data.engine._target_=test_config_rules.InProcess"]) == []


def test_demonstrations_from_an_expert_need_an_env_with_one(compose, tmp_path):
    """algo=sft sft.source=expert reads the env class's expert_action() (looked up, no env started): WebShop has none."""
    assert "data.collector.source" in _keys(_problems(compose, tmp_path, ["algo=sft", "env=webshop"]))
    assert _problems(compose, tmp_path, ["algo=sft"]) == []  # the maze has one


def test_native_tool_calls_need_a_model_whose_template_renders_tools(compose, tmp_path):
    """env.action_format=native with the tiny model (plain ChatML, tool_template=False) is refused before any work."""
    problems = _problems(compose, tmp_path, ["env=terminal", "env.action_format=native"])
    assert "env.action_format" in _keys(problems) and "has no tool support" in " ".join(problems), problems
    assert "env.action_format" not in _keys(_problems(compose, tmp_path, ["env=terminal"]))


def test_a_branching_collector_needs_an_env_that_forks_and_an_engine_that_samples(compose, tmp_path):
    """+collector=branching reads the env class's fork()/forks_by_replay (the terminal sandbox has neither; tau2
    replays only with its canned user: replay_problem names env.user), the engine's samples_in_process or lends_actor
    and, with env workers, forks_by_replay (a child is replayed in the workers), before any work."""
    assert _problems(compose, tmp_path, ["+collector=branching"]) == []  # the maze forks
    assert "env" in _keys(_problems(compose, tmp_path, ["+collector=branching", "env=terminal"]))
    assert _problems(compose, tmp_path, ["+collector=branching", "env=tau2"]) == []  # the canned user replays
    llm_user = _problems(compose, tmp_path, ["+collector=branching", "env=tau2", "env.user=openai"])
    assert _keys(llm_user) == ["env.user"] and "an LLM user" in " ".join(llm_user), llm_user
    workers = ["+collector=branching", "data.env_runtime.workers=2"]
    assert _problems(compose, tmp_path, workers) == []  # the maze replays
    assert "data.env_runtime.workers" in _keys(_problems(compose, tmp_path, [*workers,
                                                                             "env._target_=branch_envs.CopyOnlyMaze"]))
    assert "data.engine" not in _keys(_problems(compose, tmp_path, ["+collector=branching", "rollout=vllm"]))  # lends its actor
    assert "data.engine" in _keys(_problems(compose, tmp_path, ["+collector=branching", "rollout=vllm",
                                                                "data.engine._target_=branch_callbacks.ServerWithoutActor"]))
