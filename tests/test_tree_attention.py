"""Tree (shared-prefix) attention: the layout's mask and positions equal hand-written ones; the tiles kernel equals
SDPA with the dense mask in value and gradient; whole Llama/Qwen2 models (and a LoRA adapter) under "cope_tree"
give every token the logits and gradients of its unshared sequence; without a layout the model is plain SDPA."""
from __future__ import annotations

import functools
import types

import pytest
import torch
import torch.nn.functional as F
from peft import LoraConfig, get_peft_model
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

import cope.train.packing.prefix_tree as prefix_tree
import cope.train.packing.tree_attention as tree_attention
from cope.train.packing.prefix_tree import PrefixTree, ScoreCells
from cope.train.packing.tree_attention import NAME, flex_tree_attention, register, tree_attention_forward, tree_mask_mod

V = 128


def grid(*rows: str) -> torch.Tensor:
    """A hand-written (T, T) mask: '1' = attend."""
    return torch.tensor([[c == "1" for c in r] for r in rows])


# Each case: rows of (start, end, parent, anchor), length, per row the hand-written mask and positions.
CASES = {
    "branch_at_1": ([[(0, 4, -1, 0), (4, 6, 0, 1)]], 6,
                    [(("1.....", "11....", "111...", "1111..", "1...1.", "1...11"), [0, 1, 2, 3, 1, 2])]),
    "branch_at_end": ([[(0, 4, -1, 0), (4, 6, 0, 4)]], 6,
                      [(("1.....", "11....", "111...", "1111..", "11111.", "111111"), [0, 1, 2, 3, 4, 5])]),
    "no_branch": ([[(0, 4, -1, 0)]], 4, [(("1...", "11..", "111.", "1111"), [0, 1, 2, 3])]),
    # root [0,3); child [5,7) sees root[:2]; grandchild [3,5) (before its parent in memory) sees root[:2] + child[:1];
    # great-grandchild [7,8) sees all that + grandchild[:2].
    "four_levels": ([[(0, 3, -1, 0), (5, 7, 0, 2), (3, 5, 1, 1), (7, 8, 2, 2)]], 8,
                    [(("1.......", "11......", "111.....", "11.1.1..", "11.111..", "11...1..", "11...11.", "11.111.1"),
                      [0, 1, 2, 3, 4, 2, 3, 5])]),
    # row 0: a branch that sees the whole root, then padding; row 1: two roots (independent trees), a branch of the
    # second one, padding.
    "two_rows_padding": ([[(0, 3, -1, 0), (3, 5, 0, 3)], [(0, 2, -1, 0), (2, 4, -1, 0), (4, 5, 1, 1)]], 6,
                         [(("1.....", "11....", "111...", "1111..", "11111.", ".....1"), [0, 1, 2, 3, 4, 0]),
                          (("1.....", "11....", "..1...", "..11..", "..1.1.", ".....1"), [0, 1, 0, 1, 1, 0])]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_dense_mask_and_positions_by_hand(case):
    rows, length, want = CASES[case]
    layout = PrefixTree.from_lists(rows, length=length)
    assert torch.equal(layout.dense_mask(), torch.stack([grid(*m) for m, _ in want])[:, None])
    assert layout.position_ids().tolist() == [p for _, p in want]
    # FlexAttention's mask_mod (the CUDA kernel) is the same mask
    from torch.nn.attention.flex_attention import create_mask

    assert torch.equal(create_mask(tree_mask_mod(layout, "cpu"), len(rows), 1, length, length, device="cpu"), layout.dense_mask())


def test_unshared_and_its_positions():
    rows, length, _ = CASES["four_levels"]
    layout = PrefixTree.from_lists(rows, length=length)
    assert layout.unshared() == [[[0, 1, 2], [0, 1, 5, 6], [0, 1, 5, 3, 4], [0, 1, 5, 3, 4, 7]]]
    pos = layout.position_ids()[0]
    for seq in layout.unshared()[0]:  # each token sits at its index in its unshared sequence
        assert pos[seq[-1]] == len(seq) - 1


@pytest.mark.parametrize("rows,length,match", [
    ([[(0, 4, -1, 0), (3, 5, 0, 1)]], None, "overlap"),
    ([[(0, 4, -1, 0), (4, 6, 0, 5)]], None, r"anchor must be in \[0, 4\]"),
    ([[(0, 4, -1, 0), (4, 6, 2, 1), (6, 7, 0, 1)]], None, "list parents before children"),
    ([[(0, 4, -1, 1)]], None, "set its anchor to 0"),
    ([[(0, 6, -1, 0)]], 5, "start < end <= length=5"),
    ([[(0, 4, -1, 0), (4, 4, 0, 1)]], None, "non-empty"),
    ([[(0, 4, -1, 0)], []], None, "row 1 has no node"),
])
def test_invalid_layouts_name_the_fix(rows, length, match):
    with pytest.raises(ValueError, match=match):
        PrefixTree.from_lists(rows, length=length)


def test_score_cells_by_hand():
    """Trunk of 200, ten 8-token branches anchored at 20, 40, ..., 200 (keys 28..208). The trunk is one causal call
    (200*201/2 = 20100). Branch tiles, largest keys first, are grouped while padded <= 1.25x own cells:
    {208,188,168,148,128} -> 5*8*208 = 8320, {108,88,68} -> 3*8*108 = 2592, {48} -> 384, {28} -> 224."""
    rows = [[(0, 200, -1, 0)] + [(200 + 8 * i, 208 + 8 * i, 0, 20 * (i + 1)) for i in range(10)]]
    cells = PrefixTree.from_lists(rows).score_cells()
    visible = 20100 + sum(8 * 20 * (i + 1) + 36 for i in range(10))  # each branch: 8*anchor + 8*9/2
    assert cells == ScoreCells(tree=20100 + 8320 + 2592 + 384 + 224, visible=visible, dense=280 * 280)
    assert cells.tree == 31620 and cells.tree < 0.41 * cells.dense


def _random_layout_rows() -> list[list[tuple[int, int, int, int]]]:
    """Two rows with the same 40-token root (one causal call for both), 3-level branches, padding in the middle and
    at the end, and a row-1-only second root."""
    row0 = [(0, 40, -1, 0), (40, 53, 0, 7), (53, 60, 0, 40), (60, 71, 1, 5), (71, 74, 3, 11), (74, 80, 0, 1)]
    row1 = [(0, 40, -1, 0), (45, 60, 0, 22), (60, 66, -1, 0), (66, 75, 2, 3), (75, 78, 1, 15)]
    return [row0, row1]


@pytest.mark.parametrize("tile", [prefix_tree.TILE, 4])
@pytest.mark.parametrize("rows,length", [
    (CASES["two_rows_padding"][0], 6),
    (_random_layout_rows(), 82),
    ([[(0, 10, -1, 0), (10, 300, 0, 5)]], 300),  # a 290-token branch: several tiles at the default size
])
@pytest.mark.parametrize("recompute", [True, False])
def test_kernel_equals_dense_sdpa(monkeypatch, tile, rows, length, recompute):
    monkeypatch.setattr(prefix_tree, "TILE", tile)
    layout = PrefixTree.from_lists(rows, length=length).replace(recompute=recompute)
    torch.manual_seed(0)
    N, T = len(rows), length
    q, k, v = (torch.randn(N, h, T, 8, requires_grad=True) for h in (6, 2, 2))  # GQA: 6 query heads, 2 kv heads
    out, weights = tree_attention_forward(types.SimpleNamespace(num_key_value_groups=3), q, k, v, None, prefix_tree=layout)
    assert weights is None and out.shape == (N, T, 6, 8)
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=layout.dense_mask(), enable_gqa=True).transpose(1, 2)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    g = torch.randn_like(out)
    for a, b in zip(torch.autograd.grad(out, (q, k, v), g), torch.autograd.grad(ref, (q, k, v), g)):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    if tile == 4 and N == 2 and T == 82:
        assert len(layout.plan().groups) >= 3, "the case should exercise several padded tile groups"


def _saved_bytes(fn) -> tuple[int, torch.Tensor]:
    """Bytes of the tensors autograd keeps for backward while ``fn()`` builds its graph (storages counted once), and
    the attention output (``fn()[0]``)."""
    live: dict[int, int] = {}

    def pack(t):
        live[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()[0]
    return sum(live.values()), out


def test_recompute_keeps_only_qkv_for_backward():
    """A separate CoPE step's row: a 200-token trunk and 12 samples branching along it. Kept, every branch tile holds
    its own copy of the trunk's keys and values; recomputed, backward keeps little more than q, k, v themselves."""
    rows = [[(0, 200, -1, 0), *((200 + 20 * i, 220 + 20 * i, 0, 15 * (i + 1)) for i in range(12))]]
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, h, 440, 16, requires_grad=True) for h in (6, 2, 2))
    qkv = sum(x.numel() * 4 for x in (q, k, v))
    mod = types.SimpleNamespace(num_key_value_groups=3)
    got = {}
    for recompute in (True, False):
        layout = PrefixTree.from_lists(rows, length=440).replace(recompute=recompute)
        got[recompute], out = _saved_bytes(functools.partial(tree_attention_forward, mod, q, k, v, None, prefix_tree=layout))
        out.sum().backward()  # the recomputed graph still backpropagates
    assert got[True] < 1.5 * qkv < 2 * got[True] < got[False], (got, qkv)


