"""CoPE forecast layouts, loss, adaptive scale and callbacks: the packed and the plain layouts give
the same loss and gradients as scoring every chunk on its own, on a tiny Qwen2."""
import copy
from types import SimpleNamespace

import pytest
import torch
import transformers
from forecast_fixtures import CFG, CHAT, NO_JOINER, PAD, make_episode, segment_mask  # noqa: E402

from cope.algos.cope.chunks import build_chunks
from cope.algos.cope.forecast_targets import ForecastTargets
from cope.algos.cope.loss import AdaptiveScale, ForecastLoss, forecast_nll
from cope.algos.cope.loss_balance import LossBalance
from cope.algos.cope.packing import pack_forecasts, plain_forecasts
from cope.batch import collate
from cope.episode import Role
from cope.train.objectives import ForwardOut


def episodes(chat=CHAT):
    closed = [True] * 4 if chat is NO_JOINER else [True, False, True, True]
    return [make_episode(chat, 4, True, 1, valid=[True, True, False, True], closed=closed), make_episode(chat, 3, False, 2)]


def tiny_model(attn):
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(copy.deepcopy(CFG), attn_implementation=attn, dtype=torch.float32)


def mask_of(batch):
    """The mask the model gets: the packed rows' tree as an additive float mask (any attention kernel), else 2D."""
    if batch.get("packed") is not None:
        keep = batch["packed"].tree.dense_mask()  # (N, 1, T, T) bool
        return torch.zeros(keep.shape).masked_fill(~keep, torch.finfo(torch.float32).min)
    return batch["attention_mask"]


def token_logprobs(model, batch):
    """(N, T) log p(token t | tokens < t); position 0 holds 0."""
    ids = batch["input_ids"]
    logits = model(input_ids=ids, attention_mask=mask_of(batch), position_ids=batch["position_ids"]).logits  # (N, T, V)
    lp = logits.float().log_softmax(-1)[:, :-1].gather(-1, ids[:, 1:, None]).squeeze(-1)  # (N, T-1)
    return torch.nn.functional.pad(lp, (1, 0))  # (N, T)


def loss_and_grads(model, batch, normalize):
    lp = token_logprobs(model, batch)
    acts = batch["forecast_actions"]
    loss, _ = forecast_nll(lp, batch["forecast_mask"], batch["forecast_chunk"], acts.numel(), normalize, acts)
    return loss, torch.autograd.grad(loss, list(model.parameters()), allow_unused=True), lp


def reference_loss(model, eps, chunks, normalize):
    """Every chunk scored on its own sequence tokens[:anchor] + chunk, no padding, no masks."""
    per = []
    for c in chunks:
        seq = torch.tensor([eps[c.episode].tokens[: c.anchor] + c.tokens])  # (1, L)
        lp = token_logprobs(model, {"input_ids": seq, "attention_mask": torch.ones_like(seq),
                                    "position_ids": torch.arange(seq.shape[1])[None]})
        tgt = torch.tensor(c.target)
        if tgt.any():
            nll = -lp[0, c.anchor :][tgt].mean()
            per.append(nll / c.num_actions if normalize == "per_step" else nll)
    return torch.stack(per).mean()


