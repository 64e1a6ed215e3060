"""GRPO groups forwarded as the trie of their rows (``data.share_prefix=true``, :mod:`cope.train.packing.group_prefix`).

The packed view holds every real token of the minibatch, each distinct prefix of a group once (episodes that share
their first action share it), at the positions of the unshared rows; old and reference log-probs, the policy-gradient
+ ECHO + KL loss and every LoRA gradient equal the unshared minibatch's, on Qwen2 and Llama, whole and in
micro-batches of whole packed rows, at T = 1 and T = 0.7; CoPE's temporal-ensemble rows likewise; rows that are trees
already join their group's trie. Branched groups: tests/test_branch_tree_packing.py."""
from __future__ import annotations

import random

import pytest
import torch
from tiny_fixtures import exactness_model, exactness_module, scored_step

from cope.algos.echo import ObservationLoss
from cope.algos.grpo import KLPenalty, PolicyGradient
from cope.batch import collate
from cope.chat import ChatFormat
from cope.envs.base import Task
from cope.episode import Episode, Role, Step
from cope.train.packing.group_prefix import pack_groups
from cope.train.packing.prefix_tree import PrefixTree
from cope.train.packing.tree_batch import PackedRows, use_tree_attention

PAD = 0
CHAT = ChatFormat(system_open=(1,), user_open=(2,), assistant_open=(3,), turn_end=(4,), newline=(5,))


def _episode(task: int, group: int, seed: int, steps: int, first_action: list[int] | None = None) -> Episode:
    """A transcript whose prefix (system prompt, task, first observation) is fixed by ``task``; actions and later
    observations are drawn from ``seed``; ``first_action`` fixes the first action (to share beyond the prompt)."""
    task_rng, rng = random.Random(task), random.Random(seed)
    ep = Episode(task=Task("toy", "train", task), group=group, success=False, score=0.0)
    ep.append([*CHAT.system_open, *(task_rng.randrange(6, 64) for _ in range(6)), *CHAT.turn_end, *CHAT.newline, *CHAT.user_open],
              Role.PROMPT)
    ep.append([task_rng.randrange(6, 64) for _ in range(5)], Role.OBSERVATION)
    ep.append(CHAT.close_turn(), Role.PROMPT)
    for j in range(steps):
        action = first_action if j == 0 and first_action else [rng.randrange(6, 64) for _ in range(rng.randint(1, 3))]
        a0, a1 = ep.append([*action, *CHAT.turn_end], Role.ACTION)
        o0, _ = ep.append(CHAT.after_action(True), Role.PROMPT)
        ep.append([rng.randrange(6, 64) for _ in range(rng.randint(2, 4))], Role.OBSERVATION)
        _, o1 = ep.append(CHAT.close_turn() if j < steps - 1 else [], Role.PROMPT)
        ep.steps.append(Step(a0, a1, True, True, f"a{j}", obs_start=o0, obs_end=o1))
    return ep


def _episodes() -> list[Episode]:
    """Group 0: three episodes (two with the same first action: the trie shares it, and what follows up to where
    their ids part);
    group 1: two; group 2: one (alone in its group: no sharing); group 3: a prompt alone (18 tokens, placed beside
    another tree in a row). Advantages that do not cancel."""
    eps = [_episode(0, 0, 1, 3, [20, 21]), _episode(1, 1, 2, 2), _episode(0, 0, 3, 2, [20, 21]), _episode(2, 2, 4, 1),
           _episode(1, 1, 5, 3), _episode(0, 0, 6, 2), _episode(3, 3, 7, 0)]  # the last: a prompt alone, no action
    for e, adv in zip(eps, (0.9, -0.4, 0.3, 0.5, 0.7, -1.1, 0.0)):
        e.advantage = adv
    return eps


def _batch(eps):
    return collate(eps, PAD)


