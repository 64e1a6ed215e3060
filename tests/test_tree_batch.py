"""Shared-prefix rows in a batch (``cope.train.tree_batch``): packing trunk + branches by hand, an empty trunk, the
layout of a micro-batch, and a batch that carries its layout through Lightning's device transfer."""
from __future__ import annotations

import types

import pytest
import torch
from lightning.fabric.utilities.apply_func import move_data_to_device

from cope.train.tree_attention import NAME
from cope.train.tree_batch import batch_tree_layout, pack_branches, split_to_fit
from cope.train.tree_layout import TreeLayout

PAD = 0


def test_pack_branches_by_hand():
    """Row 0: trunk [11 12 13], a branch after 2 trunk tokens and one after all 3; row 1: no trunk, one root branch."""
    packed = pack_branches([([11, 12, 13], [(2, [21, 22]), (3, [31])]), ([], [(0, [41, 42])])], PAD)
    assert packed.input_ids.tolist() == [[11, 12, 13, 21, 22, 31], [41, 42, PAD, PAD, PAD, PAD]]
    assert packed.attention_mask.tolist() == [[1] * 6, [1, 1, 0, 0, 0, 0]]
    assert packed.position_ids.tolist() == [[0, 1, 2, 2, 3, 3], [0, 1, 0, 0, 0, 0]]
    assert packed.starts == ((3, 5), (0,))
    assert packed.layout == TreeLayout.from_lists([[(0, 3, -1, 0), (3, 5, 0, 2), (5, 6, 0, 3)], [(0, 2, -1, 0)]], length=6)
    # each branch with what it sees is the sequence it stands for
    assert [[packed.input_ids[0, s].tolist() for s in seqs] for seqs in packed.layout.unshared()[:1]] == [
        [[11, 12, 13], [11, 12, 21, 22], [11, 12, 13, 31]]]


def test_filled_rows_hold_several_trees_that_see_nothing_of_each_other():
    """``fill``: the same trees, longest first, side by side in rows no longer than the longest (6 tokens); each tree
    restarts its positions and sees only itself, so every node's sequence is what it is unfilled."""
    rows = [([11, 12, 13], [(2, [21, 22]), (3, [31])]), ([], [(0, [41, 42])]), ([51, 52], [(1, [61])])]
    plain, filled = pack_branches(rows, PAD), pack_branches(rows, PAD, fill=True)
    assert filled.row_of == (0, 1, 1) and filled.offset == (0, 3, 0)  # tree 2 (3 tokens) first in row 1, then tree 1
    assert filled.input_ids.tolist() == [[11, 12, 13, 21, 22, 31], [51, 52, 61, 41, 42, PAD]]
    assert filled.position_ids.tolist() == [[0, 1, 2, 2, 3, 3], [0, 1, 1, 0, 1, 0]]
    assert filled.starts == ((3, 5), (3,), (2,))
    assert filled.layout.rows[1] == tuple(TreeLayout.from_lists([[(0, 2, -1, 0), (2, 3, 0, 1), (3, 5, -1, 0)]]).rows[0])
    def seqs(packed, r):  # the sequence each node of row r stands for, as ids
        return [packed.input_ids[r, q].tolist() for q in packed.layout.unshared()[r]]

    assert seqs(filled, 0) == seqs(plain, 0) and seqs(filled, 1) == seqs(plain, 2) + seqs(plain, 1)
    assert int(filled.layout.dense_mask()[1, 0, 3:5, :3].sum()) == 0  # tree 1 sees nothing of tree 2


@pytest.mark.parametrize("rows,match", [
    ([([1, 2], [(3, [5])])], r"0 <= anchor=3 <= len\(trunk\)=2"),
    ([([1, 2], [(1, [])])], "needs ids"),
    ([([], [(1, [5])])], r"anchor=1 <= len\(trunk\)=0"),
    ([([], [])], "row 0 is empty"),
    ([], "at least one row"),
])
def test_pack_branches_refuses_what_it_cannot_lay_out(rows, match):
    with pytest.raises(ValueError, match=match):
        pack_branches(rows, PAD)


def _model(impl: str):
    return types.SimpleNamespace(config=types.SimpleNamespace(_attn_implementation=impl))


def test_batch_tree_layout_cuts_rows_and_columns():
    packed = pack_branches([([1, 2, 3], [(1, [4])]), ([5], [(1, [6, 7, 8, 9])]), ([1], [(0, [2])])], PAD)
    batch = {"input_ids": packed.input_ids, "tree_layout": packed.layout}
    assert batch_tree_layout(_model(NAME), batch) is packed.layout
    part = batch_tree_layout(_model(NAME), batch, torch.tensor([0, 2]), 4)
    assert part == TreeLayout(rows=(packed.layout.rows[0], packed.layout.rows[2]), length=4)
    assert batch_tree_layout(_model("sdpa"), {"input_ids": packed.input_ids}) is None  # no layout: nothing to check
    with pytest.raises(ValueError, match="would ignore the layout"):
        batch_tree_layout(_model("sdpa"), batch)


def test_a_layer_checkpointed_model_does_not_recompute_the_tiles_again(monkeypatch):
    """Under the model's own layer checkpointing (the 7B preset) the tile calls are not checkpointed inside it too (that
    would add a forward for no memory); without it they are (``TreeLayout.recompute``)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    import cope.train.tree_attention as tree_attention

    tree_attention.register()
    model = LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                         num_key_value_heads=2, vocab_size=16, attn_implementation=NAME))
    model.train()
    packed = pack_branches([([1, 2, 3, 4, 5], [(2, [6, 7]), (5, [8, 9, 10])])], PAD)
    batch = {"input_ids": packed.input_ids, "tree_layout": packed.layout}
    calls = []
    real = tree_attention.checkpoint
    monkeypatch.setattr(tree_attention, "checkpoint", lambda *a, **k: calls.append(1) or real(*a, **k))
    for checkpointed in (False, True):
        if checkpointed:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        layout = batch_tree_layout(model, batch)
        assert layout.recompute is not checkpointed and layout.rows == packed.layout.rows
        calls.clear()
        model(packed.input_ids, position_ids=layout.position_ids(), tree_layout=layout, use_cache=False).logits.sum().backward()
        assert bool(calls) is not checkpointed  # one checkpointed tile call per layer forward, or none
    off = {"input_ids": packed.input_ids, "tree_layout": TreeLayout(rows=packed.layout.rows, length=packed.layout.length,
                                                                    recompute=False)}
    model.gradient_checkpointing_disable()
    assert batch_tree_layout(model, off).recompute is False  # asked off stays off


def test_split_to_fit_by_hand():
    size = {0: 4, 1: 3, 2: 9, 3: 1, 4: 2}.__getitem__
    cost = lambda group: 2 + sum(size(i) for i in group)  # noqa: E731  (a shared prefix of 2, then each item)
    assert split_to_fit([0, 1, 2, 3, 4], cost, 10) == [[0, 1], [2], [3, 4]]  # 2 alone is over the cap: its own group
    assert split_to_fit([0, 1, 2, 3, 4], cost, None) == [[0, 1, 2, 3, 4]]


def test_a_batch_moves_with_its_layout():
    """Lightning moves a batch with ``.to``; a frozen dataclass without it made the transfer raise."""
    packed = pack_branches([([1, 2, 3], [(2, [4, 5])])], PAD)
    batch = {"kind": "forecast", "input_ids": packed.input_ids, "tree_layout": packed.layout}
    moved = move_data_to_device(batch, torch.device("cpu"))
    assert moved["tree_layout"] is packed.layout and torch.equal(moved["input_ids"], packed.input_ids)
