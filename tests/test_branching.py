"""Branched rollouts (cope.train.collect.branching): each task's GRPO group grown as a tree of forked episodes.

The tiny random policy on 6x6 mazes (8 steps): every group has exactly ``group_size`` leaves, a child's shared turns
are its parent's ids, a replayed fork says what the original said (and one that does not is aborted and counted),
the leaves' advantages are plain GRPO over them, a uniform tree takes fewer env steps than the flat group, and the
group packing gives the unpacked loss and gradients on a branched group."""
from __future__ import annotations

import functools
import itertools

import pytest
import torch
from tiny_fixtures import branched_epoch, exactness_model, exactness_module, maze_factory, scored_step, tiny_chat, tiny_policy

from cope.algos.grpo import PolicyGradient
from cope.batch import collate
from cope.envs.base import Task
from cope.envs.maze import MazeEnv
from cope.rollout.engine import EnvRuntime, HFEngine, Sampling
from cope.train.collect.branching.collector import METRICS, BranchingCollector
from cope.train.collect.branching.forks import ReplayMismatch, Trace, replay
from cope.train.collect.collector import CollectorHost
from cope.train.collect.experience import assign_advantages
from cope.train.packing.group_prefix import pack_groups
from cope.train.packing.tree_batch import use_tree_attention

G, ROOTS = 8, 4


def _collect(policy, env=maze_factory, tasks: int = 3, **branch):
    return branched_epoch(policy, env, tasks, G, **{"roots": ROOTS, **branch})


@pytest.fixture(scope="module")
def policy():
    return tiny_policy()


@pytest.fixture(scope="module")
def records(policy):
    return {t: _collect(policy, trigger=t) for t in ("uniform", "random")}


def _check_tree(episodes):
    for _g, members in itertools.groupby(enumerate(episodes), key=lambda x: x[1].group):
        members = list(members)
        assert len(members) == G  # exactly the budget: never over, never under
        assert sum(e.branch_of < 0 for _, e in members) >= ROOTS
        for i, e in members:
            if e.branch_of < 0:
                assert e.shared_steps == 0
                continue
            parent = episodes[e.branch_of]
            assert e.branch_of < i and parent.group == e.group and 1 <= e.shared_steps < parent.num_steps
            end = parent.steps[e.shared_steps - 1].obs_end
            assert e.tokens[:end] == parent.tokens[:end] and e.roles[:end] == parent.roles[:end]
            assert [s.action_text for s in e.steps[:e.shared_steps]] == [s.action_text for s in parent.steps[:e.shared_steps]]


@pytest.mark.parametrize("trigger", ["uniform", "random"])
def test_every_group_has_its_budget_of_leaves_and_children_share_their_parents_ids(records, trigger):
    rec = records[trigger]
    _check_tree(rec.episodes)
    m = rec.metrics
    assert set(METRICS) <= set(m) and m["rollout/branch_leaves"] == 3 * G
    assert m["rollout/branch_forks"] + m["rollout/branch_fill_roots"] == 3 * (G - ROOTS)
    assert m["rollout/branch_replay_mismatch"] == 0 and m["rollout/branch_replay_env_steps"] == 0  # the maze forks by copy


def test_a_uniform_tree_takes_fewer_env_steps_and_tokens_than_the_flat_group(records):
    rec = records["uniform"]
    m = rec.metrics
    assert m["rollout/branch_forks"] == 3 * (G - ROOTS)
    flat = sum(e.num_steps for e in rec.episodes)
    assert m["rollout/branch_flat_env_steps_est"] == flat
    assert m["rollout/branch_env_steps"] == flat - sum(e.shared_steps for e in rec.episodes) < flat
    for g in range(3):  # per group too
        group = [e for e in rec.episodes if e.group == g]
        assert sum(e.num_steps - e.shared_steps for e in group) < sum(e.num_steps for e in group)
    assert m["rollout/branch_generated_tokens"] < m["rollout/branch_flat_generated_tokens_est"]
    assert 0 < m["rollout/branch_saving"] < 1
    assert m["counters/env_steps"] == m["rollout/branch_env_steps"]  # the run counts what the trees cost


def test_leaf_advantages_are_grpo_over_the_leaves(records):
    eps = records["uniform"].episodes
    for j, e in enumerate(eps):  # rewards that do not cancel (the random policy rarely wins)
        e.reward = float((j * 7) % 5) / 4
    assign_advantages(eps, [e.group for e in eps], "grpo")
    for g in range(3):
        leaves = [e for e in eps if e.group == g]
        r = torch.tensor([e.reward for e in leaves], dtype=torch.float64)
        want = (r - r.mean()) / (r.std(unbiased=False) + 1e-6)
        torch.testing.assert_close(torch.tensor([e.advantage for e in leaves], dtype=torch.float64), want, atol=1e-6, rtol=0)


