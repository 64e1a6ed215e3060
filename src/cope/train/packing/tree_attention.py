"""Exact attention over shared-prefix packed rows (:mod:`cope.train.packing.prefix_tree`), as the transformers attention
implementation ``"cope_tree"``, computing only the blocks a query can see.

Why: the dense (N, 1, T, T) mask with SDPA costs the square of the packed row, and FlexAttention, which would skip
masked blocks, has no CPU backward in torch 2.13. Usage::

    register()                                      # once; idempotent
    model.set_attn_implementation("cope_tree")      # or attn_implementation="cope_tree" when building/loading
    model(input_ids, position_ids=tree.position_ids(ids.device), prefix_tree=tree, use_cache=False)

How the tree arrives: Llama/Qwen2-style models pass their forward's ``**kwargs`` (``TransformersKwargs``)
through the decoder layers to the attention function, so ``prefix_tree=`` reaches :func:`tree_attention_forward`.

The mask trick: transformers builds the mask with ``AttentionMaskInterface[implementation]``. For "cope_tree" that
returns a :class:`DeferredMask`, the arguments of ``sdpa_mask`` and no tensor. A forward with a tree ignores it, so
no (T, T) tensor is ever built (non-monotonic tree ``position_ids`` would otherwise make transformers build a
packed-sequence mask). A forward without one builds it once (shared by all layers) and runs transformers' own
SDPA path, so the same model serves ordinary padded batches exactly like ``"sdpa"``.

Kernels, with a tree:
* ``tiles`` (what training runs): nodes that see no ancestor token (roots) run causal SDPA on their own
  contiguous slice (the flash kernels skip blocks above the diagonal). Every other node is cut in tiles of queries;
  a tile's keys (its visible ancestor ranges, then its own keys up to the tile end) are gathered, and similar tiles
  run as one batched SDPA call with a bottom-right causal mask. Padding tokens output their own value. All torch
  ops, so autograd's gradients are exact; the (G, Lq, Lk) masks are per tile group, never (T, T). With the
  tree's ``recompute`` (the default) the tile calls are checkpointed: backward gathers and attends again rather
  than keep every tile's copy of its ancestors' keys and values (a branch tile's keys are mostly its trunk's).
* :func:`flex_tree_attention`: FlexAttention with a BlockMask whose mask_mod does the same ancestor check (no CPU
  backward in torch 2.13; compiled on CUDA, a new row length recompiles). Not selectable in a training run (no config
  key, no environment variable): only tests call it (``tests/test_tree_attention.py``). Why: the tiles kernel is the one
  whose gradients the CPU suite checks on every run; FlexAttention's backward exists only on CUDA and has not yet
  passed a GPU training run, so a switch for it would be a production path no default test covers. Once a GPU run
  shows it faster and exact, it gets one config key.
Not supported with a tree: sliding-window layers, softcapping, KV-cache decoding (a tree is for whole rows).

Kernels on CUDA (which SDPA backend each call can take): a causal call without a mask runs on flash attention, which
takes grouped K/V heads (``enable_gqa``). A masked tile call cannot: flash takes no mask, and the memory-efficient
kernel takes a mask but no ``enable_gqa``, so a masked call with grouped heads falls back to the math kernel, which
upcasts and materializes the (G, H, Lq, Lk) probabilities (slow, and at 7B with long packed rows an OOM risk). The
rule: **a masked call gets K/V repeated to the query heads first** (a boolean (G, 1, Lq, Lk) mask, q/k/v of one dtype
and head count): a call the memory-efficient kernel accepts. It costs (H / Hkv - 1) more copies of the tile's gathered
keys and values, far less than the probabilities the math kernel would hold. On CPU both forms give bit-identical
results in fp32. ``tests/test_tree_attention.py`` checks the calls' form on CPU; ``bench/gpu_check.py --phase tree``
asserts on a GPU that they run with the math kernel disabled.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from cope.train.packing.prefix_tree import PrefixTree

NAME = "cope_tree"


class DeferredMask:
    """What the "cope_tree" mask interface returns: ``sdpa_mask``'s arguments, built only by :meth:`materialize`."""

    def __init__(self, **sdpa_mask_kwargs) -> None:
        self._kwargs: dict | None = sdpa_mask_kwargs
        self._mask: torch.Tensor | None = None

    def materialize(self) -> torch.Tensor | None:
        """The mask ``"sdpa"`` would use (None: plain causal), built on the first call and then reused."""
        if self._kwargs is not None:
            self._mask, self._kwargs = sdpa_mask(**self._kwargs), None
        return self._mask