@pytest.mark.long
@pytest.mark.parametrize("attn,normalize,chat", [("sdpa", "none", CHAT), ("eager", "per_step", CHAT), ("sdpa", "none", NO_JOINER)])
def test_packed_and_plain_give_the_same_loss_and_gradients(attn, normalize, chat):
    model, eps = tiny_model(attn), episodes(chat)
    base = collate(eps[::-1], PAD, indices=[1, 0])  # rows in another order than the episode list
    chunks, _ = build_chunks([eps[i] for i in [1, 0]], chat, K=3, indices=[1, 0])
    assert chunks and {c.episode for c in chunks} == {0}
    packed, plain = pack_forecasts(base, eps, chunks, PAD), plain_forecasts(base, eps, chunks, PAD)
    assert packed["attention_mask"].dim() == 2 and packed["packed"].tree is not None  # no (T, T) mask stored
    keep = packed["packed"].tree.dense_mask()  # (N, 1, T, T) bool
    assert torch.equal(keep, segment_mask(packed, chunks))
    assert keep.dtype == torch.bool and keep.diagonal(dim1=-2, dim2=-1).all()  # every query attends itself
    assert plain["input_ids"].shape[0] == 2 + len(chunks) and plain["aux_row"].sum() == len(chunks)
    for b in (packed, plain):  # added positions are invisible to the policy-gradient path
        extra = b["forecast_chunk"] >= 0
        extra[: base["input_ids"].shape[0], : base["input_ids"].shape[1]] = False
        assert (b["roles"][extra] == Role.PAD).all() and not b["action_mask"][extra].any() and (b["advantages"][extra] == 0).all()
        assert (b["forecast_chunk"][b["forecast_mask"]] >= 0).all()
    assert (plain["episode_index"][2:] == -1).all() and not plain["aborted"][2:].any()

    with torch.no_grad():
        ref = reference_loss(model, eps, chunks, normalize)
    lp_base = token_logprobs(model, base).detach()
    loss_p, grads_p, lp_p = loss_and_grads(model, packed, normalize)
    loss_q, grads_q, lp_q = loss_and_grads(model, plain, normalize)
    assert loss_p.item() == pytest.approx(ref.item(), abs=1e-5)
    assert loss_q.item() == pytest.approx(ref.item(), abs=1e-5)
    for gp, gq in zip(grads_p, grads_q):
        if gp is None or gq is None:
            assert gp is None and gq is None
            continue
        torch.testing.assert_close(gp, gq, atol=1e-5, rtol=0)
    # the transcript rows (what PG, ECHO and EMPG read) are unchanged by either layout
    real = base["attention_mask"].bool()  # (N, T)
    N, T = real.shape
    torch.testing.assert_close(lp_p[:N, :T][real], lp_base[real], atol=1e-5, rtol=0)
    torch.testing.assert_close(lp_q[:N, :T][real], lp_base[real], atol=1e-5, rtol=0)
    assert torch.equal(packed["action_mask"][:N, :T], base["action_mask"])


def test_packed_ignores_chunks_of_other_minibatches():
    eps = [make_episode(CHAT, 3, True, 1), make_episode(CHAT, 3, True, 2)]
    chunks, _ = build_chunks(eps, CHAT, K=2)
    base = collate([eps[1]], PAD, indices=[1])
    packed, plain = pack_forecasts(base, eps, chunks, PAD), plain_forecasts(base, eps, chunks, PAD)
    ids = {c for b in (packed, plain) for c in b["forecast_chunk"].unique().tolist()} - {-1}
    assert ids == {i for i, c in enumerate(chunks) if c.episode == 1}
    assert packed["forecast_actions"].numel() == len(chunks)


def test_cold_start_loss_is_exactly_zero():
    model, eps = tiny_model("sdpa"), [make_episode(CHAT, 3, False, 1), make_episode(CHAT, 2, False, 2)]
    chunks, m = build_chunks(eps, CHAT, K=3)
    assert chunks == [] and m["forecast/targets"] == 0
    batch = pack_forecasts(collate(eps, PAD), eps, chunks, PAD)
    lp = token_logprobs(model, batch)
    obj = ForecastLoss(weight=0.1)
    for b in (batch, collate(eps, PAD)):  # targets built but empty; callback off
        loss, metrics = obj(ForwardOut(logprobs=lp, entropy=lp.detach()), b)
        assert loss.item() == 0.0 and loss.requires_grad and metrics["forecast/raw"] == 0.0
        loss.backward(retain_graph=True)
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


