"""`cope.train.objectives.Needs`: an objective declares what the forward must give it, and the module fills it without
knowing which objective asked. The objective here is the test's own (not CoPE's temporal ensemble): full predictive
rows at positions listed under a batch key of its own, and its own batch kind with its own metric prefix."""
from __future__ import annotations

import functools
import sys
from pathlib import Path

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import Qwen2ForCausalLM

sys.path.insert(0, str(Path(__file__).parent / "forecasting"))
from forecast_fixtures import CFG, CHAT, PAD, capture_logger, make_episode  # noqa: E402

from cope.batch import collate, row_lengths  # noqa: E402
from cope.models.policy import Policy  # noqa: E402
from cope.train.module import AgentRLModule  # noqa: E402
from cope.train.objectives import Needs, Objective, check_objectives, step_prefix  # noqa: E402

KEY = "probe_at"  # a batch key no module code names


class RowsProbe(Objective):
    """Mean NLL of ``probe_target`` under the full predictive rows at ``batch[KEY]``'s [row, column] positions: a sum
    of per-position terms over a count read from the batch, so micro-batching is exact."""

    name = "probe"
    needs = Needs(rows_at=(KEY,))

    def __init__(self, weight: float = 1.0, batch_kind: str = "rollout", metric_prefix: str | None = None):
        super().__init__(weight=weight)
        self.batch_kind, self.metric_prefix = batch_kind, metric_prefix

    def __call__(self, out, batch):
        rows = out.rows[KEY]  # (P, V): a KeyError when the module did not fill the declaration
        target = batch["probe_target"].to(rows.device)  # (P,)
        loss = -rows.log_softmax(-1).gather(-1, target[:, None]).sum() / target.numel()
        return loss, {"probe/positions": float(target.numel())}


def _policy():
    torch.manual_seed(0)
    base = Qwen2ForCausalLM(CFG)
    for p in base.parameters():
        p.requires_grad_(False)
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", lora_dropout=0.0,
                                            init_lora_weights=False))
    return Policy(model=model, tokenizer=None, chat=CHAT, source="test")


def _batch():
    eps = [make_episode(CHAT, n, True, seed) for n, seed in [(3, 1), (1, 2), (4, 3), (2, 4)]]
    mb = collate(eps, PAD)
    real = mb["attention_mask"].bool().clone()
    real[:, 0] = False  # column 0 has no predictive row
    g = torch.Generator().manual_seed(0)
    pos = real.nonzero()  # (P_all, 2) [row, column]
    mb[KEY] = pos[torch.randperm(len(pos), generator=g)[:15]]  # (P, 2), rows interleaved
    mb["probe_target"] = torch.randint(0, CFG.vocab_size, (15,), generator=g)  # (P,)
    return mb


def _module(policy, objectives, budget=None, temperature=0.7):
    module = AgentRLModule(policy, objectives, optimizer=functools.partial(torch.optim.SGD, lr=0.1),
                           max_tokens_per_microbatch=budget, temperature=temperature)
    module.manual_backward = lambda loss: loss.backward()  # no trainer here: the plain autograd call
    return module


def _direct(policy, mb):
    """The model's own logits at the position before each listed token (untempered), and the probe's loss on them."""
    logits = policy.model(input_ids=mb["input_ids"], attention_mask=mb["attention_mask"]).logits  # (N, T, V)
    pos = mb[KEY]
    rows = logits[pos[:, 0], pos[:, 1] - 1].float()  # (P, V)
    loss = -rows.log_softmax(-1).gather(-1, mb["probe_target"][:, None]).sum() / len(pos)
    return rows, loss


