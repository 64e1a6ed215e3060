"""Branched GRPO groups trained as full prefix trees (``data.share_prefix=true``, :mod:`cope.train.packing.group_prefix`).

A hand-built branched group (two roots, a child of each, a grandchild forked from a child, an aborted child) and an
ordinary group whose episodes happen to share their first action: the packed rows hold each distinct token once (the
trie of the group's ids, roles and action mask, fewer tokens than one trunk per group cut at the first action), every
shared turn of a child sits where its parent's does, and the old and reference log-probs, the losses and every LoRA
gradient equal the unpacked per-leaf rows' for GRPO, ECHO and CoPE's joint update (both packings, forecast samples
from the winning leaves), whole and with the group cut by the micro-batch budget. A group the branching collector
grew on the maze packs to its distinct tokens too, and the trie keeps a row whose own tree has two roots whole."""
from __future__ import annotations

import dataclasses
import random

import pytest
import torch
from tiny_fixtures import exactness_model, exactness_module, scored_step

from cope.algos.cope.loss import ForecastLoss
from cope.algos.cope.packing import pack_forecasts, plain_forecasts
from cope.algos.cope.prompted import PlanPrompt, build_prompted
from cope.algos.echo import ObservationLoss
from cope.algos.grpo import KLPenalty, PolicyGradient
from cope.batch import collate
from cope.chat import ChatFormat
from cope.envs.base import Task
from cope.episode import EndReason, Episode, Role, Step
from cope.train.packing.group_prefix import pack_groups
from cope.train.packing.prefix_tree import PrefixTree, TreeNode
from cope.train.packing.tree_batch import use_tree_attention

PAD = 0
CHAT = ChatFormat(system_open=(1,), user_open=(2,), assistant_open=(3,), turn_end=(4,), newline=(5,))
BUDGET = 120  # tokens: group 0 (about 300 distinct tokens) is cut into several tries


def _turns(ep: Episode, rng: random.Random, steps: int, first: list[int] | None = None) -> Episode:
    """``steps`` more turns: an action (``first`` fixes the first one), the feedback turn, the next assistant turn
    opened unless it is the last."""
    for j in range(steps):
        action = first if j == 0 and first else [rng.randrange(6, 64) for _ in range(rng.randint(1, 3))]
        a0, _ = ep.append([*action, *CHAT.turn_end], Role.ACTION)
        o0, _ = ep.append(CHAT.after_action(True), Role.PROMPT)
        ep.append([rng.randrange(6, 64) for _ in range(rng.randint(2, 4))], Role.OBSERVATION)
        _, o1 = ep.append(CHAT.close_turn() if j < steps - 1 else [], Role.PROMPT)
        ep.steps.append(Step(a0, o0, True, True, f"a{len(ep.steps)}", obs_start=o0, obs_end=o1))
    return ep


def _root(task: int, group: int, seed: int, steps: int, reward: float, first: list[int] | None = None) -> Episode:
    rng = random.Random(task)
    ep = Episode(task=Task("toy", "train", task), group=group, reward=reward, success=reward > 0.5, score=reward)
    ep.append([*CHAT.system_open, *(rng.randrange(6, 64) for _ in range(6)), *CHAT.turn_end, *CHAT.newline,
               *CHAT.user_open], Role.PROMPT)
    ep.append([rng.randrange(6, 64) for _ in range(5)], Role.OBSERVATION)
    ep.append(CHAT.close_turn(), Role.PROMPT)
    ep.prompt_len = len(ep.tokens)
    return _turns(ep, random.Random(seed), steps, first)


def _fork(eps: list[Episode], parent: int, k: int, seed: int, steps: int, reward: float,
          end_reason: str = EndReason.DONE) -> Episode:
    """A child of ``eps[parent]`` after its first ``k`` steps (their ids and roles are the parent's), ``steps`` more."""
    p = eps[parent]
    end = p.steps[k - 1].obs_end
    ep = Episode(task=p.task, group=p.group, tokens=p.tokens[:end], roles=p.roles[:end],
                 steps=[dataclasses.replace(s) for s in p.steps[:k]], reward=reward, success=reward > 0.5, score=reward,
                 end_reason=end_reason, prompt_len=p.prompt_len, branch_of=parent, shared_steps=k)
    return _turns(ep, random.Random(seed), steps)