def test_adaptive_scale_bounds_and_no_gradient():
    s = AdaptiveScale(adaptive_ratio=0.5, beta=0.9)
    assert s.scale == 1.0
    s.update(2.0, 4.0)
    assert s.scale == pytest.approx(0.25)
    s.update(2.0, 0.0)  # a step without targets does not move the forecast EMA
    assert s.scale == pytest.approx(0.25)
    for _ in range(200):
        s.update(1e9, 1e-6)
    assert s.scale == 1e3
    for _ in range(200):
        s.update(1e-9, 1e6)
    assert s.scale == 1e-3
    with pytest.raises(ValueError, match="beta"):
        AdaptiveScale(beta=1.0)
    # the scale multiplies the loss as a plain float: the gradient is scale x the raw gradient
    lp = torch.randn(2, 5, requires_grad=True)
    batch = {"forecast_mask": torch.ones(2, 5, dtype=torch.bool), "forecast_chunk": torch.tensor([[0] * 5, [1] * 5]),
             "forecast_actions": torch.tensor([1, 2])}
    obj = ForecastLoss(normalize="adaptive", adaptive_ratio=0.3)
    obj.observe(1.0, 1.0)  # scale = 0.3 x 1 / 1
    loss, m = obj(ForwardOut(lp, lp.detach()), batch)
    (g,) = torch.autograd.grad(loss, lp)
    raw, _ = forecast_nll(lp, batch["forecast_mask"], batch["forecast_chunk"], 2)
    (g_raw,) = torch.autograd.grad(raw, lp)
    torch.testing.assert_close(g, 0.3 * g_raw)
    assert m["forecast/scale"] == 0.3 and m["forecast/raw"].item() == pytest.approx(raw.item())
    assert m["forecast/scaled"].item() == pytest.approx(0.3 * raw.item())


def test_loss_balance_leaves_fixed_normalizations_alone():
    fc = ForecastLoss(normalize="none", adaptive_ratio=0.5)  # none/per_step: no adaptive scale at all
    assert fc.adaptive is None and fc.state_dict() == {}
    cb = LossBalance()
    cb.setup(SimpleNamespace(world_size=1), SimpleNamespace(objectives=[fc], log=lambda *a, **k: None), "fit")
    for _ in range(3):
        cb.on_train_batch_end(SimpleNamespace(world_size=1), SimpleNamespace(log=lambda *a, **k: None),
                               {"loss/pg": 2.0, "forecast/raw": 8.0}, {}, 0)
    assert fc.scale == 1.0


def test_loss_balance_drives_the_objectives_own_scale():
    logged = {}
    fc = ForecastLoss(normalize="adaptive", adaptive_ratio=0.5)
    module = SimpleNamespace(objectives=[SimpleNamespace(name="pg"), fc], log=lambda k, v, **kw: logged.__setitem__(k, v))
    trainer = SimpleNamespace(world_size=1)
    cb = LossBalance()
    cb.setup(trainer, module, "fit")
    assert not hasattr(cb, "state_dict") or cb.state_dict() == {}  # the callback owns no state
    pg = torch.tensor(2.0, requires_grad=True) * 1.0  # a tensor with history must not leak into the scale
    for _ in range(3):
        cb.on_train_batch_end(trainer, module, {"loss": pg, "loss/pg": pg, "forecast/raw": torch.tensor(8.0)}, {}, 0)
    assert type(fc.scale) is float and fc.scale == pytest.approx(0.125) and logged["forecast/scale"] == fc.scale
    cb.on_train_batch_end(trainer, module, {"loss/pg": 2.0, "loss/forecast": 0.125 * 8.0}, {}, 0)  # raw from loss / scale
    assert fc.scale == pytest.approx(0.125)
    cb.on_train_batch_end(trainer, module, {"loss/pg": 1e12, "forecast/raw": 1e-12}, {}, 0)
    assert fc.scale <= 1e3
    owned = ForecastLoss(normalize="adaptive", adaptive_ratio=0.2)
    cb2 = LossBalance()
    cb2.setup(trainer, SimpleNamespace(objectives=[owned], log=lambda *a, **k: None), "fit")
    cb2.on_train_batch_end(trainer, SimpleNamespace(log=lambda *a, **k: None), {"loss/pg": 1.0, "forecast/raw": 1.0}, {}, 0)
    assert owned.scale == pytest.approx(0.2) and owned.adaptive.ema_pg == 1.0
    restored = ForecastLoss(normalize="adaptive", adaptive_ratio=0.2)  # the objective's state round-trips alone
    restored.load_state_dict(owned.state_dict())
    assert restored.scale == owned.scale and restored.state_dict() == owned.state_dict()
    with pytest.raises(ValueError, match="obs"):
        LossBalance(objective="obs").setup(trainer, module, "fit")