def tree_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | DeferredMask | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    prefix_tree: PrefixTree | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function contract: query (B, H, T, D), key/value (B, Hkv, T, D) ->
    ((B, T, H, D), None). With ``prefix_tree`` the tree decides who attends whom (a 2D padding mask is ignored);
    without it, exactly transformers' SDPA attention."""
    if prefix_tree is None:
        if isinstance(attention_mask, DeferredMask):
            attention_mask = attention_mask.materialize()
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    _check(prefix_tree, query, key, attention_mask, kwargs)
    return _tile_attention(prefix_tree, query, key, value, scaling, dropout), None


def register() -> None:
    """Register "cope_tree" in transformers' attention and mask interfaces (idempotent: same functions each time)."""
    AttentionInterface.register(NAME, tree_attention_forward)
    AttentionMaskInterface.register(NAME, DeferredMask)


def _check(tree: object, query: torch.Tensor, key: torch.Tensor, attention_mask: object, kwargs: dict) -> None:
    if not isinstance(tree, PrefixTree):
        raise TypeError(f"prefix_tree must be a cope.train.packing.prefix_tree.PrefixTree, got {type(tree).__name__}")
    if attention_mask is not None and not isinstance(attention_mask, DeferredMask):
        raise ValueError("tree attention got both a prefix_tree and a ready-made attention mask: pass one of them "
                         "(the tree already says who attends whom; drop the 4D mask)")
    if kwargs.get("sliding_window") is not None or kwargs.get("softcap") is not None:
        raise ValueError("tree attention is full causal attention: a sliding-window or softcapped layer cannot use a "
                         "prefix_tree; run such models with 'sdpa' and a dense mask")
    N, T = len(tree.rows), tree.length
    if query.shape[0] != N or query.shape[2] != T or key.shape[2] != T:
        raise ValueError(f"prefix_tree is for {N} rows of {T} tokens, but attention got queries {tuple(query.shape)} and "
                         f"keys {tuple(key.shape)} (B, H, T, D): build the tree for this batch, and decode without it")


