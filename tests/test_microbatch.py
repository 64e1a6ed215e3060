"""`cope.train.module`: micro-batches under a token budget give the loss and the gradients of one forward over
the whole minibatch (to fp32 tolerance), for every objective and both CoPE layouts; the scoring pass
under a budget gives the same scores."""
from __future__ import annotations

import functools
import sys
from pathlib import Path

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import Qwen2ForCausalLM

sys.path.insert(0, str(Path(__file__).parent / "forecasting"))
from forecast_fixtures import CFG, CHAT, PAD, make_episode  # noqa: E402

from cope.algos.cope.chunks import build_chunks  # noqa: E402
from cope.algos.cope.loss import ForecastLoss  # noqa: E402
from cope.algos.cope.packing import pack_forecasts, plain_forecasts  # noqa: E402
from cope.algos.echo import ObservationLoss  # noqa: E402
from cope.algos.grpo import KLPenalty, PolicyGradient  # noqa: E402
from cope.batch import collate, row_lengths  # noqa: E402
from cope.models.policy import Policy  # noqa: E402
from cope.train.module import AgentRLModule  # noqa: E402

OBJECTIVES = {
    "pg token-mean": lambda: [PolicyGradient(agg="token-mean")],
    "pg seq-mean-token-mean": lambda: [PolicyGradient()],
    "pg seq-mean + kl": lambda: [PolicyGradient(agg="seq-mean-token-mean"), KLPenalty(weight=0.1)],
    "pg sum-norm + echo": lambda: [PolicyGradient(agg="seq-mean-token-sum-norm", norm_len=16), ObservationLoss(weight=0.5)],
    "cope packed": lambda: [PolicyGradient(), ForecastLoss(weight=0.3)],
    "cope plain per_step": lambda: [PolicyGradient(), ForecastLoss(weight=0.3, normalize="per_step")],
}


def _policy():
    torch.manual_seed(0)
    base = Qwen2ForCausalLM(CFG)
    for p in base.parameters():
        p.requires_grad_(False)
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", lora_dropout=0.0))
    return Policy(model=model, tokenizer=None, chat=CHAT, source="test")


def _minibatch(layout: str | None):
    eps = [make_episode(CHAT, n, success, seed) for n, success, seed in [(3, True, 1), (1, False, 2), (4, True, 3),
                                                                          (2, False, 4), (3, True, 5)]]
    for e, a in zip(eps, [1.0, -0.5, 0.8, -1.2, 0.3]):
        e.advantage = a
    mb = collate(eps, PAD)
    if layout:
        chunks, _ = build_chunks(eps, CHAT, K=2)
        assert chunks
        mb = (pack_forecasts if layout == "packed" else plain_forecasts)(mb, eps, chunks, PAD)
    return mb


def _module(policy, objectives, budget):
    module = AgentRLModule(policy, objectives, optimizer=functools.partial(torch.optim.SGD, lr=0.1),
                           max_tokens_per_microbatch=budget)
    module.manual_backward = lambda loss: loss.backward()  # no trainer here: the plain autograd call
    return module


def _step(module, mb):
    module.zero_grad(set_to_none=True)
    out, total, metrics = module._backward(mb)
    grads = {n: p.grad.clone() for n, p in module.named_parameters() if p.requires_grad}
    return out, total, metrics, grads


@pytest.mark.parametrize("name", list(OBJECTIVES))
def test_micro_batches_equal_one_forward(name):
    layout = "packed" if "packed" in name else "plain" if "plain" in name else None
    policy = _policy()
    mb = _minibatch(layout)
    full = _module(policy, OBJECTIVES[name](), None)
    full.score_minibatches([mb])
    with torch.no_grad():  # an update happened since scoring: ratios off 1, clipping and KL active
        for n, p in policy.model.named_parameters():
            if "lora_" in n:
                p.add_(torch.randn_like(p) * 0.3)
    out_a, total_a, m_a, g_a = _step(full, mb)
    assert total_a.abs() > 0 and any(g.abs().sum() > 0 for g in g_a.values())
    longest = int(row_lengths(mb).max())
    for budget in (1, longest * 2):  # one row per micro-batch; two rows
        micro = _module(policy, OBJECTIVES[name](), budget)
        parts = micro.micro_batches(mb)
        assert len(parts) > 1 and sum(len(r) for r, _ in parts) == mb["input_ids"].shape[0]
        out_b, total_b, m_b, g_b = _step(micro, mb)
        torch.testing.assert_close(out_b.logprobs, out_a.logprobs, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(total_b, total_a, atol=1e-6, rtol=1e-5)
        for k in m_a:
            torch.testing.assert_close(torch.as_tensor(m_b[k]), torch.as_tensor(m_a[k]), atol=1e-5, rtol=1e-5, msg=k)
        for n in g_a:
            torch.testing.assert_close(g_b[n], g_a[n], atol=1e-6, rtol=1e-4, msg=n)


def test_scoring_under_a_budget_equals_one_pass():
    policy = _policy()
    a, b = _minibatch("plain"), _minibatch("plain")
    _module(policy, [PolicyGradient(), KLPenalty(weight=0.1)], None).score_minibatches([a])
    _module(policy, [PolicyGradient(), KLPenalty(weight=0.1)], 1).score_minibatches([b])
    for k in ("old_logprobs", "old_entropy", "ref_logprobs"):
        torch.testing.assert_close(b[k], a[k], atol=1e-5, rtol=1e-5, msg=k)


def test_budget_groups_consecutive_rows_and_trims_padding():
    policy = _policy()
    mb = _minibatch(None)
    lengths = row_lengths(mb).tolist()
    module = _module(policy, [PolicyGradient()], max(lengths[:2]) * 2)
    parts = module.micro_batches(mb)
    assert parts[0][0].tolist() == [0, 1] and parts[0][1] == max(lengths[:2])
    for rows, n in parts:
        assert n * len(rows) <= module.max_tokens_per_microbatch or len(rows) == 1
        assert n == max(lengths[i] for i in rows.tolist())


@pytest.mark.long
def test_training_run_with_a_token_budget_matches_one_forward(run_train, tmp_path):
    """Through the entry point: one epoch of CoPE+ECHO (ECHO moves the adapter even when every cold-start
    episode fails) with a 64-token micro-batch budget
    ends on the adapter of the same run without a budget (same rollouts, same steps, fp32 tolerance). SGD, not the
    default AdamW: Adam's first step is about lr x g / (|g| + eps), which turns the fp32 rounding of a near-zero
    gradient element (micro-batched sums round differently, and differently on each CPU's kernels) into a move of
    order lr; SGD moves by lr x g."""
    from safetensors.torch import load_file

    adapters = {}
    sgd = ["module.optimizer._target_=torch.optim.SGD", "module.optimizer.lr=5"]  # |g| ~ 1e-2: moves ~ AdamW's at 1e-3
    for name, extra in {"whole": [], "micro": ["module.max_tokens_per_microbatch=64"]}.items():
        out = tmp_path / name
        run_train(["algo=cope_echo", "trainer.max_epochs=1", "validate_before_fit=false", *sgd, *extra], out)
        adapters[name] = load_file(str(out / "csv" / "adapter" / "adapter_model.safetensors"))
    assert adapters["whole"].keys() == adapters["micro"].keys()
    moved = 0
    for k, w in adapters["whole"].items():
        torch.testing.assert_close(adapters["micro"][k], w, atol=1e-5, rtol=1e-4, msg=k)
        moved += int("lora_B" in k and w.abs().max() > 100 * 1e-5)
    assert moved > 0  # the steps did change the adapter, well beyond the tolerance
