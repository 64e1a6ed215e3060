"""Lock-step batched rollouts over many envs, token-in/token-out.

All live episodes advance together: one batched call of the actor samples the next action of every
episode (:class:`cope.generation.CachedSamplingActor`: a KV cache kept across turns, left padding of
the new tokens, temperature/top-p, a per-action token cap, stop at the end-of-turn id), then each env
steps on the decoded action text. The sampled ids go into the
transcript verbatim; env text is tokenized on its own (special-token strings inside it are split,
so an env cannot inject scaffold tokens).

Context overflow policy (one rule, documented in the README): when the next feedback turn plus a
full action would not fit in ``max_context``, the episode ends with ``end_reason="context"``
(truncated): the last action stays in the transcript and is trained, the feedback that did not fit
is dropped, the episode counts as a failure and is counted in ``rollout/truncated``.

An env that raises in reset/step aborts its episode (``end_reason="aborted"``): it is logged,
counted in ``env/errors`` and ``env/aborted_episodes``, and excluded from the loss; the run goes on.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Callable, Protocol

from cope.chat import ChatFormat
from cope.envs.base import Env, Task
from cope.episode import EndReason, Episode, Role, Step

log = logging.getLogger(__name__)


class Actor(Protocol):
    def __call__(self, contexts: list[list[int]], admissible: list[list[str] | None], keys: list[int]) -> list[list[int]]:
        """Next action ids for each context (ending with the stop id when it was sampled).
        ``keys`` identify episodes across turns (an actor may cache per episode; contexts only grow).
        ``admissible`` holds the env's admissible actions per context (None when unknown); policies
        ignore it, the random-walk actor of the tiny model's warm start uses it."""
        ...


@dataclass
class RolloutStats:
    episodes: int = 0
    env_steps: int = 0
    generated_tokens: int = 0
    env_errors: int = 0
    gen_seconds: float = 0.0
    env_seconds: float = 0.0
    errors: list[str] = field(default_factory=list)


def _encode(tokenizer, text: str) -> list[int]:
    if not text:
        return []
    return tokenizer(text, add_special_tokens=False, split_special_tokens=True)["input_ids"]


def run_episodes(
    envs: list[Env],
    tasks: list[Task],
    groups: list[int],
    actor: Actor,
    tokenizer,
    chat: ChatFormat,
    max_context: int,
    max_action_tokens: int,
    progress: Callable[[int], None] | None = None,
) -> tuple[list[Episode], RolloutStats]:
    """Run one episode per (env, task) in lock-step and return the finished episodes in input order."""
    assert len(envs) == len(tasks) == len(groups)
    if hasattr(actor, "reset"):
        actor.reset()
    stats = RolloutStats()
    eps = [Episode(task=t, group=g) for t, g in zip(tasks, groups)]
    admissible: list[list[str] | None] = [None] * len(eps)
    live: list[int] = []
    system = [*chat.system_open, *_encode(tokenizer, envs[0].instructions), *chat.turn_end, *chat.newline, *chat.user_open]
    for i, (env, ep) in enumerate(zip(envs, eps)):
        ep.append(system, Role.PROMPT)
        t0 = time.perf_counter()
        try:
            first = env.reset(ep.task)
        except Exception as e:  # an env crash aborts its episode, never the run
            _abort(ep, stats, f"reset {ep.task.id}: {e!r}")
            continue
        finally:
            stats.env_seconds += time.perf_counter() - t0
        admissible[i] = first.admissible_actions
        ep.append(_encode(tokenizer, first.observation), Role.OBSERVATION)
        ep.append(chat.close_turn(), Role.PROMPT)
        ep.prompt_len = len(ep.tokens)
        if ep.prompt_len + max_action_tokens + len(chat.turn_end) > max_context:
            raise ValueError(
                f"the first prompt of {ep.task.id} has {ep.prompt_len} tokens: data.max_context={max_context} leaves no "
                f"room for an action of data.max_action_tokens={max_action_tokens} and its end-of-turn id"
            )
        live.append(i)

    while live:
        t0 = time.perf_counter()
        actions = actor([eps[i].tokens for i in live], [admissible[i] for i in live], keys=live)
        stats.gen_seconds += time.perf_counter() - t0
        still: list[int] = []
        for i, ids in zip(live, actions):
            ep, env = eps[i], envs[i]
            closed = bool(ids) and ids[-1] == chat.stop_id
            text = tokenizer.decode(ids[:-1] if closed else ids, skip_special_tokens=True)
            a0, a1 = ep.append(ids, Role.ACTION)
            stats.generated_tokens += len(ids)
            t0 = time.perf_counter()
            try:
                res = env.step(text)
            except Exception as e:
                ep.steps.append(Step(a0, a1, closed, False, text))
                _abort(ep, stats, f"step {ep.task.id} action {text!r}: {e!r}")
                continue
            finally:
                stats.env_seconds += time.perf_counter() - t0
            stats.env_steps += 1
            admissible[i] = res.admissible_actions
            step = Step(a0, a1, closed, bool(res.valid), text, float(res.reward))
            ep.steps.append(step)
            ep.reward += float(res.reward)
            ep.success, ep.score = bool(res.success), float(res.score)
            obs = _encode(tokenizer, res.observation)
            harness = _encode(tokenizer, ("\n" if res.observation else "") + res.harness) if res.harness else []
            opening = chat.after_action(closed)
            ending = list(chat.turn_end) if res.done else chat.close_turn()
            # room for the next action and for the end-of-turn id added when it hits the token cap
            need = len(opening) + len(obs) + len(harness) + len(ending) + (0 if res.done else max_action_tokens + len(chat.turn_end))
            if len(ep.tokens) + need > max_context:
                # The feedback does not fit: the episode ends here (done or truncated), feedback dropped.
                if not ep.tokens[-1:] == [chat.stop_id]:
                    ep.append(list(chat.turn_end), Role.PROMPT)
                ep.end_reason = EndReason.DONE if res.done else EndReason.CONTEXT
                if res.done and res.info.get("timeout"):
                    ep.end_reason = EndReason.MAX_STEPS
                continue
            step.obs_start = ep.append(opening, Role.PROMPT)[0]
            ep.append(obs, Role.OBSERVATION)
            ep.append(harness, Role.HARNESS)
            step.obs_end = ep.append(ending, Role.PROMPT)[1]
            if res.done:
                ep.end_reason = EndReason.MAX_STEPS if res.info.get("timeout") else EndReason.DONE
            elif ep.num_steps >= env.max_steps:
                ep.end_reason = EndReason.MAX_STEPS
            else:
                still.append(i)
        if progress is not None:
            progress(len(live) - len(still))
        live = still
    stats.episodes = len(eps)
    return eps, stats


def _abort(ep: Episode, stats: RolloutStats, msg: str) -> None:
    ep.end_reason = EndReason.ABORTED
    ep.success, ep.reward = False, 0.0
    stats.env_errors += 1
    stats.errors.append(msg)
    log.warning("env error, episode aborted: %s", msg)