def test_recompute_replays_attention_dropout():
    """With attention dropout the recomputed tile calls draw the forward's dropout masks again: the same output and
    gradients as keeping them, under the same seed."""
    rows = _random_layout_rows()
    got = []
    for recompute in (True, False):
        layout = PrefixTree.from_lists(rows, length=82).replace(recompute=recompute)
        torch.manual_seed(0)
        q, k, v = (torch.randn(2, h, 82, 8, requires_grad=True) for h in (6, 2, 2))
        torch.manual_seed(1)
        out = tree_attention_forward(types.SimpleNamespace(num_key_value_groups=3), q, k, v, None, dropout=0.3,
                                     prefix_tree=layout)[0]
        torch.manual_seed(2)  # backward (the recompute) runs under another RNG state
        got.append([out, *torch.autograd.grad(out, (q, k, v), torch.ones_like(out))])
    for a, b in zip(*got):
        torch.testing.assert_close(a, b, atol=0, rtol=0)


def test_kernel_in_bf16_is_as_close_to_fp32_as_dense_sdpa():
    """bf16 (``trainer.precision=bf16-mixed`` autocasts q, k, v to bf16): the tiles kernel's output and gradients are
    no further from the fp32 reference than the dense-mask SDPA call in bf16 is (same inputs, same rounding)."""
    layout = PrefixTree.from_lists(_random_layout_rows(), length=82)
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, h, 82, 16) for h in (6, 2, 2))
    g = torch.randn(2, 82, 6, 16)
    mod = types.SimpleNamespace(num_key_value_groups=3)

    def run(dtype, tree):
        x = [t.to(dtype).requires_grad_() for t in (q, k, v)]
        if tree:
            out = tree_attention_forward(mod, *x, None, prefix_tree=layout)[0]
        else:
            out = F.scaled_dot_product_attention(*x, attn_mask=layout.dense_mask(), enable_gqa=True).transpose(1, 2)
        return [out.float(), *(t.float() for t in torch.autograd.grad(out, x, g.to(dtype)))]

    ref, dense, tiles = run(torch.float32, False), run(torch.bfloat16, False), run(torch.bfloat16, True)
    for name, r, d, t in zip(("out", "dq", "dk", "dv"), ref, dense, tiles):
        assert t.dtype == torch.float32 and torch.isfinite(t).all()
        err_dense, err_tiles = (r - d).abs().max().item(), (r - t).abs().max().item()
        assert err_tiles <= 2 * err_dense + 1e-2, (name, err_tiles, err_dense)
        assert err_tiles > 0  # really ran in bf16