def test_forecast_targets_callback_registers_transform_and_logs():
    fns, logged = [], {}
    dm = SimpleNamespace(add_collate_transform=fns.append, epoch=0)  # the part of RolloutDataModule it uses
    one_process = SimpleNamespace(reduce=lambda t, reduce_op: t)  # the epoch's sums are pooled over ranks: one here
    trainer = SimpleNamespace(datamodule=dm, global_rank=0, strategy=one_process)
    module = SimpleNamespace(log_dict=lambda d, **kw: logged.update(d), policy=SimpleNamespace(chat=CHAT, pad_id=PAD), device="cpu")
    cb = ForecastTargets(K=3, packing="packed")  # the rows as prefix trees (tree attention: test_joint_tree.py)
    cb.setup(trainer, module, "fit")
    cb.setup(trainer, module, "fit")
    assert len(fns) == 1
    eps = episodes()
    out = fns[0](collate(eps, PAD), eps)
    assert out["packed"].tree is not None and out["forecast_mask"].any()
    cb.on_train_epoch_end(trainer, module)
    assert logged["forecast/targets"] == 4 and logged["forecast/episodes"] == 1
    assert 0 < logged["forecast/masked_frac"] < 1 and logged["forecast/ensemble_size"] > 1
    logged.clear()
    cb.on_train_epoch_end(trainer, module)
    assert logged == {}
    with pytest.raises(ValueError, match="cope.packing"):
        ForecastTargets(packing="interleaved")
    with pytest.raises(ValueError, match="cope.invalid"):
        ForecastTargets(invalid="skip")
    with pytest.raises(TypeError, match="datamodule"):
        ForecastTargets().setup(SimpleNamespace(datamodule=None), module, "fit")


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_packed_equals_plain_through_the_module_at_any_temperature(temperature):
    """The module scores transcript action tokens at the sampling temperature (the policy gradient) and every
    other position untempered. A forecast is a cross-entropy under the model's own distribution, so both layouts
    must score it untempered: when the packed layout reused a_t's transcript positions, at T = 0.7 its forecast
    loss differed from the plain layout's by up to 3e-2 and its gradients by up to 0.2."""
    from peft import LoraConfig, get_peft_model

    from cope.models.policy import Policy
    from cope.train.module import AgentRLModule

    torch.manual_seed(0)
    base = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(CFG), attn_implementation="sdpa", dtype=torch.float32)
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False))
    module = AgentRLModule(Policy(model=model, tokenizer=None, chat=CHAT, source="t"), [ForecastLoss(weight=1.0)],
                           optimizer=torch.optim.SGD, temperature=temperature)
    eps = episodes()
    base_b = collate(eps, PAD)
    chunks, _ = build_chunks(eps, CHAT, K=3)
    results = []
    for layout in (pack_forecasts, plain_forecasts):
        batch = layout(base_b, eps, chunks, PAD)
        assert not (batch["forecast_mask"] & batch["action_mask"]).any()  # no forecast token is scored tempered
        loss, _ = module.objectives[0](module(batch), batch)
        grads = torch.autograd.grad(loss, [p for p in model.parameters() if p.requires_grad])
        results.append((loss, grads))
    (lp, gp), (lq, gq) = results
    assert lp.item() == pytest.approx(lq.item(), abs=1e-5)
    for a, b in zip(gp, gq):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
