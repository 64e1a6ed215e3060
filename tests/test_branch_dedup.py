"""Which branched leaves are trained, and children stopped early (cope.train.collect.branching.leaves, .stops).

Hand-made trees: identical leaves collapse to one (a duplicate's child re-linked to its twin, node values from the
whole tree), J_max keeps ``min(j_max, distinct)`` leaves per task by a seeded draw, and two ranks that dropped
different numbers of leaves still cut the same number of minibatches (the full epoch's). On the maze, with an actor
that walks back and forth: a child that revisits a state stops, is counted and is not trained, the same in process and
over an env batch (the env-worker path). Bad settings fail at construction, naming the key."""
from __future__ import annotations

import functools
import random

import pytest
from tiny_fixtures import branched_epoch, maze_factory, tiny_chat, tiny_policy, tiny_tokenizer

from cope.envs.base import EnvReset, EnvStep, Task
from cope.envs.runtime.batch import InProcessEnvs
from cope.episode import EndReason, Episode, Role, Step
from cope.rollout.engine import EnvRuntime, HFEngine, Sampling
from cope.rollout.loop import RolloutStats
from cope.train.collect.branching.collector import METRICS, BranchingCollector
from cope.train.collect.branching.forks import Trace
from cope.train.collect.branching.leaves import choose_leaves, fork_from_twins
from cope.train.collect.branching.node_values import node_value_advantages
from cope.train.collect.branching.stops import StopRule
from cope.train.collect.branching.tree import Loop, ScriptedActor, close, grow
from cope.train.collect.branching.triggers import choose_forks
from cope.train.collect.collector import Collected, CollectorHost
from cope.train.collect.counters import RunCounters
from cope.train.collect.epoch_builder import EpochBuilder
from cope.train.collect.experience import cut_minibatches


def _leaf(actions: list[int], group: int = 0, reward: float = 0.0, parent: int = -1, shared: int = 0,
          aborted: bool = False) -> Episode:
    """One action token and one observation token per step (the observation: the action's id + 100)."""
    e = Episode(task=Task("maze", "train", group), group=group, reward=reward, branch_of=parent, shared_steps=shared,
                end_reason=EndReason.ABORTED if aborted else EndReason.DONE)
    e.append([1], Role.PROMPT)
    e.prompt_len = 1
    for a in actions:
        a0, a1 = e.append([a], Role.ACTION)
        o0, o1 = e.append([a + 100], Role.OBSERVATION)
        e.steps.append(Step(a0, a1, True, True, str(a), obs_start=o0, obs_end=o1))
    return e


class _Engine:
    def env_stats(self) -> dict[str, int]:
        return {}


def _build(got: Collected, minibatch_size: int, mode: str = "grpo"):
    builder = EpochBuilder(advantage_mode=mode, minibatch_size=minibatch_size, ppo_epochs=1, share_prefix=False,
                           engine=_Engine(), counters=RunCounters(), reduce=lambda values, op="sum": list(values))
    return builder.build(0, got, pad_id=0, max_row_tokens=None, off_policy=False)


def _collected(eps: list[Episode], trained: list[int] | None, nominal: int | None) -> Collected:
    return Collected(eps, [e.group for e in eps], RolloutStats(episodes=len(eps)), random.Random(0), 0.0, {},
                     trained=trained, nominal=nominal)


def _group_tree() -> list[Episode]:
    """Task 0: root A; root B identical to A; C forked from B after step 1 (its own step 2 differs); D forked from A
    after step 2, identical to A; root E distinct. Task 1: one leaf with A's ids (another task: not a duplicate)."""
    return [_leaf([5, 6, 7], reward=1.0), _leaf([5, 6, 7], reward=1.0), _leaf([5, 9, 9], parent=1, shared=1),
            _leaf([5, 6, 7], reward=1.0, parent=0, shared=2), _leaf([8, 8]), _leaf([5, 6, 7], group=1, reward=1.0)]


