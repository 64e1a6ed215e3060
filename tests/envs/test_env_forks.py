"""Which envs fork a running episode for branched rollouts (`cope.train.collect.branching`), and does a replay say
what the original said.

* The table :data:`FORKS` is the decision per env class (``fork()`` copies; ``forks_by_replay``: a fresh instance
  reset on the same task and given the same actions says the same, which the branching code checks observation by
  observation): a change that breaks an env's determinism, or that declares the capability silently, fails here
  first. Every shipped ``conf/env`` target must be in it.
* For every env that claims ``forks_by_replay``: one short episode of one task with the env's expert (or its plan)
  and invalid actions mixed in, then a fresh instance replays it; every reset and step result (observation, reward,
  done, validity, score, harness text, admissible actions, info) must be the original's, and the branching code's
  own checks (``check_reset``, ``check_step``: what ``replay`` runs) must pass. TextWorld and the maze have theirs in
  tests/test_branching.py. ALFWorld also in another process (env workers), ScienceWorld also on a JVM that served
  another episode first.
* ALFWorld end to end: the branching collector grows a task's group as a tree on alfworld-style (generated) games
  with the tiny random model in process, every child rebuilt by replay (``branch.replay=true``); and trees of random
  admissible walks, whose shared steps are real moves, grown by the same code (``grow``).

Engines are optional extras: each test skips without its package (and ScienceWorld without Java), as the env's own
tests do.
"""
from __future__ import annotations

import functools
import importlib
import importlib.util
import json
import os
import random
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from alfworld_fixtures import GEN, alfworld_data, cache  # noqa: F401 - fixtures used by name
from network_fixtures import offline  # noqa: F401 - the fixture, used by name

from cope.envs.base import Task
from cope.train.collect.branching.forks import Trace, check_reset, check_step, fork_capability

REPO = Path(__file__).resolve().parents[2]
HAS_TAU2 = importlib.util.find_spec("tau2") is not None
needs_alfworld = pytest.mark.skipif(importlib.util.find_spec("alfworld") is None,
                                    reason="needs the alfworld extra (alfworld==0.4.2)")
needs_jvm = pytest.mark.skipif(importlib.util.find_spec("scienceworld") is None or shutil.which("java") is None,
                               reason="needs the scienceworld package and Java (java on PATH)")
needs_sw = pytest.mark.skipif(importlib.util.find_spec("scienceworld") is None,
                              reason="needs the scienceworld package: pip install 'cope-trainer[scienceworld]'")
needs_tau2 = pytest.mark.skipif(not HAS_TAU2, reason="needs tau2-bench: pip install 'cope-trainer[tau2]'")
INVALID = "dance with the ceiling fan"  # no env here has such an action

# class -> (forks by copy, forks by replay, why)
FORKS = {
    "cope.envs.maze.MazeEnv": (True, True, "a deep copy; the grid is a function of the task"),
    "cope.envs.textworld.env.TextWorldEnv": (True, True, "a Jericho snapshot; generated games are deterministic"),
    "cope.envs.alfworld.env.AlfWorldEnv": (False, True, "PDDL engine without randomness"),
    "cope.envs.scienceworld.env.ScienceWorldEnv": (False, True, "deterministic simulator with -XX:hashCode=2"),
    "cope.envs.webshop.env.WebShopEnv": (False, True, "pure function of the catalog and the actions"),
    "cope.envs.tau2.env.Tau2Env": (False, True, "canned user or solo mode, outside telecom (replay_problem)"),
    "cope.envs.terminal.env.TerminalEnv": (False, False, "commands see the clock and randomness"),
    "cope.envs.appworld.AppWorldEnv": (False, False, "arbitrary Python in a live shell"),
    "cope.envs.appworld.RemoteAppWorldEnv": (False, False, "as AppWorldEnv"),
    "cope.envs.openenv.env.OpenEnvEnv": (False, False, "determinism is the served env's, unknown here"),
    "cope.envs.runtime.chaos.ChaosEnv": (False, False, "a fault-injecting wrapper, never branched"),
}


