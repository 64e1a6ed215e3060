"""HeldOutProbes on a tiny policy and real maze episodes (cope.rollout.loop.run_episodes with a scripted
actor that follows MazeEnv.shortest_path): chunk count, accuracy ranges, obs NLL against an independent
per-episode forward, equality with the full-softmax probe in every micro-batch split, cold start, train/eval
mode restored, a perfect forecaster, answers read by the projection, and a bounded peak at a 152k vocabulary."""
from __future__ import annotations

import copy
import functools
from types import SimpleNamespace

import pytest
import torch
from tiny_fixtures import Scripted, maze_factory, maze_tasks, tiny_base, tiny_chat, tiny_policy, tiny_tokenizer, wrap_lora
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from cope.algos.cope.chunks import build_chunks
from cope.algos.cope.packing import plain_forecasts
from cope.algos.grpo import PolicyGradient
from cope.batch import collate
from cope.callbacks.probes import HeldOutProbes
from cope.episode import Role
from cope.models.policy import Policy
from cope.train.logprobs import CHUNK_ELEMS, token_logprobs
from cope.train.module import AgentRLModule

MAX_CONTEXT, MAX_ACTION, K, STEPS = 1024, 6, 3, 80
VALUES = ("probe/forecast_chunks", "probe/obs_nll", "probe/forecast_token_acc", "probe/forecast_action_acc")
COUNTS = ("probe/obs_tokens", "probe/forecast_tokens", "probe/forecast_actions")
KEYS = (*VALUES, *COUNTS)  # logged at every validation, whatever the episodes


def enc(tok, text):
    return tok(text, add_special_tokens=False)["input_ids"]


@pytest.fixture(scope="module")
def setup():
    from cope.rollout.loop import run_episodes

    tok, chat = tiny_tokenizer(), tiny_chat()
    stop = [chat.stop_id]
    tasks = maze_tasks(4, "test")
    scripts = {}
    for i, task in enumerate(tasks[:3]):  # solved along a shortest path; episode 1 opens with a malformed move
        env = maze_factory()
        env.reset(task)
        scripts[i] = ([enc(tok, "jump") + stop] if i == 1 else []) + [enc(tok, d) + stop for d in env.shortest_path()]
    scripts[3] = [enc(tok, "jump") + stop]  # malformed until max_steps: a failure
    eps, _ = run_episodes([maze_factory() for _ in tasks], tasks, list(range(4)), Scripted(scripts), tok, chat,
                          MAX_CONTEXT, MAX_ACTION)
    assert [e.success for e in eps] == [True, True, True, False] and not any(e.aborted for e in eps)
    assert not eps[1].steps[0].valid and all(s.valid for s in eps[1].steps[1:])
    return SimpleNamespace(tok=tok, chat=chat, eps=eps, policy=tiny_policy(seed=0))


@pytest.fixture(scope="module")
def fitted(setup):
    """A tiny policy whose base was fitted to the episodes for a few steps: its argmax forecasts are partly
    right (a random model's are all wrong, which would make accuracy comparisons vacuous)."""
    base = tiny_base(seed=1).train()
    batch = collate(setup.eps, setup.tok.pad_token_id)
    opt = torch.optim.Adam(base.parameters(), lr=1e-2)
    for _ in range(STEPS):
        opt.zero_grad()
        base(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], position_ids=batch["position_ids"],
             labels=batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)).loss.backward()
        opt.step()
    return wrap_lora(base.eval()).eval()


def module(model, budget: int | None = None) -> AgentRLModule:
    """The real module around ``model`` (the probes score in its micro-batches of ``budget`` tokens)."""
    policy = Policy(model=model, tokenizer=tiny_tokenizer(), chat=tiny_chat(), source="test")
    return AgentRLModule(policy, [PolicyGradient()], optimizer=functools.partial(torch.optim.SGD, lr=0.1),
                         max_tokens_per_microbatch=budget)


def obs_nll(model, eps):
    """Mean -log p over OBSERVATION tokens: one unpadded forward per episode."""
    tot, n = 0.0, 0
    with torch.no_grad():
        for e in eps:
            ids = torch.tensor([e.tokens])  # (1, L)
            logp = model(input_ids=ids).logits[0, :-1].float().log_softmax(-1)  # (L-1, V)
            lp = logp.gather(-1, ids[0, 1:, None]).squeeze(-1)  # (L-1,): token t+1
            obs = torch.tensor(e.roles[1:]) == int(Role.OBSERVATION)
            tot += float(-lp[obs].sum())
            n += int(obs.sum())
    return tot / n


