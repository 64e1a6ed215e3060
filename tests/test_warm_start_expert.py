"""The tiny model's expert warm start: the maze's expert_action, NoisyExpertActor, the model.warm_start_*
checks, and the cache keys (src/cope/models/warm_start.py, src/cope/models/tiny.py)."""
from __future__ import annotations

import functools
import hashlib
import json

import pytest
from tiny_fixtures import lora_config, maze_factory, tiny_chat, tiny_tokenizer

from cope.envs.base import Task
from cope.envs.maze import MazeEnv
from cope.models.tiny import tiny_policy
from cope.models.warm_start import NoisyExpertActor, RandomWalkActor, WithExamples, check_warm_start, random_walks

MICRO = dict(hidden_size=32, num_layers=1, num_heads=2, vocab_size=400, warm_start_steps=3, warm_start_batch=4,
             tokenizer_episodes=10, warm_start_walks=8)


@pytest.mark.parametrize("split,index", [("train", 0), ("train", 7), ("train", 123), ("test", 0), ("test", 41), ("test", 999)])
def test_expert_action_walks_a_shortest_path_to_the_goal(split, index):
    env = MazeEnv()
    first = env.reset(Task("maze", split, index))
    distance, admissible = first.info["distance"], first.admissible_actions
    for k in range(distance):
        move = env.expert_action()
        assert move == env.expert_action() and move in admissible  # asking does not move the agent
        r = env.step(move)
        assert r.valid and r.success == (k == distance - 1)
        admissible = r.admissible_actions
    assert r.done and r.success and env.expert_action() is None


def test_expert_action_needs_a_reset_and_is_none_after_a_timeout():
    env = MazeEnv(sizes=[6], max_steps=8)
    with pytest.raises(RuntimeError, match="before reset"):
        env.expert_action()
    first = env.reset(Task("maze", "train", 3))
    wrong = next(m for m in first.admissible_actions if m != env.expert_action())
    back = {"north": "south", "south": "north", "east": "west", "west": "east"}[wrong]
    for k in range(8):  # wander back and forth until the budget runs out
        r = env.step(wrong if k % 2 == 0 else back)
    assert r.done and not r.success and env.expert_action() is None


def _started(n: int, split: str = "train") -> tuple[list[MazeEnv], list[list[str]]]:
    envs = [maze_factory() for _ in range(n)]
    return envs, [e.reset(Task("maze", split, i)).admissible_actions for i, e in enumerate(envs)]


def test_noisy_expert_actor_at_prob_1_is_the_expert_and_at_prob_0_the_random_walker():
    tok, stop = tiny_tokenizer(), tiny_chat().stop_id
    envs, adm = _started(12)
    keys = list(range(len(envs)))
    expert = NoisyExpertActor(tok, stop, seed=0, envs=envs, expert_prob=1.0)([[]] * len(envs), adm, keys)
    assert expert == [[*tok.encode(e.expert_action(), add_special_tokens=False), stop] for e in envs]
    random_ids = NoisyExpertActor(tok, stop, seed=5, envs=envs, expert_prob=0.0)([[]] * len(envs), adm, keys)
    assert random_ids == RandomWalkActor(tok, stop, seed=5)([[]] * len(envs), adm, keys)  # the same draws, no coin
    texts = [tok.decode(ids[:-1]) for ids in random_ids]
    assert all(t in a for t, a in zip(texts, adm)) and texts != [e.expert_action() for e in envs]


def test_noisy_expert_actor_is_seeded_and_mixes():
    tok, stop = tiny_tokenizer(), tiny_chat().stop_id
    envs, adm = _started(64)
    keys = list(range(len(envs)))

    def act(seed: int) -> list[str]:
        ids = NoisyExpertActor(tok, stop, seed=seed, envs=envs, expert_prob=0.5)([[]] * len(envs), adm, keys)
        return [tok.decode(i[:-1]) for i in ids]

    assert act(1) == act(1) and act(1) != act(2)
    picks = act(1)
    assert all(t in a for t, a in zip(picks, adm))
    agree = sum(t == e.expert_action() for t, e in zip(picks, envs)) / len(envs)
    assert 0.5 < agree < 0.95  # 0.5 + 0.5 * (one in 2-4 random moves is the expert's)
    with pytest.raises(ValueError, match="episode keys"):
        NoisyExpertActor(tok, stop, seed=0, envs=envs, expert_prob=0.5)([[]], adm[:1])


def test_expert_walks_reach_the_goal_by_shortest_paths():
    tok, chat = tiny_tokenizer(), tiny_chat()
    walkers = [maze_factory() for _ in range(8)]
    eps = random_walks(walkers, tok, chat, seed=0, max_context=512, max_action_tokens=8, policy="expert", expert_prob=1.0)
    probe = maze_factory()
    assert len(eps) == 8
    for e in eps:
        assert e.success and e.num_steps == probe.reset(e.task).info["distance"]
    # prob 0 walks exactly as the random walker; wrapped envs (WithExamples) reach the inner expert
    rand = random_walks(walkers, tok, chat, seed=3, max_context=512, max_action_tokens=8)
    zero = random_walks([WithExamples(w) for w in walkers], tok, chat, seed=3, max_context=512, max_action_tokens=8,
                         policy="expert", expert_prob=0.0)
    assert [e.tokens for e in zero] == [e.tokens for e in rand]


