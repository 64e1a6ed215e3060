"""CoPE: an invalid action gives no forecast gradient. On hand-made episodes and a tiny fp32 Qwen2,
with the packed layout, the gradient of the forecast loss w.r.t. the per-token log-probs and w.r.t.
the logits is exactly zero at every position of the invalid action (in the transcript and in every
appended segment), non-zero at every valid action token; ``mask_invalid=False`` supervises it, and
``cut_at_invalid=True`` leaves nothing at or after it in any chunk anchored before it."""
import copy

import pytest
import torch
import transformers
from forecast_fixtures import CFG, CHAT, NO_JOINER, PAD, make_episode  # noqa: E402

from cope.algos.cope.chunks import build_chunks
from cope.algos.cope.loss import forecast_nll
from cope.algos.cope.packing import pack_forecasts
from cope.batch import collate
from cope.train.logprobs import token_logprobs

K, BAD = 3, 1  # step 1 is the invalid action


def episodes(chat):
    closed = [True] * 4 if chat is NO_JOINER else [True, False, True, True]
    good = make_episode(chat, 4, True, 1, valid=[True, False, True, True], closed=closed, min_action_len=2)
    return [good, make_episode(chat, 3, False, 2, min_action_len=2)]


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(copy.deepcopy(CFG), attn_implementation="sdpa", dtype=torch.float32).eval()


def positions(batch, eps, chunks, lengths):
    """{(chunk id, step j): [(row, col), ...]} of every action token of every chunk in the packed batch,
    reconstructed from the chunks alone: each chunk, a_t included, in its appended segment after a repeated
    non-target token (no forecast token sits at a transcript column: those are scored at the sampling
    temperature)."""
    out = {}
    for cid, ch in enumerate(chunks):
        r = ch.episode  # collate without indices: row == episode index
        cols = ((batch["forecast_chunk"][r] == cid).nonzero().flatten()).tolist()
        assert all(c >= lengths[r] for c in cols) and len(cols) == len(ch.tokens) + 1
        assert batch["input_ids"][r, cols[0]] == eps[ch.episode].tokens[ch.anchor - 1]  # the repeated token
        cols = cols[1:]
        assert batch["input_ids"][r, cols].tolist() == list(ch.tokens)
        for c, j in zip(cols, ch.action_index):
            if j >= 0:
                out.setdefault((cid, j), []).append((r, c))
    return out


def grads(model, batch):
    """Forecast loss gradient w.r.t. leaf log-probs (N, T) and w.r.t. leaf logits (N, T, V)."""
    with torch.no_grad():
        keep = batch["packed"].tree.dense_mask()  # (N, 1, T, T) bool: the packed rows' trees
        mask = torch.zeros(keep.shape).masked_fill(~keep, torch.finfo(torch.float32).min)
        logits = model(input_ids=batch["input_ids"], attention_mask=mask,
                       position_ids=batch["position_ids"], use_cache=False).logits  # (N, T, V)
    logits = logits.detach().requires_grad_(True)
    lp, _ = token_logprobs(logits, batch["input_ids"], with_entropy=False)  # (N, T)
    lp_leaf = lp.detach().requires_grad_(True)
    acts = batch["forecast_actions"]
    args = (batch["forecast_mask"], batch["forecast_chunk"], acts.numel())
    loss, _ = forecast_nll(lp_leaf, *args)
    (g_lp,) = torch.autograd.grad(loss, lp_leaf)
    loss2, _ = forecast_nll(lp, *args)
    (g_logits,) = torch.autograd.grad(loss2, logits)
    assert torch.isfinite(loss) and loss.item() > 0 and loss.item() == pytest.approx(loss2.item())
    return g_lp, g_logits


