"""Lock-step batched rollouts over many envs, token-in/token-out.

All live episodes advance together: one batched call of the actor samples the next action of every
episode (:class:`cope.rollout.hf_actor.CachedSamplingActor`: a KV cache kept across turns, left padding of
the new tokens, temperature/top-p, a per-action token cap, stop at the end-of-turn id), then each env
steps on the decoded action text. The sampled ids go into the
transcript verbatim; env text is tokenized on its own (special-token strings inside it are split,
so an env cannot inject scaffold tokens).

Context overflow policy (one rule, documented in docs/training.md): when the next feedback turn plus a
full action would not fit in ``max_context``, the episode ends with ``end_reason="context"``
(truncated): the last action stays in the transcript and is trained, the feedback that did not fit
is dropped, the episode counts as a failure and is counted in ``rollout/truncated``.

An env that raises in reset/step aborts its episode (``end_reason="aborted"``): it is logged,
counted in ``env/errors`` and ``env/aborted_episodes``, and excluded from the loss; the run goes on.
With env workers (:mod:`cope.envs.runtime.pool`) a worker that dies or hangs does the same to the episode it
was serving, and is restarted.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Callable, Protocol

from cope.chat import ChatFormat
from cope.envs.base import Env, Task
from cope.envs.runtime.batch import EnvBatch, InProcessEnvs
from cope.episode import EndReason, Episode, Role, Step
from cope.rollout.complete import complete_prefix_len

log = logging.getLogger(__name__)


@dataclass
class Sampled:
    """An action as a sampler outside this process returns it: the ids and the sampler's own log-probs."""

    ids: list[int]
    logprobs: list[float] | None = None


class Actor(Protocol):
    def __call__(self, contexts: list[list[int]], admissible: list[list[str] | None],
                 keys: list[int]) -> list[list[int] | Sampled | BaseException]:
        """Next action ids for each context (ending with the stop id when it was sampled).
        ``keys`` identify episodes across turns (an actor may cache per episode; contexts only grow).
        ``admissible`` holds the env's admissible actions per context (None when unknown); policies
        ignore it, the random-walk actor of the tiny model's warm start uses it. An item may be a
        :class:`Sampled` (ids with the sampler's log-probs, kept in ``Step.sampler_logprobs``) or an
        exception (generation failed for that episode, e.g. the inference server died: the episode
        is aborted like on an env crash)."""
        ...


@dataclass
class RolloutStats:
    episodes: int = 0
    env_steps: int = 0
    generated_tokens: int = 0
    env_errors: int = 0
    gen_seconds: float = 0.0
    env_seconds: float = 0.0
    sync_seconds: float = 0.0  # making the trained weights the sampler's (0 in process; a vLLM adapter hot load)
    errors: list[str] = field(default_factory=list)

    def add(self, other: "RolloutStats") -> None:
        """Accumulate another run's stats (the waves of one epoch)."""
        for k in ("episodes", "env_steps", "generated_tokens", "env_errors", "gen_seconds", "env_seconds", "sync_seconds"):
            setattr(self, k, getattr(self, k) + getattr(other, k))
        self.errors += other.errors


def _encode(tokenizer, text: str) -> list[int]:
    if not text:
        return []
    return tokenizer(text, add_special_tokens=False, split_special_tokens=True)["input_ids"]