@pytest.mark.filterwarnings("ignore:.*flex_attention called without torch.compile.*")
def test_flex_kernel_forward_on_cpu():
    """The flex kernel (not selectable in training; called directly) on CPU, forward only (no CPU backward)."""
    layout = PrefixTree.from_lists(_random_layout_rows(), length=82)
    q, k, v = (torch.randn(2, h, 82, 8) for h in (6, 2, 2))
    out = flex_tree_attention(layout, q, k, v)
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=layout.dense_mask(), enable_gqa=True).transpose(1, 2)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (FlexAttention kernel)")
def test_flex_kernel_equals_dense_on_cuda():
    layout = PrefixTree.from_lists(_random_layout_rows(), length=82)
    q, k, v = (torch.randn(2, h, 82, 64, device="cuda", requires_grad=True) for h in (6, 2, 2))
    out = flex_tree_attention(layout, q, k, v)
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=layout.dense_mask("cuda"), enable_gqa=True).transpose(1, 2)
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)
    g = torch.randn_like(out)
    for a, b in zip(torch.autograd.grad(out, (q, k, v), g), torch.autograd.grad(ref, (q, k, v), g)):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


def _model(kind: str) -> torch.nn.Module:
    register()
    torch.manual_seed(0)
    kw = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=V)
    if kind == "llama":  # switched after building
        model = LlamaForCausalLM(LlamaConfig(**kw))
        model.set_attn_implementation(NAME)
    else:  # built with it
        model = Qwen2ForCausalLM(Qwen2Config(**kw, attn_implementation=NAME))
    assert model.config._attn_implementation == NAME
    return model.float()


