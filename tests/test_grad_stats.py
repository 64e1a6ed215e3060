"""Per-objective gradient diagnostics (`cope.train.step.grad_stats`, the `GradientStats` callback) and CoPE's
`normalize=gradnorm`, fed by CoPE's `LossBalance` callback with the same measurement.

The pure functions are checked on hand-made linear objectives with known gradients; the callbacks inside
small real Lightning fits of the LightningModule (a random two-layer Qwen2 with LoRA, a fixed CoPE
minibatch): GradientStats logs, leaves the training result bit-identical (no .grad, RNG or mode change, even
with LoRA dropout on), feeds no scale and uses the first micro-batch; LossBalance holds the forecast term's
gradient at the target ratio from the step after a measurement on, in either callback order. Through the
entry point: gradnorm needs no diagnostics, and turning them on or off leaves the trained adapter as it was."""

from __future__ import annotations

import functools
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from lightning.pytorch import Callback
from lightning.pytorch.loggers import Logger

sys.path.insert(0, str(Path(__file__).parent / "forecasting"))
from forecast_fixtures import CFG, CHAT, PAD, make_episode  # noqa: E402

from cope.algos.cope.chunks import build_chunks  # noqa: E402
from cope.algos.cope.loss import ForecastLoss  # noqa: E402
from cope.algos.cope.loss_balance import LossBalance  # noqa: E402
from cope.algos.cope.packing import pack_forecasts  # noqa: E402
from cope.algos.grpo import PolicyGradient  # noqa: E402
from cope.batch import collate  # noqa: E402
from cope.callbacks.grad_stats import GradientStats  # noqa: E402
from cope.models.policy import Policy  # noqa: E402
from cope.train.module import AgentRLModule  # noqa: E402
from cope.train.objectives import ForwardOut, Objective  # noqa: E402
from cope.train.step.grad_stats import ObjectiveGradient, gradient_metrics, objective_gradients  # noqa: E402


# -- the pure functions -------------------------------------------------------------------------------
class Linear(Objective):
    """loss = <c, logprobs>: its gradient with respect to the log-probs is c."""

    def __init__(self, name: str, c, weight: float = 1.0):
        super().__init__(weight=weight)
        self.name, self.c, self.calls = name, torch.tensor([c], dtype=torch.float32), 0

    def __call__(self, out, batch):
        self.calls += 1
        return (out.logprobs * self.c).sum(), {}


def _linear_setup():
    w1, w2, unused = (torch.nn.Parameter(torch.zeros(n)) for n in (2, 1, 3))
    lp = torch.cat([w1, w2]).view(1, 3) * 1.0  # (1, 3): d loss / d (w1, w2) = c
    return [w1, w2, unused], ForwardOut(lp, torch.zeros(1, 3))


def test_gradients_norms_cosine_and_ratio_are_exact():
    params, out = _linear_setup()
    pg, aux, off = Linear("pg", [3.0, 4.0, 0.0]), Linear("aux", [0.0, 4.0, 3.0], weight=0.5), Linear("off", [1.0, 1.0, 1.0], weight=0.0)
    grads = objective_gradients([pg, aux, off], out, {}, step=0, params=params)
    assert list(grads) == ["pg", "aux"] and off.calls == 0  # weight 0: off, not even computed
    torch.testing.assert_close(grads["aux"].grad, torch.tensor([0.0, 4.0, 3.0, 0.0, 0.0, 0.0]))  # unused param: zeros
    assert grads["aux"].weight == 0.5 and all(p.grad is None for p in params)  # nothing accumulated
    metrics, raw = gradient_metrics(grads, reference="pg")
    expect = {
        "grad/pg_norm": 5.0,
        "grad/aux_norm": 2.5,  # 0.5 x 5: the contribution
        "grad/cos_aux_pg": 16.0 / 25.0,
        "grad/ratio_aux_pg": 0.5,
        "grad/total_norm": (3.0**2 + 6.0**2 + 1.5**2) ** 0.5,  # |c_pg + 0.5 c_aux|
    }
    assert metrics.keys() == expect.keys()
    for k, v in expect.items():
        assert metrics[k].item() == pytest.approx(v, rel=1e-6), k
    assert {k: v.item() for k, v in raw.items()} == pytest.approx({"pg": 5.0, "aux": 5.0})  # unweighted