def test_identical_leaves_collapse_to_one_and_a_duplicates_child_forks_from_its_twin():
    eps = _group_tree()
    chosen = choose_leaves(eps, dedup=True, j_max=None, rng=random.Random(0))
    assert chosen.trained == [0, 2, 4, 5] and chosen.duplicates == 2 and chosen.twins == {1: 0, 3: 0}
    assert choose_leaves(eps, dedup=False, j_max=None, rng=random.Random(0)).trained == list(range(6))
    fork_from_twins(eps, chosen)
    assert eps[2].branch_of == 0 and eps[2].shared_steps == 1  # B's child: now A's (the same ids up to its fork)
    want = node_value_advantages(eps, [e.group for e in eps])  # the whole tree, duplicates included
    rec = _build(_collected(eps, chosen.trained, nominal=6), minibatch_size=2, mode="node_value")
    assert [e.tokens for e in rec.episodes] == [eps[i].tokens for i in (0, 2, 4, 5)]
    assert [e.step_advantages for e in rec.episodes] == [want[i] for i in (0, 2, 4, 5)]
    child = rec.episodes[1]
    assert child.branch_of == 0 and rec.episodes[0].tokens[:3] == child.tokens[:3]  # renumbered into the record
    assert sorted(i for mb in rec.minibatches for i in mb["episode_index"].tolist()) == [0, 1, 2, 3]


def test_a_kept_child_of_a_dropped_parent_links_to_its_nearest_kept_ancestor():
    eps = [_leaf([5, 6, 7, 8]), _leaf([5, 6, 9, 9], parent=0, shared=2), _leaf([5, 6, 9, 4], parent=1, shared=3)]
    rec = _build(_collected(eps, [0, 2], nominal=3), minibatch_size=4)
    assert [(e.branch_of, e.shared_steps) for e in rec.episodes] == [(-1, 0), (0, 2)]  # shares 2 steps with the root
    assert (eps[2].branch_of, eps[2].shared_steps) == (1, 3)  # the collector's list is left as it was


def test_j_max_keeps_min_of_the_cap_and_the_distinct_leaves_per_task_by_a_seeded_draw():
    eps = [_leaf([k, k]) for k in range(6)] + [_leaf([7]), _leaf([7])] + [_leaf([k], group=1) for k in (1, 2)]
    eps.append(_leaf([3], group=1, aborted=True))  # an aborted leaf trains nothing: outside the draw, kept
    per_task = lambda c: [sum(eps[i].group == g and not eps[i].aborted for i in c.trained) for g in (0, 1)]  # noqa: E731
    draws = {}
    for seed in range(8):
        c = choose_leaves(eps, dedup=True, j_max=3, rng=random.Random(seed))
        assert per_task(c) == [3, 2] and 10 in c.trained  # min(3, 7 distinct), min(3, 2 distinct)
        assert c.duplicates == 1 and c.capped == 4
        assert c == choose_leaves(eps, dedup=True, j_max=3, rng=random.Random(seed))  # the same draw for the same seed
        draws[seed] = tuple(c.trained)
    assert len(set(draws.values())) > 1  # and the seed decides it
    assert per_task(choose_leaves(eps, dedup=False, j_max=3, rng=random.Random(0))) == [3, 2]
    assert per_task(choose_leaves(eps, dedup=False, j_max=None, rng=random.Random(0))) == [8, 2]


def test_two_ranks_that_dropped_different_leaves_cut_the_same_number_of_minibatches():
    """DDP: every rank must take the same optimizer steps. Both ranks collected 2 tasks x 4 leaves (nominal 8); rank 0
    trains all of them, rank 1 three (dedup, J_max, stops). With minibatches of 2 both cut the full epoch's 4."""
    def rank(trained):
        eps = [_leaf([10 * g + k, k], group=g, reward=float(k % 2)) for g in range(2) for k in range(4)]
        return _build(_collected(eps, trained, nominal=8), minibatch_size=2)

    full, dropped = rank(list(range(8))), rank([0, 4, 5])
    assert len(full.minibatches) == len(dropped.minibatches) == 4
    assert [len(mb["episode_index"]) for mb in full.minibatches] == [2, 2, 2, 2]
    idle = [mb for mb in dropped.minibatches if mb["episode_index"].tolist() == [-1]]
    assert len(idle) == 1 and not idle[0]["action_mask"].any() and idle[0]["aborted"].all() and idle[0]["aux_row"].all()
    assert sorted(i for mb in dropped.minibatches for i in mb["episode_index"].tolist() if i >= 0) == [0, 1, 2]
    # without the nominal count each rank cuts its own: 4 against 2, and the ranks' gradient all-reduces would not meet
    eps = dropped.episodes
    assert len(cut_minibatches(eps, 2, 0, random.Random(0))) == 2
    sizes = [len(mb["episode_index"]) for mb in cut_minibatches(eps * 3, 2, 0, random.Random(0), count=4)]
    assert sorted(sizes) == [2, 2, 2, 3]  # spread over the count, sizes at most one apart