MODEL_ROWS = [[(0, 10, -1, 0), (10, 14, 0, 3), (14, 18, 0, 10), (18, 21, 1, 2)],  # then padding 21..23
              [(0, 8, -1, 0), (11, 15, 0, 8), (15, 20, 1, 4)]]  # padding 8..10 and 20..23


def _branch_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return -logits.log_softmax(-1).gather(-1, targets[..., None]).sum()


def _unshared(model, layout, ids, targets, impl):
    """Per node: its own tokens' logits when its unshared sequence runs alone; and the summed branch loss."""
    model.set_attn_implementation(impl)
    logits, loss = {}, 0.0
    for r, (nodes, seqs) in enumerate(zip(layout.rows, layout.unshared())):
        for i, (n, seq) in enumerate(zip(nodes, seqs)):
            own = model(ids[r, seq][None], use_cache=False).logits[0, -(n.end - n.start):]  # (len, V)
            logits[r, i] = own
            if n.parent >= 0:
                loss = loss + _branch_loss(own, targets[r, n.start:n.end])
    model.set_attn_implementation(NAME)
    return logits, loss


def _packed(model, layout, ids, targets):
    logits = model(ids, position_ids=layout.position_ids(), prefix_tree=layout, use_cache=False).logits  # (N, T, V)
    loss = sum(_branch_loss(logits[r, n.start:n.end], targets[r, n.start:n.end])
               for r, nodes in enumerate(layout.rows) for n in nodes if n.parent >= 0)
    return logits, loss


def _grads(params: list[torch.Tensor], loss: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return torch.autograd.grad(loss, params)


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_model_logits_and_grads_equal_unshared(monkeypatch, kind):
    monkeypatch.setattr(prefix_tree, "TILE", 3)  # several tiles per branch, several groups
    model = _model(kind)
    layout = PrefixTree.from_lists(MODEL_ROWS, length=24)
    g = torch.Generator().manual_seed(1)
    ids, targets = torch.randint(0, V, (2, 24), generator=g), torch.randint(0, V, (2, 24), generator=g)
    params = list(model.parameters())
    with monkeypatch.context() as m:
        # The layout must reach the kernel in both layers, and no (T, T) mask may be built on the way.
        calls, tiles = [], tree_attention._tile_attention
        m.setattr(tree_attention, "_tile_attention", lambda *a: calls.append(1) or tiles(*a))
        m.setattr(tree_attention, "sdpa_mask", lambda **kw: pytest.fail("the tree path built a dense mask"))
        packed, loss = _packed(model, layout, ids, targets)
    assert len(calls) == 2
    for impl in ("sdpa", "eager"):
        alone, alone_loss = _unshared(model, layout, ids, targets, impl)
        for (r, i), own in alone.items():
            n = layout.rows[r][i]
            torch.testing.assert_close(packed[r, n.start:n.end], own, atol=1e-5, rtol=1e-5)
        if impl == "sdpa":
            for a, b in zip(_grads(params, loss), _grads(params, alone_loss)):
                torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_lora_grads_equal_unshared():
    """The trainer's setup: a LoRA adapter (peft forwards **kwargs) and non-reentrant gradient checkpointing."""
    base = _model("llama")
    base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    base.train()
    for p in base.parameters():
        p.requires_grad_(False)
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", lora_dropout=0.0))
    for n, p in model.named_parameters():  # move the adapter off zero so gradients reach every path
        if "lora_B" in n:
            torch.nn.init.normal_(p, std=0.05)
    layout = PrefixTree.from_lists(MODEL_ROWS, length=24)
    g = torch.Generator().manual_seed(2)
    ids, targets = torch.randint(0, V, (2, 24), generator=g), torch.randint(0, V, (2, 24), generator=g)
    params = [p for p in model.parameters() if p.requires_grad]
    _, loss = _packed(model, layout, ids, targets)  # through PeftModel.forward's **kwargs
    _, alone_loss = _unshared(model.get_base_model(), layout, ids, targets, "sdpa")
    for a, b in zip(_grads(params, loss), _grads(params, alone_loss)):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_without_layout_it_is_sdpa(kind):
    """An ordinary left-padded batch (2D mask), and greedy decoding with a cache, are exactly "sdpa"."""
    model = _model(kind)
    ids = torch.randint(0, V, (2, 9), generator=torch.Generator().manual_seed(3))
    mask = torch.ones(2, 9, dtype=torch.long)
    mask[1, :4] = 0
    ours = model(ids, attention_mask=mask).logits
    gen = model.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=0)
    model.set_attn_implementation("sdpa")
    assert torch.equal(ours[mask.bool()], model(ids, attention_mask=mask).logits[mask.bool()])
    assert torch.equal(gen, model.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=0))