def test_undefined_cosine_and_ratio_are_zero_and_a_missing_reference_gives_norms_only():
    grads = {"pg": ObjectiveGradient(1.0, torch.zeros(3)), "aux": ObjectiveGradient(1.0, torch.tensor([1.0, 0.0, 0.0]))}
    metrics, _ = gradient_metrics(grads, reference="pg")
    assert metrics["grad/cos_aux_pg"].item() == 0.0 and metrics["grad/ratio_aux_pg"].item() == 0.0
    assert metrics["grad/aux_norm"].item() == 1.0 and metrics["grad/total_norm"].item() == 1.0
    metrics, _ = gradient_metrics({"aux": grads["aux"]}, reference="pg")  # pg off at this step
    assert set(metrics) == {"grad/aux_norm", "grad/total_norm"}


# -- the callback in real Lightning fits --------------------------------------------------------------
def _policy(dropout: float = 0.0) -> Policy:
    from peft import LoraConfig, get_peft_model
    from transformers import Qwen2ForCausalLM

    torch.manual_seed(0)
    base = Qwen2ForCausalLM(CFG)
    for p in base.parameters():
        p.requires_grad_(False)
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", lora_dropout=dropout))
    with torch.no_grad():  # lora_B starts at 0: move it so both LoRA factors get gradients
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.add_(torch.randn_like(p) * 0.1)
    return Policy(model=model, tokenizer=None, chat=CHAT, source="test")


def _minibatch() -> dict:
    """Five episodes (three successful: forecast targets), packed CoPE layout, K=2."""
    eps = [make_episode(CHAT, n, ok, seed) for n, ok, seed in [(3, True, 1), (1, False, 2), (4, True, 3), (2, False, 4), (3, True, 5)]]
    for e, a in zip(eps, [1.0, -0.5, 0.8, -1.2, 0.3]):
        e.advantage = a
    chunks, _ = build_chunks(eps, CHAT, K=2)
    return pack_forecasts(collate(eps, PAD), eps, chunks, PAD)


class Watch(Callback):
    """Records what the step sees at ``on_train_batch_start``: .grad of the adapter, RNG state, train/eval modes."""

    def __init__(self):
        self.seen: list[tuple] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        grads = [None if p.grad is None else p.grad.clone() for p in pl_module.policy.trainable_parameters()]
        self.seen.append((grads, torch.get_rng_state(), pl_module.training, pl_module.model.training))


class Capture(Logger):
    """Every ``log_metrics`` call a logger gets: (step, metrics)."""

    def __init__(self):
        super().__init__()
        self.rows: list[tuple[int | None, dict]] = []

    name, version = "capture", 0

    def log_metrics(self, metrics, step=None):
        self.rows.append((step, {k: float(v) for k, v in metrics.items()}))

    def log_hyperparams(self, *args, **kwargs):
        pass