def test_a_branched_group_stays_in_one_minibatch_where_the_packing_shares_its_tree():
    """With the nominal count (the branching collector), each group's leaves stay together in collection order: 3
    groups of 4 leaves in minibatches of 4 give one group per minibatch (an episode-level shuffle would spread them);
    with a leaf dropped, a group straddles at most two minibatches."""
    eps = [_leaf([10 * g + k, k], group=g, reward=float(k % 2)) for g in range(3) for k in range(4)]
    for seed in range(4):
        cut = cut_minibatches(eps, 4, 0, random.Random(seed), count=3, keep_groups=True)
        assert sorted(sorted({eps[i].group for i in mb["episode_index"].tolist()}) for mb in cut) == [[0], [1], [2]]
        assert all(mb["episode_index"].tolist() == sorted(mb["episode_index"].tolist()) for mb in cut)
    kept = [e for j, e in enumerate(eps) if j != 5]
    cut = cut_minibatches(kept, 4, 0, random.Random(0), count=3, keep_groups=True)
    for g in range(3):
        assert sum(any(kept[i].group == g for i in mb["episode_index"].tolist()) for mb in cut) <= 2


def test_without_shared_prefixes_a_branched_epoch_mixes_groups_across_minibatches():
    """Without the group packing nothing gains from whole groups, and a minibatch of whole groups trains fewer tasks
    per optimizer step than a flat epoch's: the episodes mix across groups as a flat epoch's do, the same order."""
    eps = [_leaf([10 * g + k, k], group=g, reward=float(k % 2)) for g in range(3) for k in range(4)]
    mixed = 0
    for seed in range(4):
        cut = cut_minibatches(eps, 4, 0, random.Random(seed), count=3)
        flat = cut_minibatches(eps, 4, 0, random.Random(seed))
        assert [mb["episode_index"].tolist() for mb in cut] == [mb["episode_index"].tolist() for mb in flat]
        mixed += sum(len({eps[i].group for i in mb["episode_index"].tolist()}) > 1 for mb in cut)
    assert mixed > 0


# -- on the maze, with a walking actor ------------------------------------------------------------------------------
class Walker:
    """An actor that walks north, south, north, ... from each slot's first call of a wave (a child: from its fork),
    after ``openings`` in the waves after the first (the children's, and fill roots')."""

    def __init__(self, *args, openings: tuple[str, ...] = (), **kw):
        tok, chat = tiny_tokenizer(), tiny_chat()
        self.ids = {d: tok(d, add_special_tokens=False)["input_ids"] + [chat.stop_id]
                    for d in ("north", "south", "east", "west")}
        self.openings, self.wave, self.turn = list(openings), 0, {}

    def reset(self) -> None:
        self.wave, self.turn = self.wave + 1, {}

    def __call__(self, contexts, admissible, keys):
        out = []
        for k in keys:
            t = self.turn[k] = self.turn.get(k, -1) + 1
            head = self.openings if self.wave > 1 else []
            out.append(list(self.ids[head[t] if t < len(head) else ("north", "south")[(t - len(head)) % 2]]))
        return out


