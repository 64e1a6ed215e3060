"""CoPE's joint update with packed rows (``cope.update=joint cope.packing=packed``): each row is a prefix tree (the
transcript, each forecast segment a branch), ``packed``. The tree says exactly what the segments mean, written out by
hand; tree attention (``data.share_prefix=true``: rows also placed side by side, a group's trees joined in one
trie) gives the scoring pass's old
log-probs, the policy-gradient plus forecast loss and every LoRA gradient of the tree's dense mask on SDPA (the
reference, ``data.share_prefix=false``), on Qwen2 and Llama, whole and micro-batched, at T = 1 and T = 0.7; the
continuation reading's packed rows (``algo=cope_continuation``) likewise."""
from __future__ import annotations

import pytest
import torch
from forecast_fixtures import segment_mask
from prompted_fixtures import CHAT, FakeTokenizer, reference_episode, simple_episode
from tiny_fixtures import exactness_model, exactness_module, scored_step

from cope.algos.cope.chunks import build_chunks
from cope.algos.cope.loss import ForecastLoss
from cope.algos.cope.packing import pack_forecasts
from cope.algos.cope.prompted import PlanPrompt, build_prompted
from cope.algos.grpo import PolicyGradient
from cope.batch import collate
from cope.train.packing.group_prefix import pack_groups
from cope.train.packing.tree_batch import use_tree_attention

PAD = 0


def _model(arch: str = "qwen2"):
    return exactness_model(arch, vocab_size=128)


def _episodes():
    """Rewards differ inside group 1 (a policy gradient); one episode with no sample (the loss)."""
    eps = [reference_episode(), simple_episode(3, 1.0, group=1), simple_episode(2, 1.0, group=1), simple_episode(2, 0.0, group=1)]
    for e, adv in zip(eps, (0.5, 0.8, -0.3, -0.6)):
        e.advantage = adv
    return eps


def _batch(eps, reading: str):
    """The minibatch with its forecast segments packed, and the chunks."""
    base = collate(eps, PAD)
    if reading == "authors":
        chunks, _ = build_prompted(eps, CHAT, PlanPrompt(FakeTokenizer()), K=3)
    else:  # the continuation reading: the next K actions in place, wins only
        chunks, _ = build_chunks(eps, CHAT, K=3)
    assert chunks and {c.episode for c in chunks} != set(range(len(eps)))  # some row has no segment
    return pack_forecasts(base, eps, chunks, PAD), chunks


def test_the_tree_says_what_the_segments_mean():
    """Every real token attends the keys written out by hand at the positions of its own sequence; the packing is the
    rows as they are; an anchor at position 1 (a segment that sees no transcript) is a node of its own."""
    eps = _episodes()
    for reading in ("authors", "continuation"):
        batch, chunks = _batch(eps, reading)
        pack = batch["packed"]
        assert pack.members == tuple((r,) for r in range(len(eps))) and pack.tree.length == batch["input_ids"].shape[1]
        real = batch["attention_mask"].bool()
        assert torch.equal(pack.tree.position_ids()[real], batch["position_ids"][real])
        assert torch.equal(pack.tree.dense_mask()[:, 0][real], segment_mask(batch, chunks)[:, 0][real])
    empty = pack_forecasts(collate(eps, PAD), eps, [], PAD)
    assert "packed" not in empty


def _module(model, temperature, budget):
    return exactness_module(model, [PolicyGradient(), ForecastLoss(weight=1.0, update="joint")], CHAT, temperature, budget)


@pytest.mark.parametrize("fill", [False, True])  # True: the trees side by side, the module's packed view (the default)
@pytest.mark.parametrize("reading", ["authors", "continuation"])
@pytest.mark.parametrize("budget", [None, 60])  # 60 tokens: micro-batches of one or two rows, columns cut short
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_joint_tree_equals_the_dense_mask(arch, temperature, budget, reading, fill):
    model, eps = _model(arch), _episodes()
    module = _module(model, temperature, budget)
    dense, _ = _batch(eps, reading)
    tree = dense
    if fill:  # as the DataModule does with data.share_prefix: group 1's trees joined in one trie, placed side by side
        tree = pack_groups(dense, eps)
        pack = tree["packed"]
        assert len(pack.lengths) < tree["input_ids"].shape[0] and pack.tokens < int(tree["attention_mask"].sum())
    if budget is not None:
        assert len(module.micro_batches(tree)) > 1
    ref_old, _, ref_loss, ref_m, ref_grads = scored_step(module, dense)  # reference: SDPA with the trees' dense mask
    use_tree_attention(model)
    old, _, loss, m, grads = scored_step(module, tree)
    torch.testing.assert_close(old, ref_old, atol=1e-5, rtol=0)
    assert loss.item() == pytest.approx(ref_loss.item(), abs=1e-5)
    assert m["loss/forecast"] > 0 and abs(m["loss/pg"]) > 0
    for k in ("loss/pg", "loss/forecast", "forecast/tokens"):
        assert float(m[k]) == pytest.approx(float(ref_m[k]), abs=1e-5), k
    assert all(g.abs().sum() > 0 for g in grads)
    for a, b in zip(grads, ref_grads):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_the_callbacks_pack_trees_and_leave_the_attention_alone():
    """``algo=cope cope.update=joint`` and ``algo=cope_continuation``: the transform's rows are prefix trees (their
    identity packing); the model's attention is the DataModule's to switch (``data.share_prefix``), not theirs."""
    from types import SimpleNamespace

    from cope.algos.cope.forecast_targets import ForecastTargets
    from cope.algos.cope.forecasts import CopeForecasts

    eps = _episodes()
    for cb in (CopeForecasts(update="joint"), ForecastTargets()):
        model, fns = _model("qwen2"), []
        dm = SimpleNamespace(add_collate_transform=fns.append, add_batch_source=None, epoch=0)
        policy = SimpleNamespace(chat=CHAT, pad_id=PAD, tokenizer=FakeTokenizer(), model=model)
        module = SimpleNamespace(policy=policy, objectives=[ForecastLoss(update="joint")], max_tokens_per_microbatch=None)
        cb.setup(SimpleNamespace(datamodule=dm, global_rank=0), module, "fit")
        assert model.get_base_model().config._attn_implementation == "sdpa"
        out = fns[0](collate(eps, PAD), eps)
        assert out["packed"].tree is not None and out["packed"].members == tuple((r,) for r in range(len(eps)))