def _episodes() -> list[Episode]:
    """Group 0, a tree: roots 0 and 1; 2 forks from 0 after 2 steps, 3 from 1 after 1, 4 from 2 after 3 (a
    grandchild: 2 steps of 0, 1 of 2), 5 from 0 after 3 and aborted (its shared actions are no targets). Group 1,
    flat: 6 and 7 share their first action. Advantages that do not cancel; wins (reward 1) give CoPE samples."""
    eps = [_root(0, 0, 1, 4, 1.0), _root(0, 0, 2, 3, 0.0)]
    eps.append(_fork(eps, 0, 2, 3, 2, 1.0))
    eps.append(_fork(eps, 1, 1, 4, 2, 0.0))
    eps.append(_fork(eps, 2, 3, 5, 1, 1.0))
    eps.append(_fork(eps, 0, 3, 6, 1, 0.0, EndReason.ABORTED))
    eps += [_root(1, 1, 7, 2, 1.0, [20, 21]), _root(1, 1, 8, 3, 0.0, [20, 21]), _root(1, 1, 9, 1, 0.0)]
    for e, adv in zip(eps, (0.9, -0.4, 0.6, -0.8, 1.2, 0.0, 0.7, -0.3, -0.5)):
        e.advantage = adv
    return eps


def _distinct(batch: dict, eps: list[Episode]) -> int:
    """Distinct (group, prefix) of the rows' (id, role, action-mask) tokens: what a trie per group stores."""
    keys = torch.stack([batch["input_ids"], batch["roles"], batch["action_mask"].long()], -1).tolist()  # (N, T, 3)
    lengths = batch["attention_mask"].sum(-1).tolist()
    return len({(eps[r].group, *map(tuple, keys[r][:t])) for r in range(len(eps)) for t in range(1, lengths[r] + 1)})


def _trunk_tokens(batch: dict, eps: list[Episode]) -> int:
    """What one trunk per group forwards (the packing before the trie): the group's common prefix cut at its first
    action, then each row's rest after a repeated token."""
    lengths = batch["attention_mask"].sum(-1).tolist()
    total = 0
    for g in {e.group for e in eps}:
        rows = [r for r, e in enumerate(eps) if e.group == g]
        n = min(lengths[r] for r in rows)
        same = (batch["input_ids"][rows, :n] == batch["input_ids"][rows[0], :n]).all(0)
        stop = ~same | (batch["roles"][rows, :n] == int(Role.ACTION)).any(0)
        P = int(stop.float().argmax())
        total += P + sum(lengths[r] - P + 1 for r in rows) if len(rows) > 1 and P >= 2 else sum(lengths[r] for r in rows)
    return total


def _check_shared_turns(batch: dict, eps: list[Episode], together: bool = False) -> int:
    """Every live child's shared turns sit where its parent's do (when both are in one packed row, or always unless
    ``together``); an aborted child shares its parent's prompt only. Returns how many children were checked."""
    pack = batch["packed"]
    row_of = {r: p for p, m in enumerate(pack.members) for r in m}
    checked = 0
    for c, e in enumerate(eps):
        if e.branch_of < 0 or (together and row_of[c] != row_of[e.branch_of]):
            continue
        p, checked = e.branch_of, checked + 1
        if e.aborted:
            n = e.prompt_len
            assert torch.equal(pack.index[c, :n], pack.index[p, :n]) and pack.index[c, n] != pack.index[p, n]
        else:
            end = eps[p].steps[e.shared_steps - 1].obs_end  # the shared turns, actions included: stored once
            assert torch.equal(pack.index[c, :end], pack.index[p, :end]), (c, p)
            assert pack.index[c, end] != pack.index[p, end]
    return checked