def test_misuse_names_the_fix():
    layout = PrefixTree.from_lists([[(0, 4, -1, 0)]])
    q = k = v = torch.zeros(1, 2, 4, 8)
    m = types.SimpleNamespace()
    with pytest.raises(ValueError, match="drop the 4D mask"):
        tree_attention_forward(m, q, k, v, torch.ones(1, 1, 4, 4, dtype=torch.bool), prefix_tree=layout)
    with pytest.raises(ValueError, match="build the tree for this batch"):
        tree_attention_forward(m, q[:, :, :3], k, v, None, prefix_tree=layout)
    with pytest.raises(ValueError, match="sliding-window"):
        tree_attention_forward(m, q, k, v, None, prefix_tree=layout, sliding_window=2)
    register()
    register()  # idempotent
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    assert AttentionInterface._global_mapping[NAME] is tree_attention_forward
    assert AttentionMaskInterface._global_mapping[NAME] is tree_attention.DeferredMask



def test_calls_are_ones_the_cuda_memory_efficient_kernel_accepts(monkeypatch):
    """Which SDPA calls the tiles kernel makes on a GQA model (4 query heads, 2 key/value heads), in the bf16 a GPU run
    uses: a causal call without a mask (flash takes it, GQA included), or a masked call with K/V repeated to the query
    heads, a boolean (G, 1, Lq, Lk) mask and one dtype (the memory-efficient kernel takes it; with ``enable_gqa`` only
    the math kernel would). ``bench/gpu_check.py --phase tree`` runs the same calls with the math kernel disabled."""
    calls = []
    original = F.scaled_dot_product_attention

    def recording(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        calls.append(dict(q=q.shape, k=k.shape, v=v.shape, dtypes={q.dtype, k.dtype, v.dtype}, is_causal=is_causal,
                          gqa=enable_gqa, mask=None if attn_mask is None else (attn_mask.dtype, attn_mask.shape)))
        return original(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale,
                        enable_gqa=enable_gqa)

    monkeypatch.setattr(F, "scaled_dot_product_attention", recording)
    model = _model("qwen2").to(torch.bfloat16)
    layout = PrefixTree.from_lists(MODEL_ROWS, length=24)
    ids = torch.randint(0, V, (2, 24), generator=torch.Generator().manual_seed(0))
    model(ids, position_ids=layout.position_ids(), prefix_tree=layout, use_cache=False).logits.float().sum().backward()
    masked = [c for c in calls if c["mask"] is not None]
    causal = [c for c in calls if c["mask"] is None]
    assert masked and causal, calls  # both kinds of call are exercised
    for c in causal:
        assert c["is_causal"], c
    for c in masked:
        dtype, shape = c["mask"]
        assert not c["gqa"] and c["q"][1] == c["k"][1] == c["v"][1] == 4, c  # heads repeated, no enable_gqa
        assert dtype == torch.bool and len(shape) == 4 and shape[1] == 1 and shape[0] == c["q"][0], c
        assert not c["is_causal"] and c["dtypes"] == {torch.bfloat16}, c
