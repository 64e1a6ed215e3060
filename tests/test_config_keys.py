"""Every key of the composed config is read by something, or the run is refused before the model is built
(cope.run.config_keys): every shipped preset passes, and an orphan or misspelled key is refused in each kind of
group, naming the key and the closest key that is read; a renamed key names its replacement."""
from __future__ import annotations

import time
from pathlib import Path

import pytest

CONF = Path(__file__).resolve().parents[1] / "conf"


def _options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF / group).glob("*.yaml"))


def _compose(overrides: list[str], tmp_path):
    """The run config as ``train.py`` composes it (no ``debug`` unless asked)."""
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(CONF), version_base="1.3", job_name="test"):
        return compose(config_name="config", overrides=[f"paths.output_dir={tmp_path}", *overrides])


# every option of every group the defaults list selects (the auto-selected module_for_model and debug_model come
# with model= and debug=); experiments are presets for pretrained models
PRESETS = ([[]] + [[f"{g}={o}"] for g in ("algo", "env", "model", "trainer", "rollout", "logger", "debug") for o in _options(g)]
           + [[f"experiment={o}", "model=qwen2.5-7b"] for o in _options("experiment")]
           + [["experiment=smollm2_maze", "debug=fast"], ["model=smollm2-135m", "debug=fast"]]
           + [["debug=fast", f"algo={o}"] for o in _options("algo")]
           + [["+collector=branching"]])


@pytest.mark.parametrize("overrides", PRESETS, ids=lambda o: " ".join(o) or "defaults")
def test_every_leaf_of_every_preset_is_read(tmp_path, overrides):
    from cope.run.config_keys import TRAIN_READS as READS
    from cope.run.config_keys import unread_keys

    cfg = _compose(overrides, tmp_path)
    assert unread_keys(cfg, READS) == []
    # the walk can fail: the same preset with one key nothing reads
    (problem,) = unread_keys(_compose([*overrides, "+zz_unread=1"], tmp_path), READS)
    assert problem.startswith("zz_unread = 1: read by nothing"), problem


def _refused_early(run_train, overrides, tmp_path, monkeypatch) -> str:
    """``train`` on ``overrides`` (with ``debug=fast``) raises a ConfigError within seconds, before the model factory
    runs (it is replaced by one that fails the test). Returns the message."""
    import cope.models.tiny

    def no_build(*args, **kwargs):
        raise AssertionError("the model was built before the config error surfaced")

    monkeypatch.setattr(cope.models.tiny, "tiny_policy", no_build)
    import lightning.pytorch  # noqa: F401  (import time is not what is measured)

    from cope.run.config_check import ConfigError

    t0 = time.perf_counter()
    with pytest.raises(ConfigError) as err:
        run_train(overrides, tmp_path)
    assert time.perf_counter() - t0 < 10, "the error came late"
    return str(err.value)


@pytest.mark.parametrize("overrides, needles", [
    (["+foo=1"], ["foo = 1: read by nothing (at the root"]),
    (["++foo=1"], ["foo = 1: read by nothing (at the root"]),
    (["+anything.key=1"], ["anything.key = 1: read by nothing (in `anything`"]),
    (["+rollout.max_lag=1"], ["rollout.max_lag = 1: read by nothing (in `rollout`"]),  # a knob group no one reads
    (["+algo.advantage_mod=drgrpo"], ["algo.advantage_mod = 'drgrpo': read by nothing (in `algo`",
                                      "did you mean algo.advantage_mode?"]),
    (["+seeds=1"], ["seeds = 1: read by nothing (at the root", "did you mean seed?"]),
    (["algo=cope", "+cope.weigth=0.02"], ["cope.weigth = 0.02: read by nothing (in `cope`", "did you mean cope.weight?"]),
    (["algo=cope_continuation", "+cope.weigth=0.02"], ["did you mean cope.weight?"]),
    (["algo=cope", "++cope.te.wieght=1"], ["cope.te.wieght = 1: read by nothing (in `cope.te`",
                                           "did you mean cope.te.weight?"]),
    (["+module.foo=1"], ["module.foo: not an argument of cope.train.module.AgentRLModule"]),  # a component block
    (["++module.foo=1"], ["module.foo: not an argument of cope.train.module.AgentRLModule"]),
    (["+module.max_aprox_kl=0.1"], ["did you mean module.max_approx_kl?"]),
    (["+callbacks.extra=1"], ["callbacks.extra = 1: an entry of callbacks is a component block"]),
])
def test_orphan_key_is_refused_before_the_model_build(run_train, tmp_path, monkeypatch, overrides, needles):
    msg = _refused_early(run_train, overrides, tmp_path, monkeypatch)
    assert all(n in msg for n in needles), msg