def test_a_branched_group_forwards_each_distinct_token_once():
    eps = _episodes()
    batch = pack_groups(collate(eps, PAD), eps)
    pack, real = batch["packed"], batch["attention_mask"].bool()
    assert pack.tokens == _distinct(batch, eps) < _trunk_tokens(batch, eps) < int(real.sum())
    assert _check_shared_turns(batch, eps) == 4
    flat = pack.index[real]
    assert torch.equal(pack.input_ids.flatten()[flat], batch["input_ids"][real])  # every token where it is said to be
    assert torch.equal(pack.position_ids.flatten()[flat], batch["position_ids"][real])  # at the unshared row's position
    assert torch.equal(pack.action_mask.flatten()[flat], batch["action_mask"][real])
    assert bool((pack.index[~real] == -1).all())
    # each logical token is predicted by the output of the packed token its row holds just before it
    pred = pack.tree.predecessors().flatten()  # (R * L,)
    assert torch.equal(pred[pack.index[:, 1:][real[:, 1:]]], pack.index[:, :-1][real[:, 1:]])
    assert bool((pred[pack.index[:, 0]] == -1).all())
    assert max(len(nodes) for nodes in pack.tree.rows) >= 8  # nested: a grandchild's node under its parent's
    ids = batch["input_ids"]
    part = int((ids[6] != ids[7]).nonzero()[0])  # group 1: rows 6 and 7 share their first action [20, 21] and more
    assert part > eps[6].prompt_len + 3 and torch.equal(pack.index[6, :part], pack.index[7, :part])
    assert pack.index[6, part] != pack.index[7, part]


def test_a_collected_branched_group_forwards_each_distinct_token_once():
    """The same on a group the branching collector grew on the maze (see tests/test_branching.py)."""
    import functools

    from tiny_fixtures import maze_factory, tiny_policy

    from cope.rollout.engine import Sampling
    from cope.train.collect.branching.collector import BranchingCollector
    from cope.train.datamodule import RolloutDataModule

    dm = RolloutDataModule(env=maze_factory, tasks_per_epoch=1, group_size=8, minibatch_size=8, max_context=512,
                           sampling=Sampling(max_action_tokens=4), val_tasks=0, progress=False,
                           collector=functools.partial(BranchingCollector, group_size=8, roots=4, trigger="uniform"))
    dm.connect(tiny_policy())
    try:
        eps = dm.collect_epoch(0).episodes
    finally:
        dm.teardown("fit")
    batch = pack_groups(collate(eps, PAD), eps)
    real = batch["attention_mask"].bool()
    assert batch["packed"].tokens == _distinct(batch, eps) < _trunk_tokens(batch, eps) < int(real.sum())
    assert _check_shared_turns(batch, eps) == 4