@torch.no_grad()
def full_softmax_probe(model, eps, chat, pad_id, batch_size=16, chunks_of=None):
    """The probe as it was before chunking: full (N, T, V) logits of each collated batch, a full-vocabulary
    log-softmax per row and the argmax over the whole vocabulary (the reference values)."""
    correct = total = act_ok = act_n = n_chunks = nll_n = 0
    nll_sum = 0.0
    for s in range(0, len(eps), batch_size):
        part = eps[s: s + batch_size]
        batch = collate(part, pad_id)
        chunks = chunks_of(part) if chunks_of is not None else build_chunks(part, chat, K=K, mask_invalid=True)[0]
        n_chunks += len(chunks)
        if chunks:
            batch = plain_forecasts(batch, part, chunks, pad_id)
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                       position_ids=batch["position_ids"], use_cache=False).logits  # (N, T, V)
        lp, _ = token_logprobs(logits, batch["input_ids"], with_entropy=False)  # (N, T)
        obs = batch["roles"] == int(Role.OBSERVATION)
        nll_sum += float(-(lp * obs).sum())
        nll_n += int(obs.sum())
        if not chunks:
            continue
        pred = torch.zeros_like(batch["input_ids"])  # (N, T)
        pred[:, 1:] = logits[:, :-1].argmax(-1)
        correct += int(((pred == batch["input_ids"]) & batch["forecast_mask"]).sum())
        total += int(batch["forecast_mask"].sum())
        for cid, ch in enumerate(chunks):
            sel = batch["forecast_chunk"] == cid
            row = int(sel.any(-1).nonzero()[0])
            cols = sel[row].nonzero().flatten()
            for j in sorted({a for a, t in zip(ch.action_index, ch.target) if a >= 0 and t}):
                toks = cols[torch.tensor([a == j for a in ch.action_index])]
                act_n += 1
                act_ok += int(bool((pred[row, toks] == batch["input_ids"][row, toks]).all()))
    return {"probe/forecast_chunks": float(n_chunks), "probe/obs_nll": nll_sum / nll_n,
            "probe/forecast_token_acc": correct / total, "probe/forecast_action_acc": act_ok / act_n,
            "probe/obs_tokens": float(nll_n), "probe/forecast_tokens": float(total), "probe/forecast_actions": float(act_n)}


@pytest.mark.long
@pytest.mark.parametrize("batch_size", [16, 2])
def test_probe_metrics(setup, batch_size):
    model, eps, chat, pad = setup.policy.model, setup.eps, setup.chat, setup.tok.pad_token_id
    model.train()
    m = HeldOutProbes(sample="continuation", K=K, batch_size=batch_size).probe(module(model), eps, chat, pad)
    assert model.training and all(mod.training for mod in model.modules())  # mode restored
    assert set(m) == set(KEYS)
    chunks, _ = build_chunks(eps, chat, K=K, mask_invalid=True)
    assert m["probe/forecast_chunks"] == len(chunks) > 0
    assert 0.0 <= m["probe/forecast_token_acc"] <= 1.0 and 0.0 <= m["probe/forecast_action_acc"] <= 1.0
    assert m["probe/obs_tokens"] == sum(r == int(Role.OBSERVATION) for e in eps for r in e.roles[1:])
    model.eval()
    ref = obs_nll(model, eps)
    assert m["probe/obs_nll"] > 0 and m["probe/obs_nll"] == pytest.approx(ref, rel=1e-4)
    m2 = HeldOutProbes(sample="continuation", K=K, batch_size=batch_size).probe(module(model), eps, chat, pad)
    assert not model.training and not any(mod.training for mod in model.modules())
    assert m2 == pytest.approx(m, rel=1e-5)


@pytest.mark.long
@pytest.mark.parametrize("budget", [None, 700, 1])  # one forward; a few rows per micro-batch; one row each
def test_probe_equals_full_softmax(setup, fitted, budget):
    """Chunked, micro-batched scoring gives the values of full-vocabulary logits (within 1e-5), with a model
    fitted far enough that both accuracies lie strictly between 0 and 1."""
    model, eps, chat, pad = fitted, setup.eps, setup.chat, setup.tok.pad_token_id
    ref = full_softmax_probe(model, eps, chat, pad)
    m = HeldOutProbes(sample="continuation", K=K).probe(module(model, budget), eps, chat, pad)
    assert set(m) == set(KEYS)
    for k in KEYS:
        assert m[k] == pytest.approx(ref[k], abs=1e-5), k
    assert 0 < ref["probe/forecast_token_acc"] < 1 and 0 < ref["probe/forecast_action_acc"] < 1  # not vacuous


def test_probe_without_successes(setup):
    model, chat, pad = setup.policy.model, setup.chat, setup.tok.pad_token_id
    failed = [setup.eps[3]]
    m = HeldOutProbes(sample="continuation", K=K).probe(module(model), failed, chat, pad)
    assert set(m) == set(KEYS)  # the same keys: forecast values 0 over a count of 0
    forecast = [k for k in KEYS if k.startswith("probe/forecast_")]
    assert len(forecast) == 5 and all(m[k] == 0.0 for k in forecast)
    model.eval()
    assert m["probe/obs_tokens"] > 0 and m["probe/obs_nll"] == pytest.approx(obs_nll(model, failed), rel=1e-4)
    assert HeldOutProbes(sample="continuation", K=K).probe(module(model), [], chat, pad) == dict.fromkeys(KEYS, 0.0)