def test_a_replayed_fork_says_what_the_original_said_on_the_maze():
    env, task = MazeEnv(sizes=[6], max_steps=8), Task("maze", "train", 3)
    trace = Trace(task, env.reset(task))
    snapshots = {}
    for k, a in enumerate(["north", "east", "south", "west", "south", "east"], start=1):
        trace.actions.append(a)
        trace.results.append(env.step(a))
        snapshots[k] = env.fork()
        if trace.results[-1].done:
            break
    for k in range(len(trace.actions)):
        again, taken = replay(maze_factory, trace, k)
        assert taken == k
        if k:
            assert again.render() == snapshots[k].render()
            twin = snapshots[k].fork()
        else:
            twin = MazeEnv(sizes=[6], max_steps=8)
            twin.reset(task)
        # the next step of the replayed fork and of the original's copy agree
        assert again.step(trace.actions[k]).observation == twin.step(trace.actions[k]).observation
    trace.results[1].observation = "something else"
    with pytest.raises(ReplayMismatch, match="replayed step 2"):
        replay(maze_factory, trace, 3)


def test_the_collector_forks_by_replay_with_every_observation_checked(policy):
    rec = _collect(policy, tasks=2, trigger="uniform", replay=True)
    _check_tree(rec.episodes)
    m = rec.metrics
    shared = sum(e.shared_steps for e in rec.episodes)
    assert m["rollout/branch_replay_mismatch"] == 0 and m["rollout/branch_replay_env_steps"] == shared > 0
    assert m["rollout/branch_env_steps"] == m["rollout/branch_flat_env_steps_est"]  # replays cost what they share


class DriftingMaze(MazeEnv):
    """A maze whose observations count the instance's steps across episodes: a replay never says the same."""

    fork = None  # no copy: only replay
    forks_by_replay = True
    made = itertools.count()

    def __init__(self, **kw):
        super().__init__(sizes=[6], max_steps=8, **kw)
        self.serial = next(self.made)

    def step(self, action):
        out = super().step(action)
        out.observation += f" ({self.serial})"
        return out


def test_a_replay_that_drifts_aborts_its_branch_and_is_counted(policy):
    rec = _collect(policy, env=DriftingMaze, tasks=2, trigger="uniform")
    children = [e for e in rec.episodes if e.branch_of >= 0]
    m = rec.metrics
    assert children and all(e.aborted for e in children) and not any(e.aborted for e in rec.episodes if e.branch_of < 0)
    assert m["rollout/branch_replay_mismatch"] == len(children) and m["env/aborted_episodes"] >= len(children)


def test_the_entropy_trigger_reads_the_sampled_log_probs(policy):
    rec = _collect(policy, tasks=2, trigger="entropy")
    _check_tree(rec.episodes)
    assert all(s.sampler_logprobs for e in rec.episodes if not e.aborted for s in e.steps)


def test_the_tag_trigger_forks_before_a_tagged_action_only(policy):
    rec = _collect(policy, tasks=2, trigger="tag", tag="e")  # the random policy's bytes: a marker it often says
    for e in rec.episodes:
        if e.branch_of >= 0:
            assert "e" in rec.episodes[e.branch_of].steps[e.shared_steps].action_text
    m = rec.metrics
    assert m["rollout/branch_forks"] > 0
    assert m["rollout/branch_forks"] + m["rollout/branch_fill_roots"] == 2 * (G - ROOTS)


def _host(engine, sampling: Sampling | None = None) -> CollectorHost:
    return CollectorHost(engine=engine, sampling=sampling or Sampling(), task_stream=None, rollout=None, version=lambda: 0,
                         max_epochs=lambda: None, world=lambda: 1, stopping=lambda: False)


class Rigid(MazeEnv):
    fork = None
    forks_by_replay = False


class CopyOnly(MazeEnv):
    forks_by_replay = False


@pytest.mark.parametrize("kw, env, sampling, match", [
    (dict(roots=9), maze_factory, Sampling(), r"branch\.roots must be in \[1, data\.group_size=8\], got 9"),
    (dict(roots=0), maze_factory, Sampling(), r"branch\.roots must be in \[1, data\.group_size=8\], got 0"),
    (dict(trigger="beam"), maze_factory, Sampling(), r"branch\.trigger must be one of"),
    (dict(trigger="entropy"), maze_factory, Sampling(top_p=0.9), r"branch\.trigger=entropy needs .* data\.sampling\.top_p=1"),
    (dict(max_depth=0), maze_factory, Sampling(), r"branch\.max_depth must be null"),
    ({}, Rigid, Sampling(), r"env: Rigid cannot fork"),
    ({}, maze_factory, Sampling(temperature=0.0), r"data\.sampling\.temperature=0"),
])
def test_bad_branch_settings_fail_at_construction_naming_the_key(kw, env, sampling, match):
    engine = HFEngine(env=env, runtime=EnvRuntime(), max_context=512)
    with pytest.raises(ValueError, match=match):
        BranchingCollector(host=_host(engine, sampling), group_size=G, **kw)


