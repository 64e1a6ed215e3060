"""Who acts in the tiny model's warm-start walks (src/cope/models/tiny.py): the demonstrations it clones.

Two regimes, picked by ``model.warm_start_policy``:

* ``random`` (the default): :class:`RandomWalkActor`, a uniformly random admissible action each turn.
  Behaviour cloning on these walks teaches the action *format* and nothing about the goal, so the
  starting policy is a random walker (a cold start for RL).
* ``expert``: :class:`NoisyExpertActor`, the env's own ``expert_action()`` (for the maze, the next move of a
  shortest path) with probability ``model.warm_start_expert_prob``, otherwise a uniformly random
  admissible action. Cloning these walks stands in for a pretrained/SFT'd model: goal-directed but
  imperfect. The mixture is per turn; greedy decoding of a well-fitted clone would pick the expert's
  move wherever it has the largest share, so how imperfect the *greedy* start is depends on how far
  the clone is from a perfect fit. bench/warm_start_prior.py measures it (bench/results/warm_start_prior.json).

Actions come back as token ids ending with the stop id, as the rollout engine expects from an actor
(:class:`cope.rollout.loop.Actor`); the walks run through :func:`cope.rollout.loop.run_episodes` like training rollouts.
"""
from __future__ import annotations

import random
from typing import Callable, get_args

from cope.envs.base import Env, Task, env_declares
from cope.models.choices import WarmStartPolicy
from cope.rollout.loop import run_episodes

WARM_START_POLICIES = get_args(WarmStartPolicy)


class RandomWalkActor:
    """Picks a uniformly random admissible action (format-only demonstrations)."""

    def __init__(self, tokenizer, stop_id: int, seed: int):
        self.tokenizer, self.stop_id, self.rng = tokenizer, stop_id, random.Random(seed)

    def __call__(self, contexts, admissible, keys=None):
        keys = list(range(len(admissible))) if keys is None else keys
        return [[*self.tokenizer.encode(self._pick(adm, key), add_special_tokens=False), self.stop_id]
                for adm, key in zip(admissible, keys)]

    def _pick(self, adm: list[str] | None, key: int) -> str:
        if not adm:
            raise ValueError("the tiny model's warm start needs an env that reports admissible actions "
                             "or defines example_actions()")
        return self.rng.choice(adm)


class NoisyExpertActor(RandomWalkActor):
    """The env's ``expert_action()`` with probability ``expert_prob``, else a uniformly random admissible action.

    Args:
        tokenizer: encodes the chosen action text.
        stop_id: end-of-turn id appended to every action.
        seed: seeds the coin and the random choices (the same seed gives the same walks).
        envs: the env instances ``run_episodes`` steps, in slot order: episode ``key`` runs in ``envs[key]``
            (run_episodes puts episode ``i`` in slot ``i`` of the list it gets), so the actor asks that
            instance for its expert move. Each must define ``expert_action() -> str | None``.
        expert_prob: probability of the expert's move, in [0, 1]. 0 draws exactly as :class:`RandomWalkActor`
            (no coin is flipped); 1 always follows the expert. Where the expert has no move (None), a
            random admissible action is taken.
    """

    def __init__(self, tokenizer, stop_id: int, seed: int, envs: list[Env], expert_prob: float):
        super().__init__(tokenizer, stop_id, seed)
        check_expert_prob(expert_prob)
        missing = [type(e).__name__ for e in envs if not hasattr(e, "expert_action")]
        if missing:
            raise ValueError(f"NoisyExpertActor needs envs with an expert_action() method; {missing[0]} has none")
        self.envs, self.expert_prob = list(envs), float(expert_prob)

    def __call__(self, contexts, admissible, keys=None):
        if keys is None:
            raise ValueError("NoisyExpertActor needs the episode keys (slots) to find each episode's env")
        return super().__call__(contexts, admissible, keys)

    def _pick(self, adm: list[str] | None, key: int) -> str:
        p = self.expert_prob
        if p >= 1 or (p > 0 and self.rng.random() < p):
            move = self.envs[key].expert_action()
            if move is not None:
                return move
        return super()._pick(adm, key)


class WithExamples:
    """Wraps an env whose steps report no admissible actions (a shell, tool calls) so that its
    ``example_actions()`` stand in for them during the format-only warm start."""

    def __init__(self, env: Env):
        self.env = env
        self.name, self.max_steps, self.instructions = env.name, env.max_steps, env.instructions

    def num_tasks(self, split: str) -> int:
        return self.env.num_tasks(split)

    def _fill(self, r):
        if r.admissible_actions is None and hasattr(self.env, "example_actions"):
            r.admissible_actions = list(self.env.example_actions())
        return r

    def reset(self, task: Task):
        return self._fill(self.env.reset(task))

    def step(self, action: str):
        return self._fill(self.env.step(action))

    def close(self) -> None:
        self.env.close()


def check_expert_prob(expert_prob: float) -> float:
    if isinstance(expert_prob, bool) or not isinstance(expert_prob, (int, float)) or not 0.0 <= expert_prob <= 1.0:
        raise ValueError(f"model.warm_start_expert_prob must be a number in [0, 1], got {expert_prob!r}")
    return float(expert_prob)


def check_warm_start(policy: str, expert_prob: float, env_factory: Callable[[], Env]) -> None:
    """Fails before any work on a bad ``model.warm_start_policy`` / ``model.warm_start_expert_prob``, or on
    ``expert`` with an env that has no ``expert_action()`` (looked up on the class when the factory is a
    class or a partial of one, so no env is started for it)."""
    if policy not in WARM_START_POLICIES:
        raise ValueError(f"model.warm_start_policy must be one of {WARM_START_POLICIES}, got {policy!r}")
    check_expert_prob(expert_prob)
    if policy != "expert":
        return
    has, name = env_declares(env_factory, "expert_action")
    if not has:
        raise ValueError(f"model.warm_start_policy=expert needs an env with an expert_action() method "
                         f"(see cope.envs.base.Env); {name} has none: use model.warm_start_policy=random")


def walk_actor(policy: str, tokenizer, stop_id: int, seed: int, envs: list[Env], expert_prob: float) -> RandomWalkActor:
    """The actor of one batch of warm-start walks over ``envs`` (raw instances, slot order)."""
    if policy == "expert":
        return NoisyExpertActor(tokenizer, stop_id, seed, envs, expert_prob)
    return RandomWalkActor(tokenizer, stop_id, seed)


def walked_tasks(env: Env, limit: int | None) -> int:
    """How many train tasks (indices 0..n-1) the warm start walks: all, or the first ``limit``."""
    return min(env.num_tasks("train"), limit or env.num_tasks("train"))


def random_walks(envs: list[Env], tokenizer, chat, seed: int, max_context: int, max_action_tokens: int,
                  num_tasks: int | None = None, policy: str = "random", expert_prob: float = 0.5):
    """One walk per env instance (instances are reused across calls: JVM-backed envs start once); the
    walker is ``policy``'s actor (random: uniformly random admissible actions)."""
    rng = random.Random(seed)
    n = len(envs)
    tasks = [Task(envs[0].name, "train", rng.randrange(walked_tasks(envs[0], num_tasks))) for _ in range(n)]
    raw = [e.env if isinstance(e, WithExamples) else e for e in envs]
    actor = walk_actor(policy, tokenizer, chat.stop_id, seed, raw, expert_prob)
    episodes, _ = run_episodes(envs, tasks, list(range(n)), actor, tokenizer, chat, max_context, max_action_tokens)
    return [e for e in episodes if not e.aborted]