def _grow(envs, stops: StopRule, openings: tuple[str, ...] = (), leaves: int = 4, roots: int = 2, per_wave: int = 4):
    """The trees of 6 maze tasks; at most ``per_wave`` uniform forks per task and wave."""
    tasks, groups = [Task("maze", "train", i) for i in range(6)], list(range(6))
    loop = Loop(maze_factory, maze_factory(), tiny_tokenizer(), tiny_chat(), 512, 4, None, True, 0, envs, stops)
    choose = functools.partial(choose_forks, "uniform", p=0.5, tag="", max_depth=None)
    grown = grow(loop, tasks, groups, leaves=leaves, roots=roots, actor=ScriptedActor(Walker(openings=openings)),
                 choose=lambda parents, slots, rng: choose(parents, min(slots, per_wave), rng), rng=random.Random(0))
    close(grown)
    return grown


def test_a_child_that_walks_back_stops_the_same_in_process_and_over_an_env_batch():
    """Children open east, west (back at the fork's cell), one fork per task and wave. The in-process slots
    (TracingEnv) and the env-worker path (TracingBatch over the engine's batch; here its in-process twin) stop the same
    children at the same step; a stopped child is never forked from (its task fills the slot with a root)."""
    trees = []
    for envs in (None, InProcessEnvs(env_factory=maze_factory)):
        grown = _grow(envs, StopRule(loops=True, duplicates=True), ("east", "west"), leaves=3, roots=1, per_wave=1)
        trees.append([(n.episode.tokens, n.parent, n.episode.shared_steps, n.stop) for n in grown.nodes])
        assert grown.stops["loop"] == sum(n.stop == "loop" for n in grown.nodes) > 0
        stopped = {i for i, n in enumerate(grown.nodes) if n.stop is not None}
        assert all(grown.nodes[i].parent >= 0 for i in stopped)  # never a root
        assert not any(n.parent in stopped for n in grown.nodes) and grown.fill_roots > 0  # never a parent
        assert any(grown.nodes[i].episode.num_steps - grown.nodes[i].episode.shared_steps > 1 for i in stopped)
        if envs is not None:
            envs.close()
    assert trees[0] == trees[1]
    grown = _grow(None, StopRule(), ("east", "west"), leaves=3, roots=1, per_wave=1)
    assert not any(n.stop for n in grown.nodes) and sum(grown.stops.values()) == 0  # off: nothing stops


def test_duplicate_children_stop_against_their_parent():
    grown = _grow(None, StopRule(duplicates=True))  # every child re-walks north, south: its parent's path
    assert grown.stops["duplicate"] == sum(n.parent >= 0 for n in grown.nodes) > 0 and grown.stops["loop"] == 0


def test_the_stop_rule_reads_the_trajectory_so_far():
    """Loops: an observation seen before on the trajectory (shared steps and reset included; never an empty one, never
    the step that ends the episode). Duplicates: the same actions and observations as the parent or a sibling that
    did not stop, at the same length; a child is checked only after its own steps."""
    def trace(moves: str, obs: str) -> Trace:  # one letter per action and per observation
        t = Trace(Task("maze", "train", 0), EnvReset(observation="r"))
        t.actions = list(moves)
        t.results = [EnvStep(observation="" if o == "_" else o, reward=0.0, done=o == "!", valid=True, success=False,
                             score=0.0) for o in obs]
        return t

    loops, dups = StopRule(loops=True), StopRule(duplicates=True)
    assert loops.reason(trace("abc", "xyx"), 2, ()) == "loop"  # back where step 1 was
    assert loops.reason(trace("ab", "xr"), 1, ()) == "loop"  # back at the reset's state
    assert loops.reason(trace("abc", "xyx"), 3, ()) is None  # step 3 is shared: the parent's, not this child's
    assert loops.reason(trace("abc", "_y_"), 1, ()) is None  # an empty observation says nothing about the state
    assert loops.reason(trace("abc", "xy!"), 1, ()) is None  # it ends anyway: no stop
    parent, child = trace("abcd", "wxyz"), trace("abc", "wxy")
    assert dups.reason(child, 2, [parent]) == "duplicate" and loops.reason(child, 2, [parent]) is None
    assert dups.reason(trace("abd", "wxq"), 2, [parent, trace("ab", "wx")]) is None  # a sibling not that far yet
    assert dups.reason(trace("abd", "wxq"), 2, [parent, trace("abd", "wxq")]) == "duplicate"  # a sibling's path
    assert dups.reason(trace("abd", "wxp"), 2, [parent, trace("abd", "wxq")]) is None  # another observation


