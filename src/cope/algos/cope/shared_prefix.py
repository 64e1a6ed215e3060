"""The batch of one separate forecast step with each episode's history forwarded once (``data.share_prefix=true``).

CoPE's separate update trains, per optimizer step, ``cope.minibatch_size`` samples, each "the transcript up to its
anchor + the sample's own tokens" (:mod:`cope.algos.cope.prompted`). One row per sample
(:func:`cope.algos.cope.packing.collate_chunks`) re-forwards the whole history for every sample: an episode of T
steps costs about T times its own length. Here the samples of one episode in the step share one row: its trunk is
the episode's transcript (only as far as the step's samples need it), each sample a branch anchored in it, and tree
attention (:mod:`cope.train.packing.tree_attention`, ``"cope_tree"``) lets every branch token attend exactly what it
attends in the sample's own row, at the same positions. The step trains the same samples in the same order with
the same weights; the loss (:func:`cope.algos.cope.loss.forecast_nll`) and its gradients equal the one-row-per-sample
batch's up to float rounding. This is Hydragen's shared-prefix idea (Juravsky et al., 2024) used for training; the
authors' code forwards one sample per micro-batch.

A sample is a branch (:func:`cope.train.packing.tree_batch.branch`), ``[tokens[anchor - 1]] + chunk.tokens`` anchored after
``anchor - 1`` trunk tokens, so the trunk ends at the largest ``anchor - 1`` of its samples: every chunk token is
scored as in the sample's own row, not only the targets. The trees go through the one packer
(:func:`cope.train.packing.tree_batch.pack`); the packed rows are the batch's rows (``packed`` is their identity packing).
"""
from __future__ import annotations

import torch

from cope.algos.cope.chunks import ForecastChunk
from cope.algos.cope.packing import collate_chunks, forecast_batch
from cope.episode import Episode
from cope.train.packing.prefix_tree import TreeNode
from cope.train.packing.tree_batch import Unit, branch, pack, split_to_fit


def collate_shared(episodes: list[Episode], chunks: list[ForecastChunk], pad_id: int, max_row_tokens: int | None = None) -> dict:
    """A batch of kind ``forecast`` with one tree per episode of ``chunks``: the trunk and the chunks as branches,
    ``packed`` their identity packing (:class:`~cope.train.packing.tree_batch.PackedRows` with the trees), ``position_ids`` the
    trees'; the trees
    placed side by side in as few rows as fit (:func:`cope.train.packing.tree_batch.fill_rows`: no row longer than
    ``max_row_tokens`` or the longest tree; ``episode_index`` -1 on a row of several); ``forecast_chunk`` indexes
    ``chunks`` (same order, weights and actions as :func:`~cope.algos.cope.packing.collate_chunks`).
    ``max_row_tokens`` (the module's micro-batch budget): an episode whose tree would be longer gives several trees
    of consecutive samples that each fit (each with its own trunk), so a micro-batch holds no more tokens than one row
    per sample would. An empty ``chunks`` gives that function's empty batch (no ``packed``)."""
    if not chunks:
        return collate_chunks(episodes, chunks, pad_id)
    by_episode: dict[int, list[int]] = {}
    for cid, c in enumerate(chunks):
        tokens = episodes[c.episode].tokens
        if not 1 <= c.anchor <= len(tokens):
            raise ValueError(f"collate_shared: chunk {cid} anchors at {c.anchor}, outside episode {c.episode}'s {len(tokens)} tokens")
        by_episode.setdefault(c.episode, []).append(cid)
    def tree_tokens(cids: list[int]) -> int:  # trunk up to the last anchor, then each sample and its repeated token
        return max(chunks[c].anchor for c in cids) - 1 + sum(1 + len(chunks[c].tokens) for c in cids)

    trees = [(e, sub) for e, cids in by_episode.items() for sub in split_to_fit(cids, tree_tokens, max_row_tokens)]
    units, starts = [], []  # per tree: the column of each sample's branch in the tree
    for e, cids in trees:
        tokens = episodes[e].tokens
        seq = list(tokens[: max(chunks[c].anchor for c in cids) - 1])  # the trunk (none when every anchor is 1)
        nodes, cols, parent = [TreeNode(0, len(seq), -1, 0)] if seq else [], [], 0 if seq else -1
        for c in cids:
            seen, ids = branch(tokens, chunks[c].anchor, chunks[c].tokens)
            cols.append(len(seq))
            nodes.append(TreeNode(len(seq), len(seq) + len(ids), parent, seen))
            seq += ids
        units.append(Unit(seq, tuple(nodes), ((len(units), list(range(len(seq)))),)))  # logical row i: tree i
        starts.append(cols)
    packed = pack(units, len(units), max(len(u.ids) for u in units), pad_id, max_row_tokens)
    L = packed.input_ids.shape[1]
    row_of, offset = (packed.index[:, 0] // L).tolist(), (packed.index[:, 0] % L).tolist()  # where each tree landed
    fmask = torch.zeros(packed.input_ids.shape, dtype=torch.bool)  # (N, T)
    fchunk = torch.full(packed.input_ids.shape, -1, dtype=torch.long)  # (N, T)
    for i, (_, cids) in enumerate(trees):
        for c0, cid in zip(starts[i], cids):
            c0, c1 = offset[i] + c0 + 1, offset[i] + c0 + 1 + len(chunks[cid].tokens)  # after the repeated token
            fmask[row_of[i], c0:c1] = torch.tensor(chunks[cid].target, dtype=torch.bool)
            fchunk[row_of[i], c0:c1] = cid
    episode_index = torch.full((packed.input_ids.shape[0],), -1, dtype=torch.long)  # -1: a row of several episodes
    for r in set(row_of):
        held = {e for i, (e, _) in enumerate(trees) if row_of[i] == r}
        episode_index[r] = held.pop() if len(held) == 1 else -1
    batch = forecast_batch(packed.input_ids, packed.attention_mask, packed.position_ids, fmask, fchunk, episode_index, chunks)
    batch["packed"] = packed.as_rows()  # the packed rows are the batch's rows
    return batch

