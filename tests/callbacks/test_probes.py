"""HeldOutProbes.probe on a tiny policy and real maze episodes (cope.rollout.loop.run_episodes with a
scripted actor that follows MazeEnv.shortest_path): chunk count, accuracy ranges, obs NLL against an
independent per-episode forward, cold start, train/eval mode restored, and a perfect forecaster."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from tiny_fixtures import Scripted, maze_factory, maze_tasks, tiny_chat, tiny_policy, tiny_tokenizer

from cope.algos.cope.targets import build_chunks
from cope.callbacks.probes import HeldOutProbes
from cope.episode import Role
from cope.rollout.loop import run_episodes

MAX_CONTEXT, MAX_ACTION, K = 1024, 6, 3
KEYS = ("probe/forecast_chunks", "probe/obs_nll", "probe/forecast_token_acc", "probe/forecast_action_acc")


def enc(tok, text):
    return tok(text, add_special_tokens=False)["input_ids"]


@pytest.fixture(scope="module")
def setup():
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


def module(model):
    return SimpleNamespace(model=model, device=torch.device("cpu"))


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


@pytest.mark.long
@pytest.mark.parametrize("batch_size", [16, 2])
def test_probe_metrics(setup, batch_size):
    model, eps, chat, pad = setup.policy.model, setup.eps, setup.chat, setup.tok.pad_token_id
    model.train()
    m = HeldOutProbes(K=K, batch_size=batch_size).probe(module(model), eps, chat, pad)
    assert model.training and all(mod.training for mod in model.modules())  # mode restored
    assert set(m) == set(KEYS)
    chunks, _ = build_chunks(eps, chat, K=K, mask_invalid=True)
    assert m["probe/forecast_chunks"] == len(chunks) > 0
    assert 0.0 <= m["probe/forecast_token_acc"] <= 1.0 and 0.0 <= m["probe/forecast_action_acc"] <= 1.0
    model.eval()
    ref = obs_nll(model, eps)
    assert m["probe/obs_nll"] > 0 and m["probe/obs_nll"] == pytest.approx(ref, rel=1e-4)
    m2 = HeldOutProbes(K=K, batch_size=batch_size).probe(module(model), eps, chat, pad)
    assert not model.training and not any(mod.training for mod in model.modules())
    assert m2 == pytest.approx(m, rel=1e-5)


def test_probe_without_successes(setup):
    model, chat, pad = setup.policy.model, setup.chat, setup.tok.pad_token_id
    failed = [setup.eps[3]]
    m = HeldOutProbes(K=K).probe(module(model), failed, chat, pad)
    assert set(m) == {"probe/forecast_chunks", "probe/obs_nll"}
    assert m["probe/forecast_chunks"] == 0.0
    model.eval()
    assert m["probe/obs_nll"] == pytest.approx(obs_nll(model, failed), rel=1e-4)
    assert HeldOutProbes(K=K).probe(module(model), [], chat, pad) == {}


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
    m = HeldOutProbes(K=K).probe(module(oracle), setup.eps, setup.chat, setup.tok.pad_token_id)
    assert m["probe/forecast_token_acc"] == 1.0 and m["probe/forecast_action_acc"] == 1.0
    assert 0.0 <= m["probe/obs_nll"] < 1e-6 and oracle.training