def test_the_root_schema_keys_are_declared_read():
    """The typed root keys (RunKeys) are the keys cope.run.train declares it reads: the two cannot drift apart."""
    import dataclasses

    from cope.run.config_check import RunKeys
    from cope.run.config_keys import TRAIN_READS as READS

    assert {f.name for f in dataclasses.fields(RunKeys)} <= set(READS.keys)


def test_a_component_block_nothing_builds_is_refused(compose, tmp_path):
    """A whole block under an unread key (a callback put at the root) is refused once, by its key."""
    from cope.run.config_keys import TRAIN_READS as READS
    from cope.run.config_keys import unread_keys

    cfg = compose(["+probes._target_=cope.callbacks.probes.HeldOutProbes"], tmp_path)
    (problem,) = unread_keys(cfg, READS)
    assert problem.startswith("probes = {'_target_': 'cope.callbacks.probes.HeldOutProbes'}: read by nothing"), problem


@pytest.mark.parametrize("text, where, keys", [
    ("${cope.weight}", "x", {"cope.weight"}),
    ("${oc.select:cope.layout,list}", "x", {"cope.layout"}),
    ("${oc.env:HOME}/${paths.cache_dir}", "x", {"paths.cache_dir"}),
    ("${oc.select:a.b,${oc.select:c.d,1}}", "x", {"a.b", "c.d"}),
    ("${hydra:runtime.output_dir}", "x", set()),
    ("${.lr}", "module.optimizer", {"module.optimizer.lr"}),
    ("${..seed}", "module.optimizer", {"module.seed"}),
    ("plain text", "x", set()),
])
def test_interpolation_references(text, where, keys):
    from cope.run.config_keys import references

    assert references(text, where) == keys


# -- renamed and removed keys name their replacement --------------------------------------------------------------
def _renamed():
    from cope.run.config_keys import RENAMED

    return sorted(RENAMED.items())


@pytest.mark.parametrize("old, new", _renamed())
def test_renamed_key_on_the_command_line_names_its_replacement(old, new):
    """Before Hydra composes (it would refuse the old key as "not in struct", or suggest ``+``): with ``+``, ``++``
    and without, and not for the new key."""
    from cope.run.config_keys import check_overrides

    for arg in (f"{old}=1", f"+{old}=1", f"++{old}=1"):
        (problem,) = check_overrides(["debug=fast", arg, "trainer.max_epochs=1"])
        assert problem.startswith(f"{old} (on the command line: {arg}): renamed; use {new}"), problem
    assert check_overrides([f"{new.split(' ')[0]}=1", "algo=cope", "hydra.run.dir=x", "--multirun"]) == []


@pytest.mark.parametrize("old, new", _renamed())
def test_renamed_key_in_a_composed_config_names_its_replacement(old, new):
    """An old key that reaches the composed config (a user's own preset, an experiment file) and nothing reads."""
    from omegaconf import OmegaConf

    from cope.run.config_keys import Reads, unread_keys

    cfg = OmegaConf.create({})
    OmegaConf.update(cfg, old, 1, force_add=True)
    assert unread_keys(cfg, Reads()) == [f"{old} = 1: renamed; use {new}"]


@pytest.mark.parametrize("overrides, problem", [
    (["algo=cope", "+cope.coef=0.02"], "cope.coef = 0.02: renamed; use cope.weight"),  # a knob group
    (["algo=cope_continuation", "+cope.mask_invalid=false"], "cope.mask_invalid = False: renamed; use cope.invalid"),
    (["algo=cope", "++cope.share_prefix=false"], "cope.share_prefix = False: renamed; use data.share_prefix"),
    (["+data.packed_row_tokens=64"], "data.packed_row_tokens: renamed; use module.max_tokens_per_microbatch"),  # a block
    (["algo=cope_continuation", "+algo.callbacks.forecast_targets.layout=plain"],
     "algo.callbacks.forecast_targets.layout: renamed; use cope.packing"),
])
def test_renamed_key_is_refused_before_the_model_build(run_train, tmp_path, monkeypatch, overrides, problem):
    msg = _refused_early(run_train, overrides, tmp_path, monkeypatch)
    assert problem in msg, msg


@pytest.mark.long
def test_entry_point_refuses_a_renamed_key(train_script, tmp_path):
    proc = train_script(["debug=fast", "algo=cope", "cope.coef=0.02", f"hydra.run.dir={tmp_path / 'run'}"], tmp_path,
                        timeout=120)
    assert proc.returncode != 0 and "cope.coef (on the command line: cope.coef=0.02): renamed; use cope.weight" in proc.stderr, \
        proc.stderr[-3000:]
    assert not (tmp_path / "run").exists(), "the run started"