def test_module_fills_declared_rows_under_micro_batching():
    """The forward gives the probe its rows, equal to the model's logits; micro-batched (one row at a time, and two
    rows), the spliced rows, the loss and the gradients equal the direct computation's."""
    policy, mb = _policy(), _batch()
    params = policy.trainable_parameters()
    rows, loss = _direct(policy, mb)
    grads = torch.autograd.grad(loss, params)
    whole = _module(policy, [RowsProbe()])(mb)
    assert set(whole.rows) == {KEY} and whole.rows[KEY].requires_grad
    torch.testing.assert_close(whole.rows[KEY], rows, atol=1e-5, rtol=0)
    longest = int(row_lengths(mb).max())
    for budget in (1, 2 * longest):
        module = _module(policy, [RowsProbe()], budget)
        parts = module.micro_batches(mb)
        assert len(parts) > 1
        # the rows come in pieces: no micro-batch holds every listed position
        assert all(len(module.logprobs(mb, r, n, rows_at=(KEY,)).row_index[KEY]) < len(mb[KEY]) for r, n in parts)
        module.zero_grad(set_to_none=True)
        out, total, metrics = module._backward(mb)
        torch.testing.assert_close(out.rows[KEY], rows.detach(), atol=1e-5, rtol=0)
        assert total.item() == pytest.approx(loss.item(), abs=1e-5) and metrics["probe/positions"] == 15
        for p, g in zip(params, grads):
            torch.testing.assert_close(p.grad, g, atol=1e-6, rtol=1e-4)


def test_module_fills_only_what_the_objectives_declare():
    """Rows are formed for declared keys only: not for a key no objective names, nor for an objective switched off."""
    policy, mb = _policy(), _batch()
    assert _module(policy, [RowsProbe(weight=0.0), _Plain()]).needs == Needs()
    assert _module(policy, [_Plain()])(mb).rows == {}
    assert _module(policy, [RowsProbe(), _Plain()]).needs == Needs(rows_at=(KEY,))
    del mb[KEY]  # declared, but this batch lists no positions: nothing to form
    assert _module(policy, [RowsProbe()])(mb).rows == {}


class _Plain(Objective):
    name = "plain"

    def __call__(self, out, batch):
        return out.logprobs.sum() * 0.0, {}


def test_steps_of_an_objectives_own_kind_log_under_its_prefix():
    """A batch of the probe's own kind takes one optimizer step whose metrics carry the prefix it declares; the policy
    steps' names (``loss/total``, ``train/grad_norm``) are not on its row."""
    import lightning.pytorch as pl

    policy, mb = _policy(), _batch()
    mb["kind"] = "probe_steps"
    module = _module(policy, [_Plain(), RowsProbe(batch_kind="probe_steps", metric_prefix="probe")])
    capture = capture_logger()
    trainer = pl.Trainer(max_epochs=1, accelerator="cpu", devices=1, logger=[capture], enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(module, train_dataloaders=torch.utils.data.DataLoader([mb], batch_size=None))
    (step, row), = [(s, m) for s, m in capture.rows if "loss/probe" in m]
    assert step == 0 and {"probe/loss_total", "probe/grad_norm", "probe/tokens_forwarded", "probe/positions"} <= set(row)
    assert "loss/total" not in row and "train/grad_norm" not in row and "loss/plain" not in row
    assert row["probe/loss_total"] == pytest.approx(row["loss/probe"]) and row["probe/grad_norm"] > 0
    assert row["probe/tokens_forwarded"] == float(mb["attention_mask"].sum())


def test_declarations_are_checked():
    """One metric prefix per batch kind; the kind's name without one; the old ``needs_ref`` attribute is refused
    (it would shadow the declaration the module reads)."""
    a, b = RowsProbe(batch_kind="k", metric_prefix="x"), _Plain()
    b.batch_kind, b.metric_prefix = "k", "y"
    with pytest.raises(ValueError, match="different metric prefixes"):
        check_objectives([a, b])
    assert step_prefix([RowsProbe(batch_kind="k")], "k") == "k"
    with pytest.raises(TypeError, match="Needs"):
        type("Legacy", (_Plain,), {"needs_ref": True})
