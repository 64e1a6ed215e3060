"""``eval.py`` refuses a key nothing reads before any work, as ``train.py`` does (cope.run.config_keys): naming the key,
its group and the closest read key. Keys only training reads stay accepted (eval composes the training tree), and the
keys ``cope.run.evaluate`` reads itself are declared once, in its ``READS``, and match ``conf/eval.yaml``."""
from __future__ import annotations

import ast
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
CONF = REPO / "conf"


def _compose(overrides: list[str], tmp_path: Path, debug: bool = True):
    """The config as ``eval.py`` composes it (``eval.out`` set: ``${hydra:...}`` resolves only under ``@hydra.main``)."""
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(CONF), version_base="1.3", job_name="test"):
        return compose("eval", overrides=[*(["debug=fast"] if debug else []), f"paths.output_dir={tmp_path}",
                                          f"eval.out={tmp_path / 'eval'}", *overrides])


@pytest.mark.parametrize("overrides", [[], ["algo=cope"], ["algo=cope_continuation"], ["trainer.max_epochs=3"]],
                         ids=lambda o: " ".join(o) or "plain")
@pytest.mark.parametrize("debug", [True, False], ids=["debug=fast", "no debug"])
def test_the_eval_config_is_read_whole(tmp_path, overrides, debug):
    """The plain eval config (and with another algorithm, or a training-only key set) has no unread key: the keys
    only training reads (trainer.*, callbacks.*, module.optimizer) are accepted, eval's own are declared."""
    from cope.run.config_keys import unread_keys
    from cope.run.evaluate import accepted_reads

    cfg = _compose(overrides, tmp_path, debug)
    assert "trainer" in cfg and "optimizer" in cfg.module  # present, read only by training
    assert unread_keys(cfg, accepted_reads()) == []


def _refused_early(overrides: list[str], tmp_path: Path, monkeypatch) -> str:
    """``evaluate`` on ``overrides`` raises a ConfigError within seconds, before the policy factory runs (replaced by
    one that fails the test) and before anything is written. Returns the message."""
    import cope.models.tiny as tiny

    def no_build(*args, **kwargs):
        raise AssertionError("the model was built before the config error surfaced")

    monkeypatch.setattr(tiny, "tiny_policy", no_build)
    monkeypatch.setattr(tiny, "build_once", no_build)
    import lightning.pytorch  # noqa: F401  (import time is not what is measured)

    from cope.run.config_keys import ConfigError
    from cope.run.evaluate import evaluate

    cfg = _compose(overrides, tmp_path)
    t0 = time.perf_counter()
    with pytest.raises(ConfigError) as err:
        evaluate(cfg)
    assert time.perf_counter() - t0 < 10, "the error came late"
    assert not (tmp_path / "eval").exists(), "the evaluation started"
    return str(err.value)


@pytest.mark.parametrize("overrides, needles", [
    (["+eval.foo=1"], ["eval.foo = 1: read by nothing (in `eval`"]),
    (["+foo=1"], ["foo = 1: read by nothing (at the root"]),
    (["+eval.temprature=0.7"], ["eval.temprature = 0.7: read by nothing (in `eval`", "did you mean eval.temperature?"]),
    (["+eval.batchsize=8"], ["did you mean eval.batch_size?"]),
    (["+adaptor=/x"], ["adaptor = '/x': read by nothing (at the root", "did you mean adapter?"]),
    (["+trainer.max_epoch=1"], ["trainer.max_epoch: not an argument of"]),  # a training key is still checked
    (["algo=cope", "+cope.weigth=0.02"], ["did you mean cope.weight?"]),
    (["algo=cope", "+cope.coef=0.02"], ["cope.coef = 0.02: renamed; use cope.weight"]),
])
def test_unread_key_is_refused_before_the_model_build(tmp_path, monkeypatch, overrides, needles):
    msg = _refused_early(overrides, tmp_path, monkeypatch)
    assert all(n in msg for n in needles), msg


def test_evals_own_keys_are_declared_once_and_match_its_config():
    """READS names exactly the leaves of conf/eval.yaml's `eval` block and its root keys (no stale declaration), and
    every ``eval.*`` key the evaluation code reads (``e.<name>``, ``e.get("<name>")``) is among them."""
    from omegaconf import OmegaConf

    import cope.run.evaluate as evaluate

    yaml = OmegaConf.load(CONF / "eval.yaml")
    shipped = {f"eval.{k}" for k in yaml.eval} | {k for k in yaml if k not in ("defaults", "eval", "hydra")}
    assert set(evaluate.READS.keys) == shipped
    used = set()  # `e = cfg.eval` in the code: e.<name> and e.get("<name>")
    for node in ast.walk(ast.parse(Path(evaluate.__file__).read_text())):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "e":
            used.add(node.attr)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get" \
                and isinstance(node.func.value, ast.Name) and node.func.value.id == "e":
            used.add(node.args[0].value)
    used.discard("get")
    assert used and {f"eval.{k}" for k in used} <= shipped, used - {k[5:] for k in shipped}


@pytest.mark.long
def test_entry_point_refuses_an_unread_key(train_script, tmp_path):
    proc = train_script(["debug=fast", "+eval.temprature=0.7", f"hydra.run.dir={tmp_path / 'run'}"], tmp_path,
                        timeout=120, script=REPO / "eval.py")
    assert proc.returncode != 0 and "did you mean eval.temperature?" in proc.stderr, proc.stderr[-3000:]
    assert not (tmp_path / "run" / "eval").exists(), "the evaluation started"
