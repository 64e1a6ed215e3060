"""The packed batch (``cope.train.packing.tree_batch``): the one packer by hand, rows filled with several trees, the branch
convention, the identity packing of a plain batch, the one place that decides how a model attends a tree, and a
batch that carries its packed rows through Lightning's device transfer."""
from __future__ import annotations

import types

import pytest
import torch
from lightning.fabric.utilities.apply_func import move_data_to_device

from cope.train.packing.prefix_tree import PrefixTree, TreeNode
from cope.train.packing.tree_attention import NAME
from cope.train.packing.tree_batch import PackedRows, Unit, attention_kwargs, branch, pack, packed_view, split_to_fit

PAD = 0


def _tree_unit(trunk: list[int], branches: list[tuple[int, list[int]]], row: int | None = None) -> Unit:
    """Trunk + branches ``(anchor, ids)`` (each branch sees ``anchor`` trunk tokens); ``row``: a logical row holding
    every token of the unit in order."""
    seq, nodes = list(trunk), [TreeNode(0, len(trunk), -1, 0)] if trunk else []
    for anchor, ids in branches:
        nodes.append(TreeNode(len(seq), len(seq) + len(ids), 0 if trunk else -1, anchor))
        seq += ids
    return Unit(seq, tuple(nodes), () if row is None else ((row, list(range(len(seq)))),))


def test_pack_by_hand():
    """Unit 0: trunk [11 12 13], a branch after 2 trunk tokens and one after all 3; unit 1: no trunk, one root."""
    packed = pack([_tree_unit([11, 12, 13], [(2, [21, 22]), (3, [31])]), _tree_unit([], [(0, [41, 42])])], 0, 0, PAD, cap=6)
    assert packed.input_ids.tolist() == [[11, 12, 13, 21, 22, 31], [41, 42, PAD, PAD, PAD, PAD]]
    assert packed.attention_mask.tolist() == [[1] * 6, [1, 1, 0, 0, 0, 0]]
    assert packed.position_ids.tolist() == [[0, 1, 2, 2, 3, 3], [0, 1, 0, 0, 0, 0]]
    assert packed.tree == PrefixTree.from_lists([[(0, 3, -1, 0), (3, 5, 0, 2), (5, 6, 0, 3)], [(0, 2, -1, 0)]], length=6)
    assert packed.lengths == (6, 2) and packed.tokens == 8
    # each branch with what it sees is the sequence it stands for
    assert [packed.input_ids[0, s].tolist() for s in packed.tree.unshared()[0]] == [[11, 12, 13], [11, 12, 21, 22], [11, 12, 13, 31]]


def test_filled_rows_hold_several_trees_that_see_nothing_of_each_other():
    """The units, longest first, side by side in rows no longer than the longest (6 tokens); each tree restarts its
    positions and sees only itself; ``index`` finds every logical row's tokens where they landed."""
    units = [_tree_unit([11, 12, 13], [(2, [21, 22]), (3, [31])], 0), _tree_unit([], [(0, [41, 42])], 1),
             _tree_unit([51, 52], [(1, [61])], 2)]
    filled = pack(units, 3, 6, PAD)
    assert filled.input_ids.tolist() == [[11, 12, 13, 21, 22, 31], [51, 52, 61, 41, 42, PAD]]
    assert filled.position_ids.tolist() == [[0, 1, 2, 2, 3, 3], [0, 1, 1, 0, 1, 0]]
    assert filled.members == ((0,), (2, 1))
    assert filled.tree.rows[1] == PrefixTree.from_lists([[(0, 2, -1, 0), (2, 3, 0, 1), (3, 5, -1, 0)]]).rows[0]
    assert filled.index[1, :2].tolist() == [6 + 3, 6 + 4] and filled.index[1, 2:].tolist() == [-1] * 4
    assert int(filled.tree.dense_mask()[1, 0, 3:5, :3].sum()) == 0  # tree 1 sees nothing of tree 2
    assert [(r.tolist(), n) for r, n in filled.micro_batches(6)] == [([0], 6), ([1, 2], 3)]
    with pytest.raises(ValueError, match="not whole packed rows"):
        filled.span(torch.tensor([1]))


def test_branch_repeats_the_token_before_its_anchor():
    assert branch([5, 6, 7, 8], 3, [9, 10]) == (2, [7, 9, 10])  # tokens[:3] + [9, 10]: 7 repeated after 2 tokens
    with pytest.raises(ValueError, match="anchors after 1..4 tokens"):
        branch([5, 6, 7, 8], 0, [9])


def test_a_plain_batch_is_its_own_packing():
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    batch = {"input_ids": torch.tensor([[1, 2, 3], [4, 5, 0]]), "attention_mask": mask, "position_ids": torch.zeros(2, 3),
             "action_mask": mask.bool()}
    view = packed_view(batch)
    assert view.tree is None and view.members == ((0,), (1,)) and view.lengths == (3, 2)
    assert view.index.tolist() == [[0, 1, 2], [3, 4, -1]]
    assert [(r.tolist(), n) for r, n in view.micro_batches(4)] == [([0], 3), ([1], 2)]
    assert packed_view({**batch, "packed": view}) is view


def _model(impl: str, checkpointing: bool = False):
    weight = torch.nn.Parameter(torch.zeros(1))
    return types.SimpleNamespace(config=types.SimpleNamespace(_attn_implementation=impl), parameters=lambda: iter([weight]),
                                 is_activation_checkpointing=checkpointing)


def test_one_place_decides_how_a_tree_is_attended():
    """Tree attention passes the tree; any other attention gets the tree's dense mask (the reference); a model that
    checkpoints its layers does not recompute the tile calls too; no tree: the padding mask."""
    tree = PrefixTree.from_lists([[(0, 3, -1, 0), (3, 5, 0, 2)]])
    mask = torch.ones(1, 5, dtype=torch.long)
    kw = attention_kwargs(_model(NAME), mask, tree)
    assert kw["prefix_tree"] is tree and kw["attention_mask"] is mask
    assert attention_kwargs(_model(NAME, checkpointing=True), mask, tree)["prefix_tree"].recompute is False
    assert torch.equal(attention_kwargs(_model("sdpa"), mask, tree)["attention_mask"], tree.dense_mask())
    additive = attention_kwargs(_model("eager"), mask, tree)["attention_mask"]
    assert torch.equal(additive == 0, tree.dense_mask())
    assert attention_kwargs(_model("sdpa"), mask, None) == {"attention_mask": mask}


def test_split_to_fit_by_hand():
    size = {0: 4, 1: 3, 2: 9, 3: 1, 4: 2}.__getitem__
    cost = lambda group: 2 + sum(size(i) for i in group)  # noqa: E731  (a shared prefix of 2, then each item)
    assert split_to_fit([0, 1, 2, 3, 4], cost, 10) == [[0, 1], [2], [3, 4]]  # 2 alone is over the cap: its own group
    assert split_to_fit([0, 1, 2, 3, 4], cost, None) == [[0, 1, 2, 3, 4]]


def test_a_batch_moves_with_its_packed_rows():
    """Lightning moves a batch with ``.to``; a frozen dataclass without it made the transfer raise."""
    packed = pack([_tree_unit([1, 2, 3], [(2, [4, 5])])], 0, 0, PAD).as_rows()
    batch = {"kind": "forecast", "input_ids": packed.input_ids, "packed": packed}
    moved = move_data_to_device(batch, torch.device("cpu"))
    assert isinstance(moved["packed"], PackedRows) and moved["packed"].tree is packed.tree
    assert torch.equal(moved["packed"].index, packed.index) and torch.equal(moved["input_ids"], packed.input_ids)