def test_projected_answers_are_probed_only_without_the_mask(setup):
    """Answers the env read out of prose (SmolLM2 on the maze) are invalid to the default probe, as to
    ``cope.mask_projected``: no chunk. ``mask_projected=False`` probes them like any accepted action."""
    model, chat, pad = setup.policy.model, setup.chat, setup.tok.pad_token_id
    prose = copy.deepcopy(setup.eps)
    for e in prose:
        for s in e.steps:
            s.projected = s.valid
    plain = HeldOutProbes(K=K).probe(module(model), setup.eps, chat, pad)
    assert plain["probe/forecast_chunks"] > 0
    assert HeldOutProbes(K=K).probe(module(model), prose, chat, pad)["probe/forecast_chunks"] == 0
    assert HeldOutProbes(K=K, mask_projected=False).probe(module(model), prose, chat, pad) == pytest.approx(plain, rel=1e-6)


class NextTokenOracle(torch.nn.Module):
    """Cheats: the logits at t put (almost) all mass on input t + 1, so teacher-forced argmax is always right."""

    def __init__(self, vocab: int):
        super().__init__()
        self.vocab = vocab

    def forward(self, input_ids, attention_mask=None, position_ids=None, use_cache=None):
        nxt = torch.roll(input_ids, -1, dims=1)  # (N, T): input t + 1 (last column: anything)
        logits = torch.nn.functional.one_hot(nxt, self.vocab).float() * 50.0  # (N, T, V)
        return SimpleNamespace(logits=logits)


def test_perfect_forecaster_scores_one(setup):
    oracle = NextTokenOracle(len(setup.tok))
    m = HeldOutProbes(sample="continuation", K=K).probe(module(oracle, budget=500), setup.eps, setup.chat, setup.tok.pad_token_id)
    assert m["probe/forecast_token_acc"] == 1.0 and m["probe/forecast_action_acc"] == 1.0
    assert 0.0 <= m["probe/obs_nll"] < 1e-6 and oracle.training


class LargestOutput(TorchDispatchMode):
    """Records the largest tensor any aten op returns (its element count and bytes, and the op)."""

    def __init__(self):
        super().__init__()
        self.numel, self.nbytes, self.op = 0, 0, None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.numel() > self.numel:
                self.numel, self.nbytes, self.op = t.numel(), t.numel() * t.element_size(), str(func)
        return out


@pytest.mark.long
def test_peak_bounded_at_152k_vocabulary(setup):
    """At Qwen2.5's vocabulary (152,064; hidden size 32) the probes never hold a tensor near N x T x V.

    Measured with a ``TorchDispatchMode`` that sees the output of every aten op: on CPU, torch's allocations
    are invisible to ``torch.cuda`` memory stats and to ``tracemalloc``, and process RSS is blurred by the
    allocator's caching and everything else the process holds; the largest op output is exact and
    deterministic, and it is what grows with N x T x V (the logits, their log-softmax). It bounds a single
    allocation, not the sum of live ones: the chunk loop holds a constant number of (c, V) buffers."""
    V = 152_064
    eps, chat, pad = setup.eps, setup.chat, setup.tok.pad_token_id
    big = tiny_policy(seed=0, vocab_size=V).model
    chunks, _ = build_chunks(eps, chat, K=K, mask_invalid=True)
    N, T = plain_forecasts(collate(eps, pad), eps, chunks, pad)["input_ids"].shape  # the one probed batch
    assert N * T > 5000  # a few thousand positions: old full logits (N, T, V) would be N * T * V fp32
    rec = LargestOutput()
    with rec:
        m = HeldOutProbes(sample="continuation", K=K).probe(module(big, budget=1024), eps, chat, pad)
    print(f"probe batch {N}x{T}, V={V}: largest op output {rec.numel:,} elements ({rec.nbytes / 2**20:.0f} MiB, {rec.op});"
          f" full logits would be {N * T * V:,} ({N * T * V * 4 / 2**30:.1f} GiB fp32)")
    assert rec.numel <= CHUNK_ELEMS and rec.numel * 20 < N * T * V, (rec.numel, rec.op)
    assert m["probe/forecast_tokens"] > 0 and m["probe/obs_tokens"] > 0 and 0 < m["probe/obs_nll"] < 20


@pytest.mark.long
@pytest.mark.parametrize("layout", ["list", "turns"])
def test_prompted_probe_equals_the_full_softmax_reference(setup, layout):
    """The default probe forecasts CoPE's prompted samples (the authors' sample: plan-ahead turn, listed actions),
    in the layout it is given (``turns``: one assistant turn per action)."""
    from cope.algos.cope.prompted import PlanPrompt, build_prompted

    model, eps, chat, pad = setup.policy.model.eval(), setup.eps, setup.chat, setup.tok.pad_token_id
    m = HeldOutProbes(K=K, layout=layout).probe(module(model, budget=700), eps, chat, pad)
    plan = PlanPrompt(tiny_tokenizer(), layout)
    ref = full_softmax_probe(model, eps, chat, pad, chunks_of=lambda part: build_prompted(part, chat, plan, K=K, group_weights=False)[0])
    assert m["probe/forecast_chunks"] == ref["probe/forecast_chunks"] > 0
    for k, v in ref.items():
        assert m[k] == pytest.approx(v, abs=1e-5), k
