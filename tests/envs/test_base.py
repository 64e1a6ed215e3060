"""The shared env bookkeeping (`cope.envs.base.TaskEnv`): split and index checks, the reset/step order
and the step budget, on a toy env and on the cheap real ones (maze, webshop)."""
from __future__ import annotations

import pytest

from cope.envs.base import Env, EnvReset, EnvStep, Task, TaskEnv
from cope.envs.maze import MazeEnv
from cope.envs.webshop.env import WebShopEnv


class Counter(TaskEnv):
    """Says "win" ends the task; everything else is a step."""

    def __init__(self, max_steps: int = 3) -> None:
        self.name, self.max_steps, self._num_tasks = "counter", max_steps, {"train": 2, "test": 1}

    @property
    def instructions(self) -> str:
        return "say win"

    def reset(self, task: Task) -> EnvReset:
        self._reset_started()
        self.check_index(task.split, task.index)
        self._episode_started()
        return EnvReset(observation="go")

    def step(self, action: str) -> EnvStep:
        self._step_started()
        won = action == "win"
        timeout = self._step_ended(won)
        return EnvStep(observation="", reward=float(won), done=self.episode_over, valid=True, success=won,
                       score=float(won), info={"timeout": timeout})

    def close(self) -> None:
        self._no_episode()


def test_tasks_and_indices():
    env = Counter()
    assert isinstance(env, Env) and env.max_instances is None
    assert env.num_tasks("train") == 2 and env.num_tasks("test") == 1
    with pytest.raises(ValueError, match="split must be one of"):
        env.num_tasks("dev")
    with pytest.raises(ValueError, match=r"task index 1 out of range for split 'test' \(1 tasks\)"):
        env.reset(Task("counter", "test", 1))
    with pytest.raises(ValueError, match="task index -1 out of range"):
        env.check_index("train", -1)


def test_order_guards_and_budget():
    env = Counter(max_steps=2)
    with pytest.raises(RuntimeError, match="Counter.step called before reset"):
        env.step("x")
    env.reset(Task("counter", "train", 0))
    first, last = env.step("x"), env.step("x")
    assert not first.done and first.info["timeout"] is False
    assert last.done and last.info["timeout"] is True and env.out_of_steps
    with pytest.raises(RuntimeError, match="after the episode ended; call reset first"):
        env.step("x")
    env.reset(Task("counter", "train", 1))
    won = env.step("win")
    assert won.done and won.success and won.info["timeout"] is False  # the task ended it, not the budget
    with pytest.raises(ValueError):
        env.reset(Task("counter", "train", 5))
    with pytest.raises(RuntimeError, match="before reset"):  # a failed reset leaves no episode to step
        env.step("x")
    env.reset(Task("counter", "train", 0))
    env.close()
    with pytest.raises(RuntimeError, match="before reset"):
        env.step("x")


@pytest.mark.parametrize("make", [lambda: MazeEnv(sizes=[6], max_steps=3), lambda: WebShopEnv(max_steps=3)],
                         ids=["maze", "webshop"])
def test_real_envs_follow_the_contract(make):
    env = make()
    assert isinstance(env, TaskEnv) and isinstance(env, Env)
    with pytest.raises(RuntimeError, match="step called before reset"):
        env.step("north")
    with pytest.raises(ValueError, match="out of range"):
        env.reset(Task(env.name, "test", env.num_tasks("test")))
    env.reset(Task(env.name, "train", 0))
    outs = [env.step("nonsense") for _ in range(3)]  # invalid actions count towards the budget too
    assert [o.done for o in outs] == [False, False, True] and [o.info["timeout"] for o in outs] == [False, False, True]
    with pytest.raises(RuntimeError, match="after the episode ended"):
        env.step("nonsense")
