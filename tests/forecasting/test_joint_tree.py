"""CoPE's joint update with tree attention (``cope.update=joint cope.packing=packed``, ``cope.share_prefix=true``):
the packed rows carry a :class:`~cope.train.tree_layout.TreeLayout` instead of the dense segment mask. The layout says
exactly what the segment mask says; the scoring pass's old log-probs, the policy-gradient plus forecast loss and every
LoRA gradient equal the dense reference's, on Qwen2 and Llama, whole and micro-batched, at T = 1 and T = 0.7; the
continuation reading's packed rows (``algo=cope_continuation``) likewise."""
from __future__ import annotations

import pytest
import torch
from prompted_fixtures import CHAT, FakeTokenizer, reference_episode, simple_episode
from tiny_fixtures import exactness_model, exactness_module, scored_step

from cope.algos.cope.chunks import build_chunks
from cope.algos.cope.layouts import pack_forecasts
from cope.algos.cope.loss import ForecastLoss
from cope.algos.cope.prompted import PlanPrompt, build_prompted
from cope.algos.grpo import PolicyGradient
from cope.train.batch import SEGMENT_KEYS, collate, segment_attention
from cope.train.group_prefix import pack_groups
from cope.train.tree_batch import use_tree_attention

PAD = 0


def _model(arch: str = "qwen2"):
    return exactness_model(arch, vocab_size=128)


def _episodes():
    """Rewards differ inside group 1 (a policy gradient); one episode with no sample (the loss)."""
    eps = [reference_episode(), simple_episode(3, 1.0, group=1), simple_episode(2, 1.0, group=1), simple_episode(2, 0.0, group=1)]
    for e, adv in zip(eps, (0.5, 0.8, -0.3, -0.6)):
        e.advantage = adv
    return eps


def _batches(eps, reading: str):
    """The same minibatch packed twice: tree layout and segment mask."""
    base = collate(eps, PAD)
    if reading == "authors":
        chunks, _ = build_prompted(eps, CHAT, PlanPrompt(FakeTokenizer()), K=3)
    else:  # the continuation reading: the next K actions in place, wins only
        chunks, _ = build_chunks(eps, CHAT, K=3)
    assert chunks and {c.episode for c in chunks} != set(range(len(eps)))  # some row has no segment
    return pack_forecasts(base, eps, chunks, PAD, tree=True), pack_forecasts(base, eps, chunks, PAD)


def test_the_tree_says_what_the_segment_mask_says():
    """Every real token attends the same keys at the same positions; the tree batch has no segment keys and the
    segment batch no layout; an anchor at position 1 (a segment that sees no transcript) is a node of its own."""
    eps = _episodes()
    for reading in ("authors", "continuation"):
        tree, dense = _batches(eps, reading)
        layout = tree["tree_layout"]
        assert not any(k in tree for k in SEGMENT_KEYS) and "tree_layout" not in dense
        assert layout.length == tree["input_ids"].shape[1]
        for k in ("input_ids", "attention_mask", "position_ids", "forecast_mask", "forecast_chunk", "action_mask"):
            assert torch.equal(tree[k], dense[k]), k
        assert torch.equal(layout.position_ids()[tree["attention_mask"] != 0], tree["position_ids"][tree["attention_mask"] != 0])
        real = dense["attention_mask"].bool()
        keep = segment_attention(*(dense[k] for k in SEGMENT_KEYS))[:, 0]  # (N, T, T)
        mine = layout.dense_mask()[:, 0]
        assert torch.equal(mine[real], keep[real])
    empty = pack_forecasts(collate(eps, PAD), eps, [], PAD, tree=True)
    assert "tree_layout" not in empty and not any(k in empty for k in SEGMENT_KEYS)


def _module(model, temperature, budget):
    return exactness_module(model, [PolicyGradient(), ForecastLoss(weight=1.0, update="joint")], CHAT, temperature, budget)


@pytest.mark.parametrize("fill", [False, True])  # True: the trees side by side, the module's packed view (the default)
@pytest.mark.parametrize("reading", ["authors", "continuation"])
@pytest.mark.parametrize("budget", [None, 60])  # 60 tokens: micro-batches of one or two rows, columns cut short
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_joint_tree_equals_the_segment_mask(arch, temperature, budget, reading, fill):
    model, eps = _model(arch), _episodes()
    module = _module(model, temperature, budget)
    tree, dense = _batches(eps, reading)
    if fill:
        tree = pack_groups(tree, eps, share=False)
        pack = tree["row_pack"]
        assert len(pack.lengths) < tree["input_ids"].shape[0] and pack.tokens == int(tree["attention_mask"].sum())
    if budget is not None:
        assert len(module.micro_batches(tree)) > 1
    ref_old, _, ref_loss, ref_m, ref_grads = scored_step(module, dense)  # reference: SDPA with the dense segment mask
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


@pytest.mark.parametrize("share", [True, False])
def test_the_callbacks_switch_the_model_and_pack_trees_when_sharing(share):
    """``algo=cope cope.update=joint`` and ``algo=cope_continuation``: with ``share_prefix`` the callback switches the
    model to tree attention at setup and its transform packs trees; without, the model stays on SDPA and the rows
    carry the segment mask."""
    from types import SimpleNamespace

    from cope.algos.cope.forecast_targets import ForecastTargets
    from cope.algos.cope.forecasts import CopeForecasts
    from cope.train.tree_attention import NAME

    eps = _episodes()
    for cb in (CopeForecasts(update="joint", share_prefix=share), ForecastTargets(share_prefix=share)):
        model, fns = _model("qwen2"), []
        dm = SimpleNamespace(add_collate_transform=fns.append, add_batch_source=None, epoch=0)
        policy = SimpleNamespace(chat=CHAT, pad_id=PAD, tokenizer=FakeTokenizer(), model=model)
        module = SimpleNamespace(policy=policy, objectives=[ForecastLoss(update="joint")])
        cb.setup(SimpleNamespace(datamodule=dm, global_rank=0), module, "fit")
        assert model.get_base_model().config._attn_implementation == (NAME if share else "sdpa")
        out = fns[0](collate(eps, PAD), eps)
        assert ("tree_layout" in out) == share == ("row_pack" in out) and all((k in out) != share for k in SEGMENT_KEYS)