@pytest.mark.parametrize("chat", [CHAT, NO_JOINER], ids=["joiner", "no_joiner"])
@pytest.mark.parametrize("mask_invalid", [True, False])
def test_invalid_action_gets_no_forecast_gradient(model, chat, mask_invalid):
    eps = episodes(chat)
    base = collate(eps, PAD)
    lengths = base["attention_mask"].sum(-1).tolist()
    chunks, _ = build_chunks(eps, chat, K=K, mask_invalid=mask_invalid)
    assert [c.step for c in chunks] == [0, 1, 2, 3] and {c.episode for c in chunks} == {0}
    batch = pack_forecasts(base, eps, chunks, PAD)
    assert "packed" in batch  # segments were appended
    pos = positions(batch, eps, chunks, lengths)
    # the invalid action sits in chunks 0 and 1 (as a later action and as the anchor action), in their segments
    bad = {k: v for k, v in pos.items() if k[1] == BAD}
    assert sorted(k[0] for k in bad) == [0, 1]
    bad_cols = [rc for v in bad.values() for rc in v]
    s = eps[0].steps[BAD]
    assert len(bad_cols) == 2 * (s.action_end - s.action_start) and all(c >= lengths[0] for _, c in bad_cols)
    good_cols = [rc for k, v in pos.items() if k[1] != BAD for rc in v]
    assert good_cols and all(c >= lengths[0] for _, c in good_cols)
    assert not batch["forecast_mask"][:, : lengths[0]].any()  # the transcript's own action columns: PG only

    g_lp, g_logits = grads(model, batch)
    for r, c in good_cols:  # valid action tokens: supervised, in the transcript and in segments
        assert batch["forecast_mask"][r, c]
        assert g_lp[r, c] != 0 and g_logits[r, c - 1].abs().sum() > 0
    for r, c in bad_cols:
        assert batch["forecast_mask"][r, c] == (not mask_invalid)
        if mask_invalid:  # exactly zero: log p(token c) and the logits that predict it (column c - 1)
            assert g_lp[r, c] == 0 and torch.all(g_logits[r, c - 1] == 0)
        else:
            assert g_lp[r, c] != 0 and g_logits[r, c - 1].abs().sum() > 0
    # nothing but forecast targets carries gradient (the failed episode's row included)
    assert torch.all(g_lp[~batch["forecast_mask"]] == 0)
    assert torch.all(g_logits[1] == 0)


@pytest.mark.parametrize("mask_invalid", [True, False])
def test_cut_at_invalid_leaves_nothing_after_the_invalid_action(model, mask_invalid):
    eps = episodes(CHAT)
    base = collate(eps, PAD)
    lengths = base["attention_mask"].sum(-1).tolist()
    chunks, m = build_chunks(eps, CHAT, K=K, mask_invalid=mask_invalid, cut_at_invalid=True)
    assert [c.step for c in chunks] == [0, 2, 3]  # no chunk anchors at the invalid action
    for c in chunks:
        assert BAD not in c.action_index
        if c.step < BAD:  # chunks that would contain it stop before it: no target at or after it
            assert all(j < BAD for j, t in zip(c.action_index, c.target) if t)
            assert all(j < BAD for j in c.action_index)
    assert m["forecast/masked_frac"] == 0.0
    batch = pack_forecasts(base, eps, chunks, PAD)
    pos = positions(batch, eps, chunks, lengths)
    assert all(j != BAD for _, j in pos)
    g_lp, g_logits = grads(model, batch)
    s = eps[0].steps[BAD]
    for c in range(s.action_start, s.action_end):
        assert not batch["forecast_mask"][0, c] and batch["forecast_chunk"][0, c] == -1
        assert g_lp[0, c] == 0 and torch.all(g_logits[0, c - 1] == 0)
    # no segment column holds a token of the invalid action or of a later action of a chunk anchored before it
    early = [cid for cid, ch in enumerate(chunks) if ch.step < BAD]
    assert early and all(j < BAD for (cid, j) in pos if cid in early)  # a0's chunk was cut to a0 alone
    for v in pos.values():  # every remaining action token is supervised
        assert all(g_lp[r, c] != 0 for r, c in v)
