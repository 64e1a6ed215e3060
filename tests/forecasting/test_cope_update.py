"""CoPE's update as its authors run it, through the module: the separate forecast step equals a hand-written AdamW
step on the hand-written loss; joint-packed equals joint-plain for the prompted samples at T = 1 and T = 0.7."""
from __future__ import annotations

import copy

import pytest
import torch
import transformers
from forecast_fixtures import CFG, capture_logger
from peft import LoraConfig, get_peft_model
from prompted_fixtures import CHAT, FakeTokenizer, reference_episode, simple_episode

from cope.algos.cope.loss import ForecastLoss
from cope.algos.cope.packing import collate_chunks, pack_forecasts, plain_forecasts
from cope.algos.cope.prompted import PlanPrompt, build_prompted
from cope.algos.grpo import PolicyGradient
from cope.batch import collate
from cope.models.policy import Policy
from cope.train.module import AgentRLModule
from cope.train.objectives import combine

PAD = 0


def _model():
    torch.manual_seed(0)
    cfg = copy.deepcopy(CFG)
    cfg.vocab_size = 128  # the prompted fixtures' ids go up to 99
    base = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa", dtype=torch.float32)
    return get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False))


def _episodes():
    # group 0: one win; group 1: two wins and a loss (weights 1 and 1/2 before renormalization)
    return [reference_episode(), simple_episode(3, 1.0, group=1), simple_episode(2, 1.0, group=1), simple_episode(2, 0.0, group=1)]


def _chunks(eps):
    chunks, m = build_prompted(eps, CHAT, PlanPrompt(FakeTokenizer()), K=3)
    assert chunks and m["forecast/samples"] == len(chunks) and len({c.weight for c in chunks}) > 1  # weights differ
    return chunks


def _reference_loss(model, eps, chunks):
    """mean over samples of w_i x (mean token CE of sample i), each sample scored on its own, no padding."""
    per = []
    for c in chunks:
        seq = torch.tensor([eps[c.episode].tokens[: c.anchor] + list(c.tokens)])  # (1, L)
        logp = model(input_ids=seq).logits[0, :-1].float().log_softmax(-1)  # (L-1, V)
        lp = logp.gather(-1, seq[0, 1:, None]).squeeze(-1)  # (L-1,): log p(token t | < t) at t - 1
        tgt = torch.tensor([False] * c.anchor + list(c.target))[1:]  # (L-1,)
        per.append(-lp[tgt].mean() * c.weight)
    return torch.stack(per).mean()


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_joint_packed_equals_plain_for_prompted_samples(temperature):
    model, eps = _model(), _episodes()
    chunks = _chunks(eps)
    module = AgentRLModule(Policy(model=model, tokenizer=None, chat=CHAT, source="t"), [ForecastLoss(weight=1.0)],
                           optimizer=torch.optim.SGD, temperature=temperature)
    base = collate(eps, PAD)
    params = [p for p in model.parameters() if p.requires_grad]
    got = []
    for layout in (pack_forecasts, plain_forecasts):
        batch = layout(base, eps, chunks, PAD)
        loss, _ = module.objectives[0](module(batch), batch)
        got.append((loss, torch.autograd.grad(loss, params)))
    ref = _reference_loss(model, eps, chunks)
    ref_grads = torch.autograd.grad(ref, params)
    for loss, grads in got:
        assert loss.item() == pytest.approx(ref.item(), abs=1e-5)
        for a, b in zip(grads, ref_grads):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=0)


