"""The actors of SFT's demonstrations: they emit a demonstration's actions in place of sampling them.

Both follow :class:`cope.rollout.loop.Actor`: per live episode (``keys`` are the env slots, episode ``i`` in slot
``i``) the action's token ids, ``tokenizer.encode(action, add_special_tokens=False) + [chat stop id]``, the way a
policy that chose it and then stopped would have emitted it, so the rollout loop builds the transcript token-exact,
in the policy's own chat scaffold. Where there is no action to give, the item is an exception and the loop aborts
that episode (the collector then skips it): the demonstration ran out (``lacking``: the script used up, the expert
answered None; no failure of the env), or the expert raised (logged by the loop with the env's name and the error, as
an exception in ``env.step``; one demonstration skipped, never the run). Each actor records the text it gave per key
(``given``), so the collector can check that the env received exactly that text (a tokenizer whose decode does not
invert its encode would change it).
"""
from __future__ import annotations

from typing import Any, Sequence


class _DemoActor:
    def __init__(self, tokenizer: Any, stop_id: int):
        self.tokenizer, self.stop_id = tokenizer, int(stop_id)
        self.given: dict[int, list[str]] = {}
        self.lacking: set[int] = set()  # keys whose demonstration had no next action (not an env failure)

    def reset(self) -> None:
        """A new rollout: forget what was given (``run_episodes`` calls it first)."""
        self.given, self.lacking = {}, set()

    def _lacking(self, key: int, message: str) -> RuntimeError:
        self.lacking.add(key)
        return RuntimeError(message)

    def _ids(self, key: int, action: str) -> list[int]:
        self.given.setdefault(key, []).append(action)
        return [*self.tokenizer.encode(action, add_special_tokens=False), self.stop_id]


class ExpertActor(_DemoActor):
    """Each episode's next action from its env's expert (``expert_action()``, the optional capability of
    :class:`cope.envs.base.Env`).

    Args:
        tokenizer: encodes the action text.
        stop_id: the chat's end-of-turn id, appended to every action.
        envs: the env instances in slot order (``InProcessEnvs.envs``): episode ``key`` runs in ``envs[key]``.
    """

    def __init__(self, tokenizer: Any, stop_id: int, envs: Sequence[Any]):
        super().__init__(tokenizer, stop_id)
        self.envs = envs

    def __call__(self, contexts, admissible, keys):
        out = []
        for key in keys:
            env = self.envs[key]
            try:
                action = env.expert_action()
            except Exception as e:  # noqa: BLE001 - a failing expert skips its demonstration, never the run
                out.append(RuntimeError(f"{type(env).__name__}.expert_action() raised {e!r}"))
                continue
            out.append(self._lacking(key, f"{type(env).__name__}.expert_action() has no action for a live episode")
                       if action is None else self._ids(key, action))
        return out


class ScriptedActor(_DemoActor):
    """Each episode's recorded actions, in order (a file's demonstrations).

    Args:
        tokenizer: encodes the action text.
        stop_id: the chat's end-of-turn id, appended to every action.
        actions: per slot, the demonstration's actions.
    """

    def __init__(self, tokenizer: Any, stop_id: int, actions: Sequence[Sequence[str]]):
        super().__init__(tokenizer, stop_id)
        self.actions = [list(a) for a in actions]

    def __call__(self, contexts, admissible, keys):
        out = []
        for key in keys:
            done = len(self.given.get(key, ()))
            script = self.actions[key]
            out.append(self._lacking(key, f"the demonstration's {len(script)} actions are used up, the episode goes on")
                       if done >= len(script) else self._ids(key, script[done]))
        return out