def _cls(path: str) -> type:
    module, name = path.rsplit(".", 1)
    return getattr(importlib.import_module(module), name)


@pytest.mark.parametrize("path", sorted(FORKS))
def test_each_env_declares_the_fork_capability_decided_for_it(path):
    by_copy, by_replay, _why = FORKS[path]
    cls = _cls(path)
    assert fork_capability(cls) == (by_copy, by_replay, cls.__name__)
    assert isinstance(cls.__dict__.get("forks_by_replay", False), bool)  # a plain class attribute, read unbuilt


def test_every_shipped_env_config_is_in_the_table():
    targets = {line.split(":", 1)[1].strip() for f in (REPO / "conf" / "env").glob("*.yaml")
               for line in f.read_text().splitlines() if line.startswith("_target_:")}
    assert targets and targets <= set(FORKS), sorted(targets - set(FORKS))


def test_tau2_replays_only_with_a_scripted_user_outside_telecom():
    from cope.envs.tau2.env import Tau2Env

    assert Tau2Env.replay_problem({}) is None  # the config's defaults: mock, canned user
    for ok in ({"domain": "airline"}, {"domain": "retail", "user": "canned"}, {"solo_mode": True},
               {"domain": "mock", "solo_mode": True, "user": "openai", "user_model": "m"}):
        assert Tau2Env.replay_problem(ok) is None, ok
    for bad, arg in (({"user": "openai", "user_model": "m"}, "user"), ({"user": "local", "user_model": "m"}, "user"),
                     ({"domain": "telecom", "solo_mode": True}, "domain"),
                     ({"domain": "telecom-workflow", "user": "openai", "user_model": "m"}, "domain")):
        problem = Tau2Env.replay_problem(bad)
        assert problem is not None and problem[0] == arg, (bad, problem)


def test_the_branching_collector_refuses_a_tau2_llm_user_naming_the_key():
    """The collector reads the same ``replay_problem`` from its env factory's keywords (the config rule, from the env
    config: tests/test_config_rules.py), before any env starts."""
    from cope.envs.tau2.env import Tau2Env
    from cope.rollout.engine import EnvRuntime, HFEngine, Sampling
    from cope.train.collect.branching.collector import BranchingCollector
    from cope.train.collect.collector import CollectorHost

    def build(**kw):
        engine = HFEngine(env=functools.partial(Tau2Env, **kw), runtime=EnvRuntime(), max_context=512)
        host = CollectorHost(engine=engine, sampling=Sampling(), task_stream=None, rollout=None, version=lambda: 0,
                             max_epochs=lambda: None, world=lambda: 1, stopping=lambda: False)
        return BranchingCollector(host=host, group_size=4)

    assert build(domain="airline").by_replay
    with pytest.raises(ValueError, match=r"env\.user: Tau2Env replays deterministically only with other settings"):
        build(user="openai", user_model="m")


@needs_sw
def test_every_scienceworld_jvm_gets_reproducible_identity_hashes():
    from cope.envs.scienceworld.env import ScienceWorldEnv

    for args in (["-XX:+UseSerialGC"], [], ["-XX:hashCode=2"], ["-XX:+UnlockExperimentalVMOptions", "-XX:hashCode=2"]):
        opts = ScienceWorldEnv(jvm_args=args).javaopts
        assert opts[1:3] == ["-XX:+UnlockExperimentalVMOptions", "-XX:hashCode=2"], opts  # after -Xmx, before the rest
        assert opts.count("-XX:hashCode=2") == 1 and opts.count("-XX:+UnlockExperimentalVMOptions") == 1, opts
    with pytest.raises(ValueError, match="jvm_args"):
        ScienceWorldEnv(jvm_args=["-XX:+UnlockExperimentalVMOptions", "-XX:hashCode=5"])