class _Tokenizer:
    """Encodes CoPE's plan-ahead texts as a few ids of the toy vocabulary."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [60 + len(text) % 4, 61, 62]


def _batch(eps: list[Episode], algo: str) -> dict:
    """The unpacked minibatch of ``algo`` (CoPE's joint update: its samples laid out by ``cope.packing``)."""
    batch = collate(eps, PAD)
    if not algo.startswith("cope"):
        return batch
    chunks, _ = build_prompted(eps, CHAT, PlanPrompt(_Tokenizer()), K=3)  # the wins only (cope.gate=wins)
    assert {eps[c.episode].branch_of >= 0 for c in chunks} == {True, False}  # from roots and from forked leaves
    return (pack_forecasts if algo == "cope_packed" else plain_forecasts)(batch, eps, chunks, PAD)


OBJECTIVES = {
    "grpo": lambda: [PolicyGradient(), KLPenalty(weight=0.1)],
    "echo": lambda: [PolicyGradient(), ObservationLoss(weight=0.5)],
    "cope_packed": lambda: [PolicyGradient(), ForecastLoss(weight=1.0, update="joint")],
    "cope_plain": lambda: [PolicyGradient(), ForecastLoss(weight=1.0, update="joint")],
}
LOSSES = {"grpo": ("loss/pg", "loss/kl"), "echo": ("loss/pg", "loss/echo"), "cope_packed": ("loss/pg", "loss/forecast"),
          "cope_plain": ("loss/pg", "loss/forecast")}


@pytest.mark.parametrize("budget", [None, BUDGET])
@pytest.mark.parametrize("algo", list(OBJECTIVES))
def test_the_tree_gives_the_per_leaf_loss_and_gradients(algo, budget):
    """At T = 0.7 (shared action tokens are tempered once for all their leaves), whole and with group 0 cut by the
    budget into several tries (micro-batches of whole packed rows)."""
    eps = _episodes()
    model = exactness_model("qwen2", vocab_size=64)
    module = exactness_module(model, OBJECTIVES[algo](), CHAT, 0.7, budget)
    plain = _batch(eps, algo)  # reference: one row per leaf (CoPE's packed rows: their trees' dense mask on SDPA)
    shared = pack_groups(_batch(eps, algo), eps, max_row_tokens=budget)
    pack, real = shared["packed"], shared["attention_mask"].bool()
    assert pack.tokens < int(real.sum())
    if budget is None:
        assert _check_shared_turns(shared, eps) == 4
        if algo != "cope_packed":  # plain rows: the trie of each group exactly (CoPE's segments add nodes of their own)
            assert pack.tokens == _distinct(shared, eps) + (int(real[len(eps):].sum()) if algo == "cope_plain" else 0)
    else:  # group 0 cut into tries that fit, each still sharing (a leaf sorted next to its parent)
        rows_of_group0 = {p for p, m in enumerate(pack.members) for r in m if r < len(eps) and eps[r].group == 0}
        assert len(rows_of_group0) > 1 and max(pack.lengths) <= max(BUDGET, int(real.sum(-1).max()))
        assert _check_shared_turns(shared, eps, together=True) >= 1
        assert len(module.micro_batches(shared)) > 2
    ref = scored_step(module, plain)
    use_tree_attention(model)
    got = scored_step(module, shared)
    for a, b in zip(got[:2], ref[:2]):  # old and reference log-probs
        if b is not None:
            torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
    assert got[2].item() == pytest.approx(ref[2].item(), abs=1e-5)
    for k in LOSSES[algo]:
        assert abs(float(ref[3][k])) > 0 and float(got[3][k]) == pytest.approx(float(ref[3][k]), abs=1e-5), k
    assert all(g.abs().sum() > 0 for g in got[4])
    for a, b in zip(got[4], ref[4]):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_the_trie_keeps_a_row_whole_and_undoes_an_insertion():
    """A row's own tree may hold a node that sees nothing of its ancestors (a second root): the row's roots stay in
    one unit. An insertion undone leaves the trie as it was (what the budget's cut relies on)."""
    from cope.train.packing.token_trie import TokenTrie  # here: the other tests run against any group packing

    keys = [(i, int(Role.PROMPT), False) for i in (1, 7, 8, 9, 10, 11, 12, 13)]
    trie = TokenTrie()
    trie.add(0, keys, (TreeNode(0, 5, -1, 0), TreeNode(5, 8, 0, 0)))  # columns 5..7: a sequence of their own
    trie.add(1, [*keys[:3], (30, int(Role.ACTION), True)], (TreeNode(0, 4, -1, 0),))  # shares row 0's first 3 tokens
    assert len(trie) == 9 and trie.rows == 2
    mark = trie.mark()
    trie.add(2, [(1, int(Role.PROMPT), False), (40, int(Role.ACTION), True)], (TreeNode(0, 2, -1, 0),))
    trie.undo(mark)
    assert len(trie) == 9 and trie.rows == 2
    (unit,) = trie.units()
    assert [r for r, _ in unit.places] == [0, 1] and sum(n.parent < 0 for n in unit.nodes) == 2
    places = dict(unit.places)
    assert [unit.ids[c] for c in places[0]] == [k[0] for k in keys] and places[1][:3] == places[0][:3]
    tree = PrefixTree(rows=(unit.nodes,), length=len(unit.ids))
    pred = tree.predecessors()[0].tolist()
    assert pred[places[0][5]] == -1 and [pred[c] for c in places[0][6:]] == places[0][5:7]
    assert pred[places[1][3]] == places[0][2]  # row 1's own token is predicted by the shared token before it
