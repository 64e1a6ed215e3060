"""An example OpenEnv environment, served by the tests and by ``env=openenv``'s default config: guess the number.

The env picks a secret from 1 to ``HIGH`` from the reset seed; each ``GuessAction(guess)`` is answered ``higher``,
``lower`` or ``correct`` (reward 1.0, done); ``MAX_TRIES`` wrong guesses end it (reward 0). The observation carries
the feedback text, the numbers still possible (``choices``: what ``env.admissible_field`` reads, so the tiny
model's warm start has actions to walk) and the tries left. A guess outside 1..HIGH fails the action's schema
(pydantic, on the server): the adapter shows the server's validation message as an invalid step.

Serve it by hand::

    python -m cope.envs.openenv.serve --app cope.envs.openenv.example:create_app --factory --port 8000

Fault injection for the tests (environment variables read by the server): ``COPE_EXAMPLE_CRASH_ONCE=<file>`` with
``COPE_EXAMPLE_CRASH_AT=<n>`` makes the server exit abruptly at its n-th step over all sessions (only those whose
episode id contains ``COPE_EXAMPLE_CRASH_ON``, when set), once (the file marks that it happened), as a killed
server would; ``COPE_EXAMPLE_SLOW_GUESS=<g>`` makes a guess of g take
``COPE_EXAMPLE_SLOW_S`` seconds (a hanging env).

openenv-core is imported when the app is built (extra ``openenv``), so this module imports without it.
"""
from __future__ import annotations

import functools
import os
import random
import time
from pathlib import Path
from typing import Any

HIGH, MAX_TRIES = 8, 6


@functools.lru_cache(maxsize=None)
def classes() -> tuple[type, type, type]:
    """``(GuessAction, GuessObservation, GuessEnvironment)``, built on openenv-core's base classes."""
    from cope.extras import require

    require("openenv", "openenv", "The example OpenEnv environment")
    from openenv.core.env_server.interfaces import Environment
    from openenv.core.env_server.types import Action, Observation, State
    from pydantic import Field

    class GuessAction(Action):
        """Guess the secret number."""

        guess: int = Field(..., ge=1, le=HIGH, description=f"A number from 1 to {HIGH}.")

    class GuessObservation(Observation):
        feedback: str = Field(default="", description="What the env says.")
        choices: list[str] = Field(default_factory=list, description="The numbers still possible.")
        tries_left: int = Field(default=MAX_TRIES)

    class GuessEnvironment(Environment):
        SUPPORTS_CONCURRENT_SESSIONS = True
        steps_served = 0  # over every session of the server (fault injection)

        def __init__(self):
            super().__init__()
            self._state = State()
            self.secret, self.low, self.high, self.tries = 1, 1, HIGH, 0

        def reset(self, seed: int | None = None, episode_id: str | None = None, **kwargs: Any) -> GuessObservation:
            self.secret = random.Random(seed).randint(1, HIGH)
            self.low, self.high, self.tries = 1, HIGH, 0
            self._state = State(episode_id=episode_id, step_count=0)
            return self._obs(f"Guess the number from 1 to {HIGH}. Answer with one number.", 0.0, False)

        def _obs(self, text: str, reward: float, done: bool) -> GuessObservation:
            return GuessObservation(feedback=text, choices=[str(n) for n in range(self.low, self.high + 1)],
                                    tries_left=MAX_TRIES - self.tries, reward=reward, done=done)

        def step(self, action: GuessAction, timeout_s: float | None = None, **kwargs: Any) -> GuessObservation:
            _crash_maybe(type(self), action.guess, self._state.episode_id)
            self.tries += 1
            self._state.step_count += 1
            g = action.guess
            if g == self.secret:
                return self._obs(f"{g} is correct.", 1.0, True)
            if g < self.secret:
                self.low = max(self.low, g + 1)
                text = f"{g}: higher."
            else:
                self.high = min(self.high, g - 1)
                text = f"{g}: lower."
            return self._obs(text, 0.0, self.tries >= MAX_TRIES)

        @property
        def state(self) -> State:
            return self._state

    return GuessAction, GuessObservation, GuessEnvironment


def _crash_maybe(env_cls: type, guess: int, episode_id: str | None) -> None:
    marker, at = os.environ.get("COPE_EXAMPLE_CRASH_ONCE"), int(os.environ.get("COPE_EXAMPLE_CRASH_AT", "0"))
    if guess and str(guess) == os.environ.get("COPE_EXAMPLE_SLOW_GUESS"):
        time.sleep(float(os.environ.get("COPE_EXAMPLE_SLOW_S", "5")))
    if os.environ.get("COPE_EXAMPLE_CRASH_ON", "") not in (episode_id or ""):
        return
    env_cls.steps_served += 1
    if marker and at and env_cls.steps_served >= at and not Path(marker).exists():
        Path(marker).write_text("crashed")
        os._exit(1)


def create_app():
    """The FastAPI app of the example env (what ``serve --factory`` calls)."""
    from openenv.core.env_server.http_server import create_fastapi_app

    action, observation, env = classes()
    return create_fastapi_app(env, action, observation, max_concurrent_envs=1024)