# -- replays ------------------------------------------------------------------------------------------------------
def expert(env) -> list[str]:
    """A script entry: the env's expert's next action (the episode must still follow its plan)."""
    action = env.expert_action()
    assert action, "the expert has no action here"
    return [action]


def _check_replay(factory, task: Task, script: list, env=None) -> tuple[list[str], list]:
    """Plays ``script`` (actions, or callables ``env -> actions`` asked when their turn comes) on ``env`` (None: a
    fresh instance) until the episode ends, then the actions it sent on a fresh instance; asserts that the replay said
    exactly what the original said at the reset and at every step (and that the branching code's own checks,
    :func:`check_reset` and :func:`check_step`, agree). Returns the actions and the original's results (reset first)."""
    env = env or factory()
    try:
        said, actions = [env.reset(task)], []
        for entry in script:
            for action in entry(env) if callable(entry) else [entry]:
                if len(said) == 1 or not said[-1].done:
                    actions.append(action)
                    said.append(env.step(action))
    finally:
        env.close()
    assert said[-1].done, "the script must end the episode"
    assert any(not r.valid for r in said[1:]), "the episode must hold an invalid action"
    trace = Trace(task, said[0], actions, said[1:])
    env = factory()
    try:
        first = env.reset(task)
        check_reset(trace, first)
        assert first == said[0], f"{task.id}: the replayed reset differs"
        for i, action in enumerate(actions):
            res = env.step(action)
            check_step(trace, i, res)
            assert res == said[i + 1], f"{task.id}: replayed step {i + 1} ({action!r}) differs"
    finally:
        env.close()
    return actions, said


ALFWORLD = {"source": "generated", "task_types": ["pick_and_place_simple"], "max_steps": 20}


@pytest.mark.long
@needs_alfworld
def test_alfworld_replays_an_expert_episode_with_invalid_actions(cache):
    from cope.envs.alfworld.env import AlfWorldEnv

    factory = functools.partial(AlfWorldEnv, cache_dir=cache, **ALFWORLD)
    off_plan = [INVALID, "look\ninventory", "look"]  # nothing changes: "Nothing happens.", malformed, a look
    script = [expert, expert, *off_plan, lambda env: env.expert_plan()[2:]]
    actions, said = _check_replay(factory, Task(GEN, "train", 0), script)
    assert len(said) == len(actions) + 1 and said[-1].success and said[-1].reward == 1.0
    assert [r.valid for r in said[3:6]] == [False, False, True]


_ALFWORLD_CHILD = """
import json, sys
from cope.envs.alfworld.env import AlfWorldEnv
from cope.envs.base import Task
env = AlfWorldEnv(cache_dir=sys.argv[1], **json.loads(sys.argv[2]))
said = [env.reset(Task(sys.argv[3], "train", 0))]
said += [env.step(a) for a in json.loads(sys.argv[4])]
print(json.dumps([[r.observation, r.admissible_actions] for r in said]))
"""


@pytest.mark.long
@needs_alfworld
def test_alfworld_replays_the_same_in_another_process_with_another_hash_seed(cache, alfworld_data):  # noqa: F811
    """Env workers replay a child in another process, whose str hashes (set orders) differ from the parent's."""
    from cope.envs.alfworld.env import AlfWorldEnv

    env = AlfWorldEnv(cache_dir=cache, **ALFWORLD)
    try:
        said = [env.reset(Task(GEN, "train", 0))]
        actions = [INVALID, *env.expert_plan()]
        said += [env.step(a) for a in actions]
    finally:
        env.close()
    want = [[r.observation, r.admissible_actions] for r in said]
    for seed in ("1", "2"):
        out = subprocess.run([sys.executable, "-c", _ALFWORLD_CHILD, cache, json.dumps(ALFWORLD), GEN, json.dumps(actions)],
                             capture_output=True, text=True, timeout=300,
                             env={**os.environ, "PYTHONHASHSEED": seed, "ALFWORLD_DATA": str(alfworld_data)})
        assert out.returncode == 0, out.stderr[-2000:]
        assert json.loads(out.stdout.splitlines()[-1]) == want