@pytest.fixture(scope="module")
def policy():
    return tiny_policy()


def _collect(policy, monkeypatch, G: int, openings: tuple[str, ...] = (), tasks: int = 2, **branch):
    """One epoch of the branching collector through the DataModule, the sampler replaced by a :class:`Walker`."""
    monkeypatch.setattr("cope.rollout.hf_actor.CachedSamplingActor", functools.partial(Walker, openings=openings))
    return branched_epoch(policy, maze_factory, tasks, G, minibatch_size=2, **branch)


def test_the_collector_trains_one_of_identical_leaves_and_keeps_every_childs_link(policy, monkeypatch):
    """Per task two identical roots A, B; A's children fork at steps 3 and 5, B's at 4, each opening east. B is A's
    duplicate: dropped, its child (distinct) re-linked to A, so all three children keep a parent in the record."""
    rec = _collect(policy, monkeypatch, G=5, openings=("east",), roots=2)
    m = rec.metrics
    assert m["rollout/branch_leaves"] == 10 and m["rollout/branch_duplicate_leaves"] == 2
    assert m["rollout/branch_trained_leaves"] == len(rec.episodes) == 8 and m["rollout/branch_capped_leaves"] == 0
    assert len({tuple(e.tokens) for e in rec.episodes}) == 8
    for g in range(2):
        kids = [e for e in rec.episodes if e.group == g and e.branch_of >= 0]
        assert sorted(e.shared_steps for e in kids) == [3, 4, 5]
        for e in kids:
            parent = rec.episodes[e.branch_of]
            end = parent.steps[e.shared_steps - 1].obs_end
            assert parent.group == g and parent.branch_of < 0 and parent.tokens[:end] == e.tokens[:end]
    assert len(rec.minibatches) == 5  # the full epoch's 2 x 5 leaves in minibatches of 2


def test_a_loop_stop_is_counted_and_the_stopped_child_is_not_trained(policy, monkeypatch):
    G, tasks = 4, 2
    rec = _collect(policy, monkeypatch, G=G, roots=2, dedup=False, stop_loops=True)
    m = rec.metrics
    assert set(METRICS) <= set(m)
    stops = m["rollout/branch_stop_loop"]
    assert stops > 0 and m["rollout/branch_stop_duplicate"] == 0
    assert m["rollout/branch_leaves"] == m["rollout/branch_trained_leaves"] == len(rec.episodes) == tasks * G - stops
    assert sum(e.branch_of >= 0 for e in rec.episodes) == m["rollout/branch_forks"] - stops  # no stopped child
    assert m["counters/episodes"] == tasks * G  # the stopped children ran: they count as episodes run ...
    assert m["rollout/branch_env_steps"] > m["rollout/branch_flat_env_steps_est"] - sum(
        e.shared_steps for e in rec.episodes)  # ... and their own steps in the trees' cost
    assert len(rec.minibatches) == tasks * G // 2  # the full epoch's steps


def _host(engine) -> CollectorHost:
    return CollectorHost(engine=engine, sampling=Sampling(), task_stream=None, rollout=None, version=lambda: 0,
                         max_epochs=lambda: None, world=lambda: 1, stopping=lambda: False)


@pytest.mark.parametrize("j_max", [0, -2, True])
def test_a_bad_j_max_fails_at_construction_naming_the_key(j_max):
    engine = HFEngine(env=maze_factory, runtime=EnvRuntime(), max_context=512)
    with pytest.raises(ValueError, match=r"branch\.j_max must be null \(no cap\) or an integer >= 1"):
        BranchingCollector(host=_host(engine), group_size=4, j_max=j_max)
    with pytest.raises(ValueError, match=r"branch\.j_max"):
        choose_leaves([], dedup=True, j_max=0, rng=random.Random(0))


def test_the_defaults_train_every_distinct_leaf_from_two_roots_and_stop_nothing():
    engine = HFEngine(env=maze_factory, runtime=EnvRuntime(), max_context=512)
    c = BranchingCollector(host=_host(engine), group_size=4)
    assert (c.roots, c.dedup, c.j_max, c.stops) == (2, True, None, StopRule())