def _tile_attention(tree: PrefixTree, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    scaling: float | None, dropout: float) -> torch.Tensor:
    """The tiles kernel (see the module docstring): (N, H, T, D) inputs -> (N, T, H, D)."""
    N, H, T, D = query.shape
    Hkv = key.shape[1]
    # causal calls keep grouped K/V heads (the flash kernels take GQA with is_causal); masked calls get K/V repeated to
    # the query heads first (_tile_groups), see "Kernels on CUDA" in the module docstring
    sdpa = functools.partial(F.scaled_dot_product_attention, dropout_p=dropout, scale=scaling)
    plan = tree.cached(("tiles", str(query.device)), lambda: _TileTensors.build(tree, query.device))
    pieces = []  # (tokens, H, D) each, concatenated in plan order
    for a, b, rows in plan.causal:
        q, k, v = (x[:, :, a:b] if rows is None else x.index_select(0, rows)[:, :, a:b] for x in (query, key, value))
        pieces.append(sdpa(q, k, v, is_causal=True, enable_gqa=H != Hkv).transpose(1, 2).reshape(-1, H, D))  # (R*L, H, D)
    if plan.masks:
        tiles = functools.partial(_tile_groups, plan, sdpa)
        if tree.recompute and torch.is_grad_enabled() and any(x.requires_grad for x in (query, key, value)):
            # Backward keeps only q, k, v (the checkpoint's inputs; the causal calls mostly keep them anyway) and
            # gathers and attends again, instead of keeping every tile's gathered ancestor keys, values and outputs.
            pieces.append(checkpoint(tiles, query, key, value, use_reentrant=False, preserve_rng_state=dropout > 0))
        else:
            pieces.append(tiles(query, key, value))
    if plan.pad_index.numel():  # padding attends only itself: softmax over one key is 1
        flat_v = value.transpose(1, 2).reshape(N * T, Hkv, D)
        pieces.append(flat_v.index_select(0, plan.pad_index).repeat_interleave(H // Hkv, dim=1))  # (P, H, D)
    return torch.cat(pieces).index_select(0, plan.out_index).view(N, T, H, D)


def _tile_groups(plan: _TileTensors, sdpa: Callable, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """Every tile group's queries against its gathered keys (one gather per input for all groups: each gather's
    backward fills an (N*T, heads, D) zero tensor): (N, H, T, D) inputs -> (tile queries, H, D) in plan order."""
    N, H, T, D = query.shape
    Hkv = key.shape[1]
    flat = [x.transpose(1, 2).reshape(N * T, x.shape[1], D) for x in (query, key, value)]  # (N*T, heads, D)
    qs = flat[0].index_select(0, plan.q_index).split([m.shape[0] * m.shape[2] for m in plan.masks])
    ks, vs = (x.index_select(0, plan.k_index).split([m.shape[0] * m.shape[3] for m in plan.masks]) for x in flat[1:])
    out = []
    for q, k, v, mask in zip(qs, ks, vs, plan.masks):
        G, _, Lq, Lk = mask.shape
        q = q.view(G, Lq, H, D).transpose(1, 2)  # (G, H, Lq, D)
        k, v = (x.view(G, Lk, Hkv, D).transpose(1, 2) for x in (k, v))  # (G, Hkv, Lk, D)
        if Hkv != H:  # a masked call with grouped heads would run on CUDA's math kernel only
            k, v = (x.repeat_interleave(H // Hkv, dim=1) for x in (k, v))  # (G, H, Lk, D)
        out.append(sdpa(q, k, v, attn_mask=mask).transpose(1, 2).reshape(-1, H, D))  # (G*Lq, H, D)
    return torch.cat(out)


@dataclass(frozen=True)
class _TileTensors:
    """A tree's :class:`~cope.train.packing.prefix_tree.Plan` as index tensors on one device (flat indices row*T+t).

    ``causal``: (start, end, rows; None = all rows) per causal call. Tile group g has ``masks[g]`` (G, 1, Lq, Lk)
    (bottom-right causal: query i sees keys j <= Lk_tile - Lq_tile + i); its queries are the next G*Lq entries of
    ``q_index`` and its keys the next G*Lk of ``k_index`` (padding slots point at token 0; their outputs are
    dropped and masked keys get zero weight). ``out_index`` (N*T,): where each token's output sits in the
    concatenation of the calls' outputs and the padding tokens' values (``pad_index``)."""

    causal: list[tuple[int, int, torch.Tensor | None]]
    masks: list[torch.Tensor]
    q_index: torch.Tensor
    k_index: torch.Tensor
    pad_index: torch.Tensor
    out_index: torch.Tensor

    @classmethod
    def build(cls, tree: PrefixTree, device: torch.device) -> _TileTensors:
        plan, N, T = tree.plan(), len(tree.rows), tree.length
        out_index = torch.full((N * T,), -1, dtype=torch.long)
        base, causal, q_all, k_all, masks = 0, [], [], [], []
        for (a, b), rows in plan.causal.items():
            for k, r in enumerate(rows):
                out_index[r * T + a:r * T + b] = torch.arange(base + k * (b - a), base + (k + 1) * (b - a))
            base += len(rows) * (b - a)
            causal.append((a, b, None if rows == tuple(range(N)) else torch.tensor(rows, device=device)))
        for tiles in plan.groups:
            lq, lk = max(t.lq for t in tiles), max(t.lk for t in tiles)
            q_index = torch.zeros(len(tiles), lq, dtype=torch.long)
            k_index = torch.zeros(len(tiles), lk, dtype=torch.long)
            for g, t in enumerate(tiles):
                q_index[g, :t.lq] = torch.arange(t.q_start, t.q_end) + t.row * T
                k_index[g, :t.lk] = torch.cat([torch.arange(a, b) for a, b in t.keys]) + t.row * T
                out_index[t.row * T + t.q_start:t.row * T + t.q_end] = torch.arange(base + g * lq, base + g * lq + t.lq)
            base += len(tiles) * lq
            offset = torch.tensor([t.lk - t.lq for t in tiles])  # (G,)
            mask = torch.arange(lk)[None, None, :] <= offset[:, None, None] + torch.arange(lq)[None, :, None]  # (G, Lq, Lk)
            q_all.append(q_index.flatten())
            k_all.append(k_index.flatten())
            masks.append(mask[:, None].to(device))
        pad_index = torch.tensor([r * T + p for r, p in plan.padding], dtype=torch.long)
        out_index[pad_index] = torch.arange(base, base + len(pad_index))
        assert bool((out_index >= 0).all()), "tree plan left a token without output"
        empty = torch.zeros(0, dtype=torch.long)
        return cls(causal=causal, masks=masks, q_index=torch.cat([empty, *q_all]).to(device), k_index=torch.cat([empty, *k_all]).to(device),
                   pad_index=pad_index.to(device), out_index=out_index.to(device))


def tree_mask_mod(tree: PrefixTree, device: torch.device | str) -> Callable:
    """FlexAttention mask_mod(b, h, q, kv) of ``tree`` (True = attend), equal to :meth:`PrefixTree.dense_mask`.

    Per token: its node (a global id; padding -> M) and its index inside the node; per node pair: how many tokens
    of ancestor ``a`` node ``n`` sees (``sees[n, a]``, 0 if ``a`` is no ancestor). Query q attends kv iff same node
    and kv <= q, or kv's index in its node < sees[node(q), node(kv)], or kv == q (padding sees itself)."""
    N, T = len(tree.rows), tree.length
    first = [sum(len(r) for r in tree.rows[:i]) for i in range(N)]  # global id of each row's node 0
    M = sum(len(r) for r in tree.rows)
    node = torch.full((N, T), M, dtype=torch.long)
    local = torch.zeros(N, T, dtype=torch.long)
    sees = torch.zeros(M + 1, M + 1, dtype=torch.long)
    for r, nodes in enumerate(tree.rows):
        for i, n in enumerate(nodes):
            node[r, n.start:n.end] = first[r] + i
            local[r, n.start:n.end] = torch.arange(n.end - n.start)
            for a, c in tree.chain(r, i):
                sees[first[r] + i, first[r] + a] = c
    node, local, sees = node.to(device), local.to(device), sees.to(device)

    def mask_mod(b, h, q_idx, kv_idx):
        nq, nk = node[b, q_idx], node[b, kv_idx]
        own = (nq == nk) & (nq != M) & (kv_idx <= q_idx)
        return own | (local[b, kv_idx] < sees[nq, nk]) | (q_idx == kv_idx)

    return mask_mod


@functools.cache
def _compiled_flex() -> Callable:
    """flex_attention compiled once per process (a new row length T recompiles; dynamo then turns dynamic shapes on)."""
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention)


def flex_tree_attention(tree: PrefixTree, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                        scaling: float | None = None, dropout: float = 0.0) -> torch.Tensor:
    """FlexAttention with the tree's BlockMask (compiled on CUDA; eager elsewhere, forward only), (N, H, T, D) inputs
    -> (N, T, H, D): the kernel tests and benches compare with the tiles kernel (see the module docstring)."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    if dropout:
        raise ValueError("the flex tree kernel has no attention dropout: set the model's attention_dropout to 0")
    N, T = len(tree.rows), tree.length

    def build():  # compiled on CUDA, so that no (N, 1, T, T) mask is materialized to find the blocks
        return create_block_mask(tree_mask_mod(tree, query.device), N, None, T, T, device=query.device, _compile=query.is_cuda)

    block_mask = tree.cached(("flex", str(query.device)), build)
    run = _compiled_flex() if query.is_cuda else flex_attention
    out = run(query, key, value, block_mask=block_mask, scale=scaling, enable_gqa=query.shape[1] != key.shape[1])
    return out.transpose(1, 2).contiguous()