@pytest.mark.slow  # two JVM starts and a gold path read: ~6 s idle, 20 s on a busy machine
@needs_jvm
def test_scienceworld_replays_a_gold_prefix_a_menu_and_invalid_actions():
    from cope.envs.scienceworld.env import ScienceWorldEnv

    factory = functools.partial(ScienceWorldEnv, tasks=["boil"], max_steps=20)
    # the gold path's first steps, an unknown and a malformed command, an ambiguous one and its menu answer, then
    # focus on a wrong object, which fails the task (the episode ends)
    script = [expert, expert, expert, "jump", "", "open door", "0", "look around", "focus on air"]
    _, said = _check_replay(factory, Task("scienceworld", "train", 0), script)
    assert len(said) == len(script) + 1 and said[-1].score == -1.0
    assert [r.valid for r in said[4:6]] == [False, False] and said[6].info["ambiguous"]


@pytest.mark.slow  # grow-fruit's gold path (70 steps) twice, 3 JVM starts: ~15 s idle
@needs_jvm
def test_scienceworld_replays_on_a_fresh_jvm_what_a_reused_jvm_said():
    """A JVM that served another episode first (an env instance's, or an env worker slot's, reused JVM) and a fresh one
    say the same, to the end of grow-fruit's gold path, even with ``jvm_args`` that leave out ``-XX:hashCode=2`` (the
    env adds it). Without it they did not: from step 60 on, the greenhouse held another number of bees."""
    from cope.envs.scienceworld.env import ScienceWorldEnv

    factory = functools.partial(ScienceWorldEnv, tasks=["grow-fruit", "find-animal"], jvm_args=["-XX:+UseSerialGC"],
                                max_steps=100)
    used = factory()
    pairs = used._maps["train"].pairs
    fruit, animal = (Task("scienceworld", "train", next(i for i, p in enumerate(pairs) if p[0] == name))
                     for name in ("grow-fruit", "find-animal"))
    gold = used.gold_actions(fruit)
    used.reset(animal)
    used.step("look around")
    _, said = _check_replay(factory, fruit, [*gold[:3], "jump", "", *gold[3:]], env=used)
    assert said[-1].success and [r.valid for r in said[4:6]] == [False, False]


def test_webshop_replays_the_scripted_experts_purchase_with_invalid_actions():
    from cope.envs.webshop.env import BUY, PREV, WebShopEnv

    def purchase(env):  # the scripted expert, with detours and invalid actions before its purchase
        plan = env.expert_actions()
        assert plan[-1] == f"click[{BUY}]"
        return [plan[0], "click[no such label]", *plan[1:-1], "search[anything]", "click[Description]",
                f"click[{PREV}]", "", plan[-1]]

    _, said = _check_replay(WebShopEnv, Task("webshop", "train", 0), [purchase])
    assert said[-1].reward == said[-1].score > 0 and [r.valid for r in said[1:3]] == [True, False]


@pytest.mark.long
@needs_tau2
@pytest.mark.parametrize(("domain", "task_id"), [("mock", "create_task_1"), ("airline", "0")])
def test_tau2_replays_a_canned_user_conversation(offline, domain, task_id):
    from cope.envs.tau2.env import Tau2Env

    factory = functools.partial(Tau2Env, domain=domain)
    assert Tau2Env.replay_problem(factory.keywords) is None
    probe = factory()
    task = next(Task(probe.name, s, i) for s in ("train", "test") for i in range(probe.num_tasks(s))
                if probe.tau2_task(s, i).id == task_id)
    gold = probe.tau2_task(task.split, task.index).evaluation_criteria
    calls = [json.dumps({"name": a.name, "arguments": a.arguments}) for a in gold.actions or []
             if a.requestor == "assistant"]
    script = ['{"name": "no_such_tool", "arguments": {}}', "Could you confirm the details, please?", "{not json",
              *calls, '{"name": "done", "arguments": {}}']
    _, said = _check_replay(factory, task, script)
    assert len(said) == len(script) + 1 and said[-1].info["termination"] == "agent_stop"
    assert said[2].observation.startswith("user: ") and [r.valid for r in said[1:4]] == [False, True, False]