def test_engines_and_env_workers_it_cannot_run_are_refused_by_name():
    class Server:
        samples_in_process = False

    with pytest.raises(ValueError, match=r"data\.engine = Server: the branching collector .*rollout=hf"):
        BranchingCollector(host=_host(Server()), group_size=G)
    engine = HFEngine(env=CopyOnly, runtime=EnvRuntime(workers=2), max_context=512)  # workers replay every child
    with pytest.raises(ValueError, match=r"data\.env_runtime\.workers=2: env CopyOnly forks only by copy"):
        BranchingCollector(host=_host(engine), group_size=G)


def test_a_packed_branched_group_gives_the_unshared_loss_and_gradients(records):
    """GRPO on one branched group, packed by data.share_prefix's group packing against unpacked rows. The packing is
    the group's trie: the common prefix its root, each child's shared turns stored once under it (counts and nested
    trees: tests/test_branch_tree_packing.py)."""
    eps = [e for e in records["uniform"].episodes if e.group == 0]
    for j, e in enumerate(eps):
        e.reward = float(j % 3)
    assign_advantages(eps, [e.group for e in eps], "grpo")
    chat = tiny_chat()
    model = exactness_model(vocab_size=int(max(max(e.tokens) for e in eps)) + 1)
    module = exactness_module(model, [PolicyGradient()], chat)
    plain, shared = collate(eps, 0), pack_groups(collate(eps, 0), eps)
    trunk = shared["packed"].tree.rows[0][0].end
    assert trunk >= eps[0].prompt_len  # the trie's root: the group's common prefix
    child = next(i for i, e in enumerate(eps) if e.branch_of >= 0)
    parent_ep = records["uniform"].episodes[eps[child].branch_of]
    parent, end = next(i for i, e in enumerate(eps) if e is parent_ep), parent_ep.steps[eps[child].shared_steps - 1].obs_end
    assert torch.equal(shared["packed"].index[child, :end], shared["packed"].index[parent, :end])  # shared turns once
    ref = scored_step(module, plain)
    use_tree_attention(model)
    got = scored_step(module, shared)
    torch.testing.assert_close(got[0], ref[0], atol=1e-5, rtol=0)
    assert abs(float(ref[3]["loss/pg"])) > 0 and float(got[3]["loss/pg"]) == pytest.approx(float(ref[3]["loss/pg"]), abs=1e-5)
    for a, b in zip(got[4], ref[4]):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


@pytest.mark.long
def test_train_py_runs_two_epochs_with_branched_rollouts(run_train, read_metrics, tmp_path):
    """The whole path: branched groups, TreeRL's node values, each group trained as the trie of its leaves (the micro
    model wins nothing in two epochs: the values themselves are tested in tests/test_node_values.py)."""
    run_train(["+collector=branching", "branch.roots=2", "algo.advantage_mode=node_value", "data.share_prefix=true"],
              tmp_path)
    cols = read_metrics(tmp_path / "csv" / "metrics.csv")
    assert len(cols["rollout/branch_saving"]) == 2 and all(v == 8 for v in cols["rollout/branch_leaves"])
    assert all(0 < v < 1 for v in cols["rollout/branch_saving"])
    assert all(0 < v < 1 for v in cols["data/shared_fraction"])  # the tries forward fewer tokens than the rows hold


@pytest.mark.long
def test_a_replayed_fork_says_what_the_original_said_on_textworld(tmp_path):
    pytest.importorskip("textworld")
    from cope.envs.textworld.env import TextWorldEnv

    factory = functools.partial(TextWorldEnv, challenge="tw-simple", cache_dir=str(tmp_path), max_steps=8)
    env, task = factory(), Task("textworld", "train", 0)
    trace = Trace(task, env.reset(task))
    for _ in range(4):  # the walkthrough's first moves
        action = env.expert_action() or "look"
        trace.actions.append(action)
        trace.results.append(env.step(action))
        if trace.results[-1].done:
            break
    env.close()
    for k in range(len(trace.actions)):
        again, taken = replay(factory, trace, k)
        try:  # the replayed fork's next step is what the original's was
            assert taken == k and again.step(trace.actions[k]).observation == trace.results[k].observation
        finally:
            again.close()
