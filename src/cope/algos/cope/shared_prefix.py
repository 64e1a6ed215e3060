"""The batch of one separate forecast step with each episode's history forwarded once (``cope.share_prefix=true``).

CoPE's separate update trains, per optimizer step, ``cope.minibatch_size`` samples, each "the transcript up to its
anchor + the sample's own tokens" (:mod:`cope.algos.cope.prompted`). One row per sample
(:func:`cope.algos.cope.layouts.collate_chunks`) re-forwards the whole history for every sample: an episode of T
steps costs about T times its own length. Here the samples of one episode in the step share one row: its trunk is
the episode's transcript (only as far as the step's samples need it), each sample a branch anchored in it, and tree
attention (:mod:`cope.train.tree_attention`, ``"cope_tree"``) lets every branch token attend exactly what it
attends in the sample's own row, at the same positions. The step trains the same samples in the same order with
the same weights; the loss (:func:`cope.algos.cope.loss.forecast_nll`) and its gradients equal the one-row-per-sample
batch's up to float rounding. This is Hydragen's shared-prefix idea (Juravsky et al., 2024) used for training; the
authors' code forwards one sample per micro-batch.

A branch is ``[tokens[anchor - 1]] + chunk.tokens`` anchored after ``anchor - 1`` trunk tokens, so the trunk ends at
the largest ``anchor - 1`` of the row. The repeated token sits at position ``anchor - 1`` and sees exactly what the
trunk's own copy sees, so its output predicts the chunk's first token from inside the branch (log-probs are read
from the previous column of the same row): every chunk token is scored as in the sample's own row, not only the
targets. The same convention as the packed joint layout (:func:`cope.algos.cope.layouts.pack_forecasts`).
"""
from __future__ import annotations

import torch

from cope.algos.cope.chunks import ForecastChunk
from cope.algos.cope.layouts import collate_chunks, forecast_batch
from cope.episode import Episode
from cope.train.tree_batch import pack_branches, split_to_fit


def collate_shared(episodes: list[Episode], chunks: list[ForecastChunk], pad_id: int, max_row_tokens: int | None = None) -> dict:
    """A batch of kind ``forecast`` with one tree per episode of ``chunks``: the trunk and the chunks as branches,
    ``tree_layout`` their :class:`~cope.train.tree_layout.TreeLayout`, ``position_ids`` the layout's; the trees
    placed side by side in as few rows as fit (:func:`cope.train.tree_batch.fill_rows`: no row longer than
    ``max_row_tokens`` or the longest tree; ``episode_index`` -1 on a row of several); ``forecast_chunk`` indexes
    ``chunks`` (same order, weights and actions as :func:`~cope.algos.cope.layouts.collate_chunks`).
    ``max_row_tokens`` (the module's micro-batch budget): an episode whose tree would be longer gives several trees
    of consecutive samples that each fit (each with its own trunk), so a micro-batch holds no more tokens than one row
    per sample would. An empty ``chunks`` gives that function's empty batch (no layout)."""
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
    rows = []
    for e, cids in trees:
        tokens = episodes[e].tokens
        trunk = tokens[: max(chunks[c].anchor for c in cids) - 1]
        rows.append((trunk, [(chunks[c].anchor - 1, [tokens[chunks[c].anchor - 1], *chunks[c].tokens]) for c in cids]))
    packed = pack_branches(rows, pad_id, fill=True, max_row_tokens=max_row_tokens)
    fmask = torch.zeros(packed.input_ids.shape, dtype=torch.bool)  # (N, T)
    fchunk = torch.full(packed.input_ids.shape, -1, dtype=torch.long)  # (N, T)
    for i, (_, cids) in enumerate(trees):
        r = packed.row_of[i]
        for c0, cid in zip(packed.starts[i], cids):
            c1 = c0 + 1 + len(chunks[cid].tokens)  # after the repeated token
            fmask[r, c0 + 1 : c1] = torch.tensor(chunks[cid].target, dtype=torch.bool)
            fchunk[r, c0 + 1 : c1] = cid
    episode_index = torch.full((packed.input_ids.shape[0],), -1, dtype=torch.long)  # -1: a row of several episodes
    for r in set(packed.row_of):
        held = {e for i, (e, _) in enumerate(trees) if packed.row_of[i] == r}
        episode_index[r] = held.pop() if len(held) == 1 else -1
    batch = forecast_batch(packed.input_ids, packed.attention_mask, packed.position_ids, fmask, fchunk, episode_index, chunks)
    batch["tree_layout"] = packed.layout
    return batch