# -- a branched group on ALFWorld ---------------------------------------------------------------------------------
@pytest.mark.long
@needs_alfworld
def test_the_branching_collector_grows_an_alfworld_tree_by_replay(cache):
    """The tiny random model, in process, 1 task, 4 leaves from 2 roots; every child's env rebuilt by replay and
    checked (branch.replay=true): the tree is consistent and no replay differs."""
    group, roots = 4, 2
    rec = _alfworld_tree(cache, workers=0)
    eps, m = rec.episodes, rec.metrics
    assert len(eps) == group and sum(e.branch_of < 0 for e in eps) >= roots
    children = [(i, e) for i, e in enumerate(eps) if e.branch_of >= 0]
    assert children and m["rollout/branch_forks"] == len(children)
    for i, e in children:
        parent = eps[e.branch_of]
        assert e.branch_of < i and parent.group == e.group and 1 <= e.shared_steps < parent.num_steps
        end = parent.steps[e.shared_steps - 1].obs_end
        assert e.tokens[:end] == parent.tokens[:end] and e.roles[:end] == parent.roles[:end]
        assert [s.action_text for s in e.steps[:e.shared_steps]] == [s.action_text for s in parent.steps[:e.shared_steps]]
    assert m["rollout/branch_replay_mismatch"] == 0 and m["env/aborted_episodes"] == 0
    assert m["rollout/branch_replay_env_steps"] == sum(e.shared_steps for _, e in children) > 0
    assert all(e.num_steps > 0 for e in eps)


def _tree(env, workers: int):
    """Epoch 0 of a branched group (1 task, 4 leaves, 2 roots, every child replayed) of ``env`` with the tiny model."""
    from tiny_fixtures import branched_epoch, tiny_policy

    from cope.rollout.engine import EnvRuntime, Sampling

    return branched_epoch(tiny_policy(), env, 1, 4, EnvRuntime(workers=workers), Sampling(max_action_tokens=6),
                          max_context=4096, roots=2, trigger="uniform", replay=True)


def _alfworld_tree(cache: str, workers: int):
    from cope.envs.alfworld.env import AlfWorldEnv

    return _tree(functools.partial(AlfWorldEnv, source="generated", task_types=["pick_and_place_simple"],
                                   cache_dir=cache, max_steps=4), workers)


def _webshop(workers: int):
    from cope.envs.webshop.env import WebShopEnv

    return _tree(functools.partial(WebShopEnv, max_steps=4), workers)


def _tau2(workers: int):
    from cope.envs.tau2.env import Tau2Env

    return _tree(functools.partial(Tau2Env, domain="mock", max_steps=4), workers)


def _scienceworld(workers: int):
    from cope.envs.scienceworld.env import ScienceWorldEnv

    return _tree(functools.partial(ScienceWorldEnv, tasks=["boil"], max_steps=4), workers)


@pytest.mark.long
@pytest.mark.parametrize("grow", ["alfworld", "webshop", pytest.param("tau2", marks=pytest.mark.slow),  # tau2: ~20 s
                                  pytest.param("scienceworld", marks=[pytest.mark.slow, needs_jvm])])  # a JVM a slot