def test_separate_step_is_an_sgd_step_on_the_weighted_loss():
    """One forecast batch through training_step's math (forward, backward, clip, the optimizer at lr x lr_scale)
    equals SGD applied by hand to coef x the hand-written loss: the same gradients, the same step. (SGD, not
    AdamW, for the comparison: Adam's first step is lr x g / |g|, which turns float rounding of a tiny gradient
    into a visible difference.)"""
    eps = _episodes()
    chunks = _chunks(eps)
    coef, lr, scale, clip = 0.01, 1e-2, 3.0, 1.0
    batch = collate_chunks(eps, chunks, PAD)
    assert batch["kind"] == "forecast" and not batch["action_mask"].any()

    model_a = _model()
    module = AgentRLModule(Policy(model=model_a, tokenizer=None, chat=CHAT, source="t"),
                           [PolicyGradient(), ForecastLoss(weight=coef, update="separate", lr_scale=scale)],
                           optimizer=lambda ps: torch.optim.SGD(ps, lr=lr), temperature=0.7, gradient_clip_val=clip)
    opt_a = module.configure_optimizers()
    total, metrics = combine(module.objectives, module(batch), batch, step=0)  # what training_step's backward sums
    assert "loss/pg" not in metrics and metrics["loss/forecast"] > 0  # the PG objective is not computed on it
    total.backward()
    torch.nn.utils.clip_grad_norm_(module.policy.trainable_parameters(), clip)
    from cope.train.step.guard import lr_scaled

    params_a = [p.detach().clone() for p in model_a.parameters() if p.requires_grad]
    with lr_scaled(opt_a, scale):
        opt_a.step()
    moved = [p for p in model_a.parameters() if p.requires_grad]
    assert any(not torch.equal(a, b) for a, b in zip(params_a, moved))
    assert opt_a.param_groups[0]["lr"] == lr  # restored after the step

    model_b = _model()
    params_b = [p for p in model_b.parameters() if p.requires_grad]
    opt_b = torch.optim.SGD(params_b, lr=lr * scale)
    (coef * _reference_loss(model_b, eps, chunks)).backward()
    torch.nn.utils.clip_grad_norm_(params_b, clip)
    grads_a = [p.grad for p in model_a.parameters() if p.requires_grad]
    for a, b in zip(grads_a, params_b):
        torch.testing.assert_close(a, b.grad, atol=1e-7, rtol=1e-5)
    opt_b.step()
    for (na, a), (nb, b) in zip(model_a.named_parameters(), model_b.named_parameters()):
        assert na == nb
        torch.testing.assert_close(a, b, atol=1e-7, rtol=0)


def test_an_empty_forecast_batch_trains_nothing():
    """An idle DDP rank's padding batch: a forward and a zero-gradient backward."""
    model = _model()
    module = AgentRLModule(Policy(model=model, tokenizer=None, chat=CHAT, source="t"),
                           [ForecastLoss(weight=0.01, update="separate")], optimizer=torch.optim.AdamW)
    batch = collate_chunks([], [], PAD)
    total, metrics = combine(module.objectives, module(batch), batch, step=0)
    total.backward()
    assert total.item() == 0.0 and metrics["loss/forecast"] == 0.0
    assert all(p.grad is None or not p.grad.any() for p in model.parameters())


def test_te_rows_are_the_logits_that_predict_the_covered_tokens():
    """The module's forward forms full predictive rows at ``te_position`` only: equal to the model's own logits at
    column - 1, with gradient, whole-batch and micro-batched alike."""
    from cope.algos.cope.te_loss import TemporalEnsembleLoss
    from cope.train.step.backward import backward_microbatched

    model, eps = _model(), _episodes()
    module = AgentRLModule(Policy(model=model, tokenizer=None, chat=CHAT, source="t"),
                           [TemporalEnsembleLoss(weight=1.0, warmup_steps=0)], optimizer=torch.optim.SGD, temperature=0.7)
    batch = collate(eps, PAD)
    pos = torch.tensor([[0, 12], [1, 15], [3, 9], [2, 20]])  # (row, column)
    batch.update(te_position=pos, te_ids=torch.randint(0, 128, (4, 8)), te_probs=torch.full((4, 8), 0.05))
    out = module(batch)
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits  # (N, T, V)
    torch.testing.assert_close(out.rows["te_position"], logits[pos[:, 0], pos[:, 1] - 1].float(), atol=1e-5, rtol=0)
    assert out.rows["te_position"].requires_grad  # untempered, whatever the sampling temperature
    loss, m = module.objectives[0](out, batch)
    assert loss.item() > 0 and m["te/positions"] == 4
    module.max_tokens_per_microbatch = 2 * batch["input_ids"].shape[1]  # two rows at a time
    module.manual_backward = lambda x: x.backward()  # no trainer: a plain backward
    params = [p for p in model.parameters() if p.requires_grad]
    split, total, _ = backward_microbatched(module, batch)
    g_split = [p.grad.clone() for p in params]
    for p in params:
        p.grad = None
    loss.backward()
    assert total.item() == pytest.approx(loss.item(), abs=1e-6)
    for a, p in zip(g_split, params):
        torch.testing.assert_close(a, p.grad, atol=1e-6, rtol=0)