def _fit(objectives, callbacks, steps: int = 2, budget: int | None = None, dropout: float = 0.0, lr: float = 0.5,
         loggers: tuple = ()):
    """``steps`` optimizer steps (SGD) on the same scored minibatch.

    Returns (adapter weights, module, the logged dicts with grad/* keys, the CPU RNG state after the fit)."""
    import lightning.pytorch as pl

    policy = _policy(dropout)
    module = AgentRLModule(policy, objectives, optimizer=functools.partial(torch.optim.SGD, lr=lr), max_tokens_per_microbatch=budget)
    mb = _minibatch()
    module.score_minibatches([mb])
    capture = Capture()
    trainer = pl.Trainer(
        max_epochs=1,
        accelerator="cpu",
        devices=1,
        logger=[capture, *loggers],
        log_every_n_steps=1,
        callbacks=callbacks,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    torch.manual_seed(123)
    trainer.fit(module, train_dataloaders=torch.utils.data.DataLoader([mb] * steps, batch_size=None))
    adapter = {n: p.detach().clone() for n, p in policy.model.named_parameters() if p.requires_grad}
    return adapter, module, [d for _, d in capture.rows if any(k.startswith("grad/") for k in d)], torch.get_rng_state()


def _cope(normalize: str = "none", **kw):
    # token-mean: the step sizes below (SGD lr, the EMA test's "small steps") were sized for its gradient scale
    return [PolicyGradient(agg="token-mean"), ForecastLoss(weight=0.3, normalize=normalize, **kw)]


@pytest.mark.parametrize("budget", [None, 40], ids=["whole", "micro"])
def test_callback_logs_and_leaves_the_training_result_identical(budget):
    # gradnorm with no LossBalance: its scale stays 1 (the loss is normalize=none's) unless GradientStats fed it
    off, _, logged_off, rng_off = _fit(_cope("gradnorm"), [], budget=budget, dropout=0.1)  # LoRA dropout: the step draws RNG
    watch_a, watch_b = Watch(), Watch()
    # Watch before and after GradientStats in the list: what the callback changes between them
    on, module, logged, rng_on = _fit(_cope("gradnorm"), [watch_a, GradientStats(every_n_steps=1), watch_b], budget=budget,
                                      dropout=0.1)
    assert logged_off == [] and len(logged) == 2  # one measurement per step
    for key in ("grad/pg_norm", "grad/forecast_norm", "grad/cos_forecast_pg", "grad/ratio_forecast_pg", "grad/total_norm"):
        assert all(key in d for d in logged), (key, logged[0])
    assert logged[0]["grad/forecast_norm"] > 0 and logged[0]["grad/pg_norm"] > 0 and -1 <= logged[0]["grad/cos_forecast_pg"] <= 1
    assert logged[0]["grad/ratio_forecast_pg"] == pytest.approx(logged[0]["grad/forecast_norm"] / logged[0]["grad/pg_norm"], rel=1e-5)
    for n, w in off.items():  # same steps: no .grad leak, no RNG draw, no mode change
        assert torch.equal(on[n], w), n
    assert torch.equal(rng_on, rng_off)
    assert len(watch_a.seen) == len(watch_b.seen) == 2
    for (g0, rng0, *mode0), (g1, rng1, *mode1) in zip(watch_a.seen, watch_b.seen):
        assert torch.equal(rng0, rng1) and mode0 == mode1 and mode0[0]
        assert all((a is None and b is None) or torch.equal(a, b) for a, b in zip(g0, g1))
    assert module.objectives[1].scale == 1.0 and module.objectives[1].adaptive.ema_pg is None  # it measures, feeds nothing


def test_sampled_steps_are_logged_on_those_steps_only(tmp_path):
    """every_n_steps=2 over 4 steps in one epoch: grad/* on steps 0 and 2 in metrics.csv, no value on 1 and 3
    (logged through Lightning's self.log, the step-0 value came back on step 1 and step 2's on step 3)."""
    import csv

    from lightning.pytorch.loggers import CSVLogger

    _, _, logged, _ = _fit(_cope(), [GradientStats(every_n_steps=2)], steps=4, lr=0.05,
                           loggers=(CSVLogger(tmp_path, name="", version=""),))
    assert len(logged) == 2
    with (tmp_path / "metrics.csv").open() as f:
        rows = list(csv.DictReader(f))
    got = sorted({int(r["step"]) for r in rows if r.get("grad/cos_forecast_pg")})
    assert got == [0, 2], [(r["step"], r.get("grad/cos_forecast_pg")) for r in rows]


def test_micro_batches_measure_the_first_micro_batch():
    budget = 40
    _, module, logged, _ = _fit(_cope(), [GradientStats(every_n_steps=1)], steps=1, budget=budget, lr=0.0)
    _, _, whole, _ = _fit(_cope(), [GradientStats(every_n_steps=1)], steps=1, lr=0.0)
    mb = {k: v for k, v in _minibatch().items()}
    module.score_minibatches([mb])
    parts = module.micro_batches(mb)
    assert len(parts) > 1
    rows, n = parts[0]
    lp = mb["old_logprobs"].clone()  # (N, T): live on the first micro-batch's rows only
    lp[rows, :n] = module.logprobs(mb, rows, n).logprobs
    out = ForwardOut(lp, torch.zeros_like(lp))
    params = module.policy.trainable_parameters()
    for obj in module.objectives:  # lr 0: the parameters the callback saw
        loss, _ = obj(out, mb)
        norm = torch.cat([g.reshape(-1) for g in torch.autograd.grad(loss, params, retain_graph=True)]).norm()
        assert logged[0][f"grad/{obj.name}_norm"] == pytest.approx(obj.weight * norm.item(), rel=1e-4), obj.name
        assert logged[0][f"grad/{obj.name}_norm"] != pytest.approx(whole[0][f"grad/{obj.name}_norm"], rel=1e-3)  # a share only


def test_off_does_no_work():
    cb = GradientStats()
    assert not hasattr(cb, "measures_gradients")  # nothing depends on it being on
    cb.on_train_batch_start(None, None, {}, 0)  # no trainer or module is touched
    with pytest.raises(ValueError, match="callbacks.grad_stats.every_n_steps"):
        GradientStats(every_n_steps=-1)
    with pytest.raises(ValueError, match="callbacks.grad_stats.reference"):
        GradientStats(every_n_steps=1, reference="kl").setup(None, SimpleNamespace(objectives=_cope()), "fit")


# -- normalize=gradnorm ---------------------------------------------------------------------------------
def test_gradnorm_scale_follows_the_fed_gradient_norms():
    fc = ForecastLoss(normalize="gradnorm", adaptive_ratio=0.5, adaptive_beta=0.5)
    assert fc.normalize == "none" and fc.balance == "gradient" and fc.scale == 1.0  # 1 before a measurement
    fc.observe(2.0, 8.0)  # loss magnitudes (LossBalance's feed): ignored
    assert fc.scale == 1.0
    fc.observe_gradients(2.0, 8.0)
    assert fc.scale == pytest.approx(0.5 * 2.0 / 8.0)
    fc.observe_gradients(4.0, 0.0)  # no forecast gradient (no targets): the raw norm is skipped
    assert fc.adaptive.ema_forecast == 8.0 and fc.scale == pytest.approx(0.5 * 3.0 / 8.0)
    fc.observe_gradients(0.0, 8.0)  # no policy gradient (equal rewards in every group): no measurement at all
    assert fc.adaptive.ema_pg == 3.0 and fc.scale == pytest.approx(0.5 * 3.0 / 8.0)
    fc.observe_gradients(1e12, 1e-6)
    assert fc.scale == 1e3  # clamped
    restored = ForecastLoss(normalize="gradnorm", adaptive_ratio=0.5, adaptive_beta=0.5)
    restored.load_state_dict(fc.state_dict())
    assert set(fc.state_dict()) == {"gradnorm"} and restored.scale == fc.scale and restored.state_dict() == fc.state_dict()
    other = ForecastLoss(normalize="adaptive", adaptive_ratio=0.5)  # other magnitudes: does not take gradnorm's EMAs
    other.load_state_dict(fc.state_dict())
    assert other.scale == 1.0
    other.observe_gradients(2.0, 8.0)
    assert other.scale == 1.0
    with pytest.raises(ValueError, match="gradnorm"):
        ForecastLoss(normalize="gradnrom")


def test_loss_balance_measures_gradnorm_before_the_step_and_feeds_it_at_its_end(monkeypatch):
    """Measured on steps 0, 2 (every 2nd), fed at the step's end: the scale of a step is fixed before it starts."""
    import cope.algos.cope.loss_balance as loss_balance

    with pytest.raises(ValueError, match=r"algo\.callbacks\.loss_balance\.gradnorm_every_n_steps"):
        LossBalance(gradnorm_every_n_steps=0)
    fc = ForecastLoss(weight=0.3, normalize="gradnorm", adaptive_ratio=0.5, adaptive_beta=0.0)
    module = SimpleNamespace(objectives=[PolicyGradient(weight=0.5), fc], log=lambda *a, **k: pytest.fail("LossBalance logged"))
    measured = []

    def measure(trainer, pl_module, batch, objectives):  # the forecast loss is raw x scale: so is its gradient
        measured.append((trainer.global_step, [o.name for o in objectives]))
        fc_grad = torch.tensor([0.0, 8.0]) * fc.scale
        return {"pg": ObjectiveGradient(0.5, torch.tensor([3.0, 4.0])), "forecast": ObjectiveGradient(0.3, fc_grad)}

    monkeypatch.setattr(loss_balance, "measure_gradients", measure)
    trainer = SimpleNamespace(global_step=0, world_size=1)
    cb = LossBalance(gradnorm_every_n_steps=2)
    cb.setup(trainer, module, "fit")
    scales = []
    for step in range(4):
        trainer.global_step = step
        cb.on_train_batch_start(trainer, module, {}, step)
        scales.append(fc.scale)  # what the step's loss carries
        cb.on_train_batch_end(trainer, module, {"loss/pg": 2.0, "forecast/raw": 1.0}, {}, step)  # loss values: not gradnorm's
    assert measured == [(0, ["pg", "forecast"]), (2, ["pg", "forecast"])]
    # |0.5 x (3, 4)| = 2.5 against the raw |(0, 8)| = 8 (the scaled gradient over the scale), from the next step on
    assert scales[0] == 1.0 and scales[1:] == pytest.approx([0.5 * 2.5 / 8.0] * 3)
    ranks = SimpleNamespace(global_step=0, world_size=2, strategy=SimpleNamespace(
        reduce=lambda v, reduce_op: measured.append(reduce_op) or torch.tensor([4.0, 4.0])))  # the ranks' mean of both norms
    cb.on_train_batch_start(ranks, module, {}, 0)
    cb.on_train_batch_end(ranks, module, {}, {}, 0)
    assert measured[-1] == "mean" and fc.scale == pytest.approx(0.5 * 4.0 / 4.0)
    off = SimpleNamespace(objectives=[PolicyGradient(), ForecastLoss(weight=0.0, normalize="gradnorm")])
    cb.setup(trainer, off, "fit")
    cb.on_train_batch_start(trainer, off, {}, 0)  # the forecast term is off: nothing to measure
    assert len(measured) == 4
    with pytest.raises(ValueError, match=r"algo\.callbacks\.loss_balance\.reference 'kl'"):
        LossBalance(reference="kl").setup(trainer, module, "fit")


@pytest.mark.parametrize("beta, lr, rel", [(0.9, 0.01, 0.2), (0.0, 0.0, 1e-5)], ids=["ema", "last-measurement"])
def test_gradnorm_holds_the_forecast_gradient_at_the_ratio(beta, lr, rel):
    """Constant minibatch, SGD steps, LossBalance measuring before every step: from the second step on (a measurement
    moves the scale from the next step), the forecast contribution follows weight x ratio x |grad pg| as GradientStats
    measures it (exact with beta 0 and lr 0: the next step has the measured step's parameters), and, for small
    steps, as measured afresh at the final parameters."""
    weight, ratio = 0.3, 0.5
    _, module, logged, _ = _fit(_cope("gradnorm", adaptive_ratio=ratio, adaptive_beta=beta),
                                [GradientStats(every_n_steps=1), LossBalance()], steps=4, lr=lr)
    fc = module.objectives[1]
    assert len(logged) == 4 and fc.scale != 1.0
    assert logged[0]["grad/ratio_forecast_pg"] != pytest.approx(weight * ratio, rel=0.2)  # step 0: scale 1, nothing fed yet
    for d in logged[1:]:
        assert d["grad/ratio_forecast_pg"] == pytest.approx(weight * ratio, rel=rel), d
        assert d["grad/forecast_norm"] == pytest.approx(weight * ratio * d["grad/pg_norm"], rel=rel), d
    if beta > 0:
        mb = _minibatch()
        module.score_minibatches([mb])
        grads = objective_gradients(module.objectives, module(mb), mb, 4, module.policy.trainable_parameters())
        metrics, _ = gradient_metrics(grads)
        assert metrics["grad/ratio_forecast_pg"].item() == pytest.approx(weight * ratio, rel=rel)


def test_the_step_scale_does_not_depend_on_the_callback_order():
    """LossBalance feeds at a step's end, GradientStats only measures: either order logs the same gradients and
    scales and trains the same adapter (LoRA dropout on: the step draws RNG); LossBalance's measurement leaves
    the step as it was (no .grad, RNG or mode change between the Watches around it)."""

    def run(callbacks):
        scales = Capture()
        adapter, module, logged, rng = _fit(_cope("gradnorm"), callbacks, steps=3, lr=0.2, dropout=0.1, loggers=(scales,))
        return adapter, logged, rng, [d["forecast/scale"] for _, d in scales.rows if "forecast/scale" in d]

    watch_a, watch_b = Watch(), Watch()
    first, logged, rng, scales = run([watch_a, LossBalance(), watch_b, GradientStats(every_n_steps=1)])
    then, logged_then, rng_then, scales_then = run([GradientStats(every_n_steps=1), LossBalance()])
    assert len(scales) == 3 and scales[0] == 1.0 and len({*scales}) == 3  # moved after steps 0 and 1
    assert scales_then == scales and logged_then == logged and len(logged) == 3 and torch.equal(rng_then, rng)
    for n, w in first.items():
        assert torch.equal(then[n], w), n
    assert len(watch_a.seen) == len(watch_b.seen) == 3
    for (g0, rng0, *mode0), (g1, rng1, *mode1) in zip(watch_a.seen, watch_b.seen):
        assert torch.equal(rng0, rng1) and mode0 == mode1 and mode0[0]
        assert all((a is None and b is None) or torch.equal(a, b) for a, b in zip(g0, g1))


# -- through the entry point: debug=fast, CoPE gradnorm, diagnostics off or on ----------------------------
# A maze a 150-step warm start solves now and then (5x5, goal 1+ step away): a reward spread, so a policy
# gradient; every episode a forecast source. One optimizer step per epoch, two epochs: step 1 has step 0's scale.
GRADNORM_RUN = [
    "seed=1",  # a task stream whose step 0 has a reward spread (seed 2 has none)
    "algo=cope_continuation",
    "cope.normalize=gradnorm",
    "cope.gate=all",
    "cope.invalid=keep",
    "model.warm_start_steps=150",
    "env.sizes=[5]",
    "env.min_distance=1",
    "trainer.max_epochs=2",
    "validate_before_fit=false",
]


@pytest.fixture(scope="module")
def gradnorm_run(run_train, read_metrics, tmp_path_factory):
    """``gradnorm_run(n)``: (adapter tensors, metrics.csv columns) of the run with ``callbacks.grad_stats.every_n_steps=n``
    (each run once per module)."""
    from safetensors.torch import load_file

    runs = {}

    def get(every_n_steps: int):
        if every_n_steps not in runs:
            out = tmp_path_factory.mktemp(f"gradnorm_stats{every_n_steps}")
            run_train([*GRADNORM_RUN, f"callbacks.grad_stats.every_n_steps={every_n_steps}"], out)
            runs[every_n_steps] = (load_file(str(out / "csv" / "adapter" / "adapter_model.safetensors")),
                                   read_metrics(out / "csv" / "metrics.csv"))
        return runs[every_n_steps]

    return get


@pytest.mark.long
def test_gradnorm_needs_no_diagnostics(compose, gradnorm_run, tmp_path):
    """cope.normalize=gradnorm with callbacks.grad_stats off: the config check passes and the scale moves off 1
    (1 on step 0, before any measurement; step 0's measurement on step 1)."""
    from cope.run.config_check import check_config

    check_config(compose([*GRADNORM_RUN, "callbacks.grad_stats.every_n_steps=0"], tmp_path))
    _, cols = gradnorm_run(0)
    assert not any(k.startswith("grad/") for k in cols)
    assert cols["rollout/zero_signal_groups"][0] < 1.0, "no reward spread on step 0: no policy gradient to balance against"
    scale = cols["forecast/scale"]
    assert len(scale) == 2 and scale[0] == 1.0 and scale[1] != 1.0, scale


@pytest.mark.long
def test_diagnostics_on_or_off_train_the_same_adapter(gradnorm_run):
    """Same seed, grad_stats every_n_steps 0 vs 1: bit-identical adapters and logged values (all but grad/*,
    timings, and the step column, which the grad/* rows add to)."""
    adapter_off, off = gradnorm_run(0)
    adapter_on, on = gradnorm_run(1)
    assert adapter_on.keys() == adapter_off.keys()
    for k, w in adapter_off.items():
        assert torch.equal(adapter_on[k], w), k
    same = {k: v for k, v in on.items() if not k.startswith(("grad/", "perf/")) and k != "step"}
    assert same == {k: v for k, v in off.items() if not k.startswith("perf/") and k != "step"}
    assert len(same["forecast/scale"]) == 2 and same["forecast/scale"][1] != 1.0


@pytest.mark.long
def test_cope_gradnorm_run_logs_gradient_metrics(gradnorm_run):
    """Through the entry point with the diagnostics on: the gradient metrics on every step, and step 1's scale is
    the one step 0's measurement gives (the diagnostics take the same measurement: ratio x w_pg |grad L_pg| over
    the raw |grad L_forecast|, which is grad/forecast_norm / weight at scale 1)."""
    _, cols = gradnorm_run(1)
    for key in ("grad/pg_norm", "grad/forecast_norm", "grad/cos_forecast_pg", "grad/ratio_forecast_pg", "grad/total_norm"):
        assert len(cols.get(key, [])) == 2, (key, sorted(cols))
    pg, fc = cols["grad/pg_norm"][0], cols["grad/forecast_norm"][0]
    assert pg > 0 and fc > 0
    weight, ratio = 0.1, 0.5  # cope.weight, cope.adaptive_ratio (conf/algo/cope.yaml)
    assert cols["forecast/scale"] == pytest.approx([1.0, ratio * pg / (fc / weight)], rel=1e-4)