def test_env_workers_grow_the_same_trees_as_in_process(grow, request):
    """With env workers every child is replayed in a worker process (on a worker's reused JVM for ScienceWorld): the
    same tree, id for id, as in process."""
    if grow == "alfworld":
        if importlib.util.find_spec("alfworld") is None:
            pytest.skip("needs the alfworld extra (alfworld==0.4.2)")
        cache = request.getfixturevalue("cache")
        here, there = _alfworld_tree(cache, workers=0), _alfworld_tree(cache, workers=2)
    else:
        if grow == "tau2" and not HAS_TAU2:
            pytest.skip("needs tau2-bench: pip install 'cope-trainer[tau2]'")
        build = {"webshop": _webshop, "tau2": _tau2, "scienceworld": _scienceworld}[grow]
        here, there = build(0), build(2)
    assert [(e.tokens, e.branch_of, e.shared_steps, e.reward) for e in here.episodes] == \
        [(e.tokens, e.branch_of, e.shared_steps, e.reward) for e in there.episodes]
    m = there.metrics
    assert m["rollout/branch_forks"] > 0 and m["rollout/branch_replay_mismatch"] == 0 and m["env/restarts"] == 0


class AdmissibleWalker:
    """An inner actor for :class:`ScriptedActor`: a random admissible action per turn (a seeded stream), as tiny-model
    token ids, so the trees' shared steps change the game (go to, open, take ...), which the replays must reproduce."""

    def __init__(self, tokenizer, stop_id: int, seed: int = 0):
        self.tokenizer, self.stop_id, self.rng = tokenizer, stop_id, random.Random(seed)

    def reset(self) -> None:
        pass

    def __call__(self, contexts, admissible, keys):
        return [self.tokenizer(self.rng.choice(a), add_special_tokens=False)["input_ids"] + [self.stop_id]
                for a in admissible]


@pytest.mark.long
@needs_alfworld
def test_branched_alfworld_trees_of_admissible_walks_replay_every_shared_step(cache):
    """Two tasks, 4 leaves from 2 roots each, uniform forks, every child rebuilt by replay in this process
    (:class:`~cope.train.collect.branching.forks.TracingEnv`): shared steps are real moves, every replayed observation
    matches (none aborted), and each child's transcript up to its fork is its parent's, id for id."""
    from tiny_fixtures import tiny_chat, tiny_tokenizer

    from cope.envs.alfworld.env import AlfWorldEnv
    from cope.train.collect.branching.tree import Loop, ScriptedActor, close, grow
    from cope.train.collect.branching.triggers import choose_forks

    factory = functools.partial(AlfWorldEnv, cache_dir=cache, **{**ALFWORLD, "max_steps": 6})
    template, chat = factory(), tiny_chat()
    loop = Loop(factory, template, tiny_tokenizer(), chat, 4096, 64, None, True, 0)
    grown = grow(loop, [Task(GEN, "train", 0), Task(GEN, "train", 1)], [0, 1], leaves=4, roots=2,
                 actor=ScriptedActor(AdmissibleWalker(tiny_tokenizer(), chat.stop_id)), rng=random.Random(0),
                 choose=functools.partial(choose_forks, "uniform", p=0.5, tag="", max_depth=None))
    try:
        nodes = grown.nodes
        assert len(nodes) == 8 and grown.forks == 4 and grown.fill_roots == 0
        assert grown.replay_mismatch == 0 and not any(n.episode.aborted for n in nodes)
        children = [(i, n) for i, n in enumerate(nodes) if n.parent >= 0]
        assert grown.replay_env_steps == sum(n.episode.shared_steps for _, n in children) > 0
        assert all(s.valid for n in nodes for s in n.episode.steps)  # admissible walks: every step a real move
        for i, n in children:
            e, parent = n.episode, nodes[n.parent].episode
            assert n.parent < i and parent.group == e.group and 1 <= e.shared_steps < parent.num_steps
            end = parent.steps[e.shared_steps - 1].obs_end
            assert e.tokens[:end] == parent.tokens[:end] and e.roles[:end] == parent.roles[:end]
    finally:
        close(grown)
        template.close()