def _diagnosed_fit(batches: list[str], every_n_steps: int, epochs: int = 1):
    """SGD at lr 0 (every step at the same parameters) over ``batches`` ("rollout"/"forecast") each epoch, with
    GradientStats; returns (the grad/* rows as (step, metrics), objectives, module, rollout batch, forecast batch)."""
    import lightning.pytorch as pl

    from cope.callbacks.grad_stats import GradientStats

    model, eps = _model(), _episodes()
    for e, a in zip(eps, [0.9, -0.4, 0.7, -1.1]):
        e.advantage = a
    objectives = [PolicyGradient(), ForecastLoss(weight=0.01, update="separate", lr_scale=3.0)]
    module = AgentRLModule(Policy(model=model, tokenizer=None, chat=CHAT, source="t"), objectives,
                           optimizer=lambda ps: torch.optim.SGD(ps, lr=0.0))
    made = {"rollout": collate(eps, PAD), "forecast": collate_chunks(eps, _chunks(eps), PAD)}
    module.score_minibatches([made["rollout"]])
    capture = capture_logger()
    trainer = pl.Trainer(max_epochs=epochs, accelerator="cpu", devices=1, logger=[capture], enable_checkpointing=False,
                         callbacks=[GradientStats(every_n_steps=every_n_steps)], enable_progress_bar=False,
                         enable_model_summary=False)
    trainer.fit(module, train_dataloaders=torch.utils.data.DataLoader([made[b] for b in batches], batch_size=None))
    rows = [(step, {k: float(v) for k, v in m.items() if k.startswith("grad/")}) for step, m in capture.rows]
    return [r for r in rows if r[1]], objectives, module, made["rollout"], made["forecast"]


def test_grad_diagnostics_measure_the_separate_forecast_step_against_the_policy_step():
    """GradientStats on a policy step then a separate forecast step (SGD at lr 0: both at the same parameters):
    the policy step logs the PG gradient alone (the forecast loss is not computed on a rollout batch); the
    forecast step logs its own gradient's norm and its cosine and ratio with the policy step's gradient, each
    equal to a hand computation."""
    # step 0 measured (a multiple of 2); step 1, the forecast batch, measured against it although 1 is not
    rows, objectives, module, rollout, forecast = _diagnosed_fit(["rollout", "forecast", "forecast"], every_n_steps=2)
    assert [s for s, _ in rows] == [0, 1], rows  # the third batch: nothing kept any more
    (_, pg_row), (_, fc_row) = rows
    assert set(pg_row) == {"grad/pg_norm", "grad/total_norm"}
    assert set(fc_row) == {"grad/forecast_norm", "grad/cos_forecast_pg", "grad/ratio_forecast_pg"}

    coef = objectives[1].weight
    params = module.policy.trainable_parameters()
    pg_loss, _ = objectives[0](module(rollout), rollout)
    g_pg = torch.cat([g.reshape(-1) for g in torch.autograd.grad(pg_loss, params)])
    fc_loss, _ = objectives[1](module(forecast), forecast)
    g_fc = torch.cat([g.reshape(-1) for g in torch.autograd.grad(fc_loss, params)])
    assert pg_row["grad/pg_norm"] == pytest.approx(g_pg.norm().item(), rel=1e-4)
    assert fc_row["grad/forecast_norm"] == pytest.approx(coef * g_fc.norm().item(), rel=1e-4)
    cos = torch.dot(g_fc, g_pg) / (g_fc.norm() * g_pg.norm())
    assert fc_row["grad/cos_forecast_pg"] == pytest.approx(cos.item(), abs=1e-4)
    assert fc_row["grad/ratio_forecast_pg"] == pytest.approx(coef * g_fc.norm().item() / g_pg.norm().item(), rel=1e-4)


def test_grad_diagnostics_keep_no_policy_gradient_across_epochs():
    """Each epoch is [forecast, rollout], every step measured where it can be: epoch 0's policy step (step 1) is
    measured and kept, but epoch 1's forecast step (step 2) must not be compared with it (another epoch's rollout
    batch): the kept gradient is dropped at the epoch's start. Steps 1 and 3 log; 2 does not."""
    rows, *_ = _diagnosed_fit(["forecast", "rollout"], every_n_steps=1, epochs=2)
    assert [s for s, _ in rows] == [1, 3], [(s, sorted(m)) for s, m in rows]
    assert all("grad/pg_norm" in m for _, m in rows)