def test_the_packed_view_holds_every_token_once_per_group_trie():
    eps = _episodes()
    batch = pack_groups(_batch(eps), eps)
    pack = batch["packed"]
    real = batch["attention_mask"].bool()
    flat_ids, flat_pos = pack.input_ids.flatten(), pack.position_ids.flatten()
    assert torch.equal(flat_ids[pack.index[real]], batch["input_ids"][real])  # every token where it is said to be
    assert torch.equal(flat_pos[pack.index[real]], batch["position_ids"][real])  # at the unshared row's position
    assert bool((pack.index[~real] == -1).all())
    row_of = {r: p for p, m in enumerate(pack.members) for r in m}
    assert row_of[0] == row_of[2] == row_of[5] and row_of[1] == row_of[4]  # each group's trie in one packed row
    prefix = 10 + 5 + 3  # the system turn (1 + 6 + 3), the observation (5), close_turn (3): up to the first action
    for group in ((0, 2, 5), (1, 4)):
        assert all(torch.equal(pack.index[r, :prefix], pack.index[group[0], :prefix]) for r in group)
    # rows 0 and 2 share their first action [20, 21] too (and what follows it, up to where their ids part)
    part = int((batch["input_ids"][0] != batch["input_ids"][2]).nonzero()[0])
    assert part > prefix + 2 and torch.equal(pack.index[0, :part], pack.index[2, :part]) and pack.index[0, part] != pack.index[2, part]
    assert pack.index[5, prefix] != pack.index[0, prefix]  # row 5's first action is its own
    distinct = {(eps[r].group, *batch["input_ids"][r, :t].tolist()) for r in range(len(eps)) for t in range(1, int(real[r].sum()) + 1)}
    assert pack.tokens == len(distinct)  # each distinct prefix once (ids decide here: roles follow the scaffold)
    # the packed action mask: the batch's, at every token
    assert torch.equal(pack.action_mask.flatten()[pack.index[real]], batch["action_mask"][real])


def test_rows_that_are_trees_already_join_their_groups_trie():
    """CoPE's packed joint rows (each a tree: ``packed`` is their identity packing) are inserted tree by tree into
    their group's trie: rows whose trees are single roots pack as plain rows do; a batch packed otherwise is refused."""
    eps = _episodes()
    batch = _batch(eps)
    lengths = batch["attention_mask"].sum(-1).tolist()
    tree = PrefixTree.from_lists([[(0, n, -1, 0)] for n in lengths], length=batch["input_ids"].shape[1])
    pack = pack_groups({**batch, "packed": PackedRows.of_rows(batch, tree)}, eps)["packed"]
    plain = pack_groups(batch, eps)["packed"]
    assert pack.tokens == plain.tokens < sum(lengths) and torch.equal(pack.index, plain.index)
    with pytest.raises(ValueError, match="packed already"):
        pack_groups({**batch, "packed": pack}, eps)


def _model(arch: str = "qwen2"):
    return exactness_model(arch, vocab_size=64)


def _module(model, temperature, budget):
    return exactness_module(model, [PolicyGradient(), ObservationLoss(weight=0.5), KLPenalty(weight=0.1)], CHAT, temperature, budget)


@pytest.mark.parametrize("budget", [None, 70])  # 70 tokens: groups cut into tries that fit, one packed row per micro-batch
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_packed_groups_give_the_unshared_loss_and_gradients(arch, temperature, budget):
    model, eps = _model(arch), _episodes()
    module = _module(model, temperature, budget)
    plain = _batch(eps)
    shared = pack_groups(_batch(eps), eps, max_row_tokens=budget)  # as the DataModule does (its max_row_tokens: the module's budget)
    if budget is not None:  # groups cut so that no packed row is longer than the budget (or than one episode)
        parts, pack = module.micro_batches(shared), shared["packed"]
        longest = int(plain["attention_mask"].sum(-1).max())
        assert len(parts) > 3 and max(pack.lengths) <= max(budget, longest)
        assert any(len(m) > 1 for m in pack.members)  # some sharing is left
        assert sorted(r for rows, _ in parts for r in rows.tolist()) == list(range(len(eps)))
    ref = scored_step(module, plain)
    use_tree_attention(model)
    got = scored_step(module, shared)
    for a, b in zip(got[:2], ref[:2]):  # old and reference log-probs
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
    assert got[2].item() == pytest.approx(ref[2].item(), abs=1e-5)
    for k in ("loss/pg", "loss/echo", "loss/kl"):
        assert abs(float(ref[3][k])) > 0 and float(got[3][k]) == pytest.approx(float(ref[3][k]), abs=1e-5), k
    assert all(g.abs().sum() > 0 for g in got[4])
    for a, b in zip(got[4], ref[4]):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_temporal_ensemble_rows_come_from_the_packed_rows():
    """The TE positions ([row, column] of the batch) read the same predictive rows through the packed view, whole
    and in micro-batches whose rows are not contiguous in the batch."""
    model, eps = _model("qwen2"), _episodes()
    plain = _batch(eps)
    act = plain["action_mask"].nonzero()  # (P, 2)
    plain["te_position"] = act[torch.randperm(len(act), generator=torch.Generator().manual_seed(0))[:12]]
    shared = pack_groups(plain, eps)
    for budget in (None, 70):
        module = _module(model, 1.0, budget)
        model.get_base_model().set_attn_implementation("sdpa")
        ref = {}
        for rows, n in module.micro_batches(plain):
            s = module.logprobs(plain, rows, n, rows_at=("te_position",))
            ref.update(dict(zip(s.row_index["te_position"].tolist(), s.rows["te_position"])))
        use_tree_attention(model)
        got = {}
        for rows, n in module.micro_batches(shared):
            s = module.logprobs(shared, rows, n, rows_at=("te_position",))
            got.update(dict(zip(s.row_index["te_position"].tolist(), s.rows["te_position"])))
        assert sorted(got) == sorted(ref) == list(range(12))
        for i in ref:
            torch.testing.assert_close(got[i], ref[i], atol=1e-5, rtol=1e-5)