class _Plain:
    """Not a subclass of anything with an expert: an env class without expert_action."""

    def __init__(self):
        self.inner = MazeEnv()
        self.name, self.max_steps, self.instructions = "maze", 20, self.inner.instructions


@pytest.mark.parametrize("kw,match", [
    (dict(warm_start_policy="bogus"), "model.warm_start_policy must be one of"),
    (dict(warm_start_policy="expert", warm_start_expert_prob=1.5), "model.warm_start_expert_prob must be a number in"),
    (dict(warm_start_policy="random", warm_start_expert_prob=-0.1), "model.warm_start_expert_prob must be a number in"),
    (dict(warm_start_policy="expert", warm_start_expert_prob="half"), "model.warm_start_expert_prob must be a number in"),
])
def test_bad_warm_start_settings_fail_before_any_work(tmp_path, kw, match):
    with pytest.raises(ValueError, match=match):
        tiny_policy(lora_config(), maze_factory, cache_dir=str(tmp_path), **MICRO, **kw)
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize("factory", [functools.partial(_Plain), _Plain, lambda: WithExamples(MazeEnv())])
def test_expert_warm_start_needs_an_env_with_an_expert(tmp_path, factory):
    with pytest.raises(ValueError, match=r"model.warm_start_policy=expert needs an env with an expert_action\(\) method"):
        tiny_policy(lora_config(), factory, cache_dir=str(tmp_path), warm_start_policy="expert", **MICRO)
    assert not any(tmp_path.iterdir())
    check_warm_start("random", 0.5, factory)  # the random walks need no expert


# The cache key the code computed before warm_start_policy existed (sha256 of the sorted JSON spec), for
# maze_factory and MICRO: the random warm start's caches must keep it.
OLD_SPEC = dict(env="cope.envs.maze.MazeEnv([('max_steps', 8), ('sizes', [6])])", hidden_size=32, num_layers=1, num_heads=2,
                vocab_size=400, max_context=2048, warm_start_steps=3, warm_start_batch=4, warm_start_lr=3e-3, seed=0, version=1,
                tokenizer_episodes=10, warm_start_walks=8, warm_start_action_tokens=8)
OLD_KEY = "ba77597bddd75504"  # what the code before this change named that folder (measured)


def test_expert_build_works_and_only_it_gets_a_new_cache_key(tmp_path):
    assert hashlib.sha256(json.dumps(OLD_SPEC, sort_keys=True).encode()).hexdigest()[:16] == OLD_KEY
    default = tiny_policy(lora_config(), maze_factory, cache_dir=str(tmp_path), **MICRO)
    assert default.source == str(tmp_path / OLD_KEY)
    again = tiny_policy(lora_config(), maze_factory, cache_dir=str(tmp_path), **MICRO, warm_start_expert_prob=0.9)
    assert again.source == default.source  # the prob does not change random walks, nor their key
    expert = tiny_policy(lora_config(), maze_factory, cache_dir=str(tmp_path), **MICRO, warm_start_policy="expert",
                         warm_start_expert_prob=0.5)
    spec = json.loads((tmp_path / expert.source.rsplit("/", 1)[1] / "spec.json").read_text())
    assert expert.source != default.source and spec == {**OLD_SPEC, "warm_start_policy": "expert", "warm_start_expert_prob": 0.5}
    other = tiny_policy(lora_config(), maze_factory, cache_dir=str(tmp_path), **MICRO, warm_start_policy="expert",
                        warm_start_expert_prob=0.25)
    assert len({default.source, expert.source, other.source}) == 3
    assert expert.tokenizer.encode("north") == default.tokenizer.encode("north")  # the tokenizer's walks stay random


@pytest.mark.parametrize("override, expected", [
    # the typed config check: the builders' Literal annotation (cope.models.choices.WarmStartPolicy)
    ("model.warm_start_policy=bogus", "model.warm_start_policy = 'bogus': expected one of 'random', 'expert'"),
    ("model.warm_start_expert_prob=2", "model.warm_start_expert_prob must be a number in [0, 1], got 2"),
    ("model.warm_start_expert_prob=abc", "expected float"),  # the typed config check (cope.run.config_check)
])
def test_bad_warm_start_config_fails_through_the_run_before_a_build(run_train, tmp_path, monkeypatch, override, expected):
    cache = tmp_path / "cache"
    monkeypatch.setenv("COPE_CACHE", str(cache))
    with pytest.raises(Exception) as err:
        run_train(["model.warm_start_policy=expert", override], tmp_path)
    assert expected in str(err.value) and "model.warm_start_" in str(err.value), str(err.value)
    assert not (cache / "tiny").exists()