def run_episodes(
    envs: list[Env] | EnvBatch,
    tasks: list[Task],
    groups: list[int],
    actor: Actor,
    tokenizer,
    chat: ChatFormat,
    max_context: int,
    max_action_tokens: int,
    progress: Callable[[int], None] | None = None,
    chunks: int = 1,
    instructions: str | None = None,
) -> tuple[list[Episode], RolloutStats]:
    """Run one episode per task (episode ``i`` in env slot ``i``) in lock-step; episodes in input order.

    ``envs``: a list of env instances (stepped here, one after another) or an env batch
    (:mod:`cope.envs.runtime.pool`). ``chunks > 1`` splits the live episodes into that many parts, each with its
    own actor (``actor.fork()``): while one part's env steps run in the workers, the actor generates
    for the next part, so generation and env time overlap. ``instructions`` replaces the env's system
    prompt (None: the env's own rules and action format).
    """
    assert len(tasks) == len(groups)
    batch = envs if isinstance(envs, EnvBatch) else InProcessEnvs(envs=list(envs))  # too few instances: ValueError
    if hasattr(actor, "reset"):
        actor.reset()
    actors = [actor] + [actor.fork() for _ in range(chunks - 1)]
    stats = RolloutStats()
    eps = [Episode(task=t, group=g) for t, g in zip(tasks, groups)]
    admissible: list[list[str] | None] = [None] * len(eps)
    rules = batch.instructions if instructions is None else instructions
    system = [*chat.system_open, *_encode(tokenizer, rules), *chat.turn_end, *chat.newline, *chat.user_open]
    t0 = time.perf_counter()
    firsts = batch.reset(list(enumerate(tasks)))
    stats.env_seconds += time.perf_counter() - t0
    live: list[int] = []
    for i, (ep, first) in enumerate(zip(eps, firsts)):
        ep.append(system, Role.PROMPT)
        if isinstance(first, BaseException):  # an env crash aborts its episode, never the run
            _abort(ep, stats, f"reset {ep.task.id}: {first!r}")
            continue
        admissible[i] = first.admissible_actions
        ep.append(_encode(tokenizer, first.observation), Role.OBSERVATION)
        if first.harness:
            ep.append(_encode(tokenizer, ("\n" if first.observation else "") + first.harness), Role.HARNESS)
        ep.append(chat.close_turn(), Role.PROMPT)
        ep.prompt_len = len(ep.tokens)
        if ep.prompt_len + max_action_tokens + len(chat.turn_end) > max_context:
            raise ValueError(
                f"the first prompt of {ep.task.id} has {ep.prompt_len} tokens: data.max_context={max_context} leaves no "
                f"room for an action of data.sampling.max_action_tokens={max_action_tokens} and its end-of-turn id"
            )
        live.append(i)

    parts = [live[c::chunks] for c in range(chunks)]
    pending: list = [None] * chunks  # (episode indices, step starts, Pending) per part
    while any(parts) or any(p is not None for p in pending):
        for c in range(chunks):
            if pending[c] is not None:
                idx, starts, handle = pending[c]
                t0 = time.perf_counter()
                results = handle.results()
                stats.env_seconds += time.perf_counter() - t0
                parts[c] = [i for i, a0, res in zip(idx, starts, results)
                            if _feedback(eps[i], a0, res, admissible, i, batch.max_steps, stats, tokenizer, chat,
                                         max_context, max_action_tokens)]
                pending[c] = None
                if progress is not None:
                    progress(len(idx) - len(parts[c]))
            if not parts[c]:
                continue
            t0 = time.perf_counter()
            actions = actors[c]([eps[i].tokens for i in parts[c]], [admissible[i] for i in parts[c]], keys=parts[c])
            stats.gen_seconds += time.perf_counter() - t0
            items, starts, sent = [], [], []
            for i, ids in zip(parts[c], actions):
                ep = eps[i]
                if isinstance(ids, BaseException):  # generation failed for this episode: aborted, never the run
                    _abort(ep, stats, f"generate {ep.task.id}: {ids!r}")
                    continue
                lps = None
                if isinstance(ids, Sampled):
                    ids, lps = ids.ids, ids.logprobs
                closed = bool(ids) and ids[-1] in chat.stop_ids
                text = tokenizer.decode(ids[:-1] if closed else ids, skip_special_tokens=True)
                a0, a1 = ep.append(ids, Role.ACTION)
                done_at = complete_prefix_len(tokenizer, ids[:-1] if closed else ids, admissible[i], text)
                ep.steps.append(Step(a0, a1, closed, False, text, sampler_logprobs=lps, complete_len=done_at))
                stats.generated_tokens += len(ids)
                items.append((i, text))
                starts.append(a0)
                sent.append(i)
            if len(sent) < len(parts[c]) and progress is not None:
                progress(len(parts[c]) - len(sent))
            if not sent:
                parts[c] = []
                continue
            t0 = time.perf_counter()
            pending[c] = (sent, starts, batch.submit(items))
            stats.env_seconds += time.perf_counter() - t0
    stats.episodes = len(eps)
    return eps, stats


def _feedback(ep: Episode, a0: int, res, admissible, i: int, max_steps: int, stats: RolloutStats, tokenizer,
              chat: ChatFormat, max_context: int, max_action_tokens: int) -> bool:
    """Apply one step result (or the exception standing for it) to its episode; True if it goes on."""
    step = ep.steps[-1]
    if isinstance(res, BaseException):
        _abort(ep, stats, f"step {ep.task.id} action {step.action_text!r}: {res!r}")
        return False
    stats.env_steps += 1
    admissible[i] = res.admissible_actions
    step.valid, step.reward = bool(res.valid), float(res.reward)
    step.projected = bool(res.info.get("projected", False))
    ep.reward += float(res.reward)
    ep.success, ep.score = bool(res.success), float(res.score)
    closed = step.closed
    obs = _encode(tokenizer, res.observation)
    harness = _encode(tokenizer, ("\n" if res.observation else "") + res.harness) if res.harness else []
    opening = chat.after_action(closed)
    ending = list(chat.turn_end) if res.done else chat.close_turn()
    # room for the next action and for the end-of-turn id added when it hits the token cap
    need = len(opening) + len(obs) + len(harness) + len(ending) + (0 if res.done else max_action_tokens + len(chat.turn_end))
    if len(ep.tokens) + need > max_context:
        # The feedback does not fit: the episode ends here (done or truncated), feedback dropped.
        if not (ep.tokens and ep.tokens[-1] in chat.stop_ids):
            ep.append(list(chat.turn_end), Role.PROMPT)
        ep.end_reason = EndReason.DONE if res.done else EndReason.CONTEXT
        if res.done and res.info.get("timeout"):
            ep.end_reason = EndReason.MAX_STEPS
        return False
    step.obs_start = ep.append(opening, Role.PROMPT)[0]
    ep.append(obs, Role.OBSERVATION)
    ep.append(harness, Role.HARNESS)
    step.obs_end = ep.append(ending, Role.PROMPT)[1]
    if res.done:
        ep.end_reason = EndReason.MAX_STEPS if res.info.get("timeout") else EndReason.DONE
        return False
    if ep.num_steps >= max_steps:
        ep.end_reason = EndReason.MAX_STEPS
        return False
    return True


def _abort(ep: Episode, stats: RolloutStats, msg: str) -> None:
    ep.end_reason = EndReason.ABORTED
    ep.success, ep.reward = False, 0.0
    stats.env_errors += 1
    stats.errors.append(msg)
    log.warning("env error, episode aborted: %s", msg)