# A warm-started tiny maze policy (wins and losses in most groups), 4 epochs of 4 groups of 4, minibatches of 8 cut
# into micro-batches of whole packed rows.
RUN = ["model.warm_start_steps=150", "model.warm_start_policy=expert", "env.sizes=[5]", "env.min_distance=1",
       "data.tasks_per_epoch=4", "data.group_size=4", "data.minibatch_size=8", "module.max_tokens_per_microbatch=600",
       "trainer.max_epochs=4", "trainer.check_val_every_n_epoch=2"]
SAME = ("loss/", "policy/", "forecast/", "echo/", "val/success", "rollout/success", "adv/")


@pytest.mark.long
@pytest.mark.parametrize("algo", [["algo=grpo", "algo.objectives.kl.weight=0.05"], ["algo=cope", "cope.gate=all"],
                                  ["algo=cope_echo", "cope.gate=all"]])
def test_a_run_with_shared_group_prefixes_logs_what_the_unshared_run_logs(run_train, read_metrics, tmp_path, algo):
    """Sharing on and off: every step and validation logs the same values to fp32 noise (the runs then draw the same
    rollouts); the shared run logs the fraction of tokens it did not forward (and CoPE's steps forward fewer).
    SGD, not the default AdamW: Adam's first
    step is about lr x g / (|g| + eps), which turns the two runs' fp32 rounding of a near-zero gradient element (it
    differs between CPU kernels) into a move of order lr; SGD's step is lr x g (lr 0.2: a KL per step near AdamW's)."""
    cols = {}
    sgd = ["module.optimizer._target_=torch.optim.SGD", "module.optimizer.lr=0.2"]
    for share in ("true", "false"):
        run_train([*RUN, *algo, *sgd, f"data.share_prefix={share}"], tmp_path / share)
        cols[share] = read_metrics(tmp_path / share / "csv" / "metrics.csv")
    shared, plain = cols["true"], cols["false"]
    # data.share_prefix also shares CoPE's separate forecast steps: the same losses, fewer tokens forwarded
    keys = sorted(k for k in plain if k.startswith(SAME) and k != "forecast/tokens_forwarded")
    assert {"loss/pg", "val/success"} <= set(keys) and any(abs(v) > 1e-3 for v in plain["loss/pg"])
    if "forecast/tokens_forwarded" in plain:
        assert sum(shared["forecast/tokens_forwarded"]) < sum(plain["forecast/tokens_forwarded"])
    for k in keys:
        assert len(shared[k]) == len(plain[k]), k
        for i, (a, b) in enumerate(zip(shared[k], plain[k])):
            assert a == pytest.approx(b, rel=1e-4, abs=1e-5), f"{k} row {i}: {a} vs {b}"
    assert "data/shared_fraction" not in plain and len(shared["data/shared_fraction"]) == 4
    assert all(0.05 < f < 0.9 for f in shared["data/shared_fraction"])

