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

Native tool calls (an env whose reset lists tools in ``EnvReset.info["tools"]``: ``env.action_format=native``): the
system turn lists the tools as the model's chat template renders them (:class:`cope.chat.tools.ToolTurns`), each
sampled turn is read in the template's call syntax and checked against the tools, the env gets one action string
(:mod:`cope.envs.tool_calls`), and the feedback to a call goes in the template's tool-result turn (scaffold cut from
the template, the result text as OBSERVATION tokens); a turn without a call, or with broken call markup, gets a user
turn as before. In these episodes each prompt and feedback turn is tokenized as one text across its cuts, env text
with its special strings split (:mod:`cope.chat.segments`: tool templates put plain text right after the env's, where
separately tokenized pieces would drift from the template's ids); text-format episodes are unchanged. Refused calls
(malformed, unknown tool, arguments failing the schema) are invalid steps the env still counts, and are counted in
``RolloutStats.tool_call_errors``. A template without tool support is a ValueError naming the model and
``env.action_format`` at the first reset.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Callable, Protocol

from cope.chat import ChatFormat
from cope.chat.segments import Segment, decode, encode_segments
from cope.chat.tools import Reading
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
    tool_call_errors: int = 0  # native tool calls refused: malformed markup, unknown tool, arguments failing the schema

    def add(self, other: "RolloutStats") -> None:
        """Accumulate another run's stats (the waves of one epoch)."""
        for k in ("episodes", "env_steps", "generated_tokens", "env_errors", "gen_seconds", "env_seconds", "sync_seconds",
                  "tool_call_errors"):
            setattr(self, k, getattr(self, k) + getattr(other, k))
        self.errors += other.errors


def _encode(tokenizer, text: str) -> list[int]:
    if not text:
        return []
    return tokenizer(text, add_special_tokens=False, split_special_tokens=True)["input_ids"]


def _tool_turns(chat: ChatFormat, tokenizer):
    if chat.tools is None:
        model = getattr(tokenizer, "name_or_path", "") or "the tiny model being built (model=tiny)"
        raise ValueError(f"the env declares tools (env.action_format=native), but the chat template of {model} has no "
                         f"tool support ({chat.tools_note or 'it renders no tools'}): use env.action_format=text with "
                         "this model")
    return chat.tools


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
    rule_ids = _encode(tokenizer, rules)
    system = chat.system_turn(rule_ids)
    native: list[list[dict] | None] = [None] * len(eps)  # the tools of each native-tool episode
    readings: list[Reading | None] = [None] * len(eps)  # how each one's last action was read
    t0 = time.perf_counter()
    firsts = batch.reset(list(enumerate(tasks)))
    stats.env_seconds += time.perf_counter() - t0
    live: list[int] = []
    for i, (ep, first) in enumerate(zip(eps, firsts)):
        tools = None if isinstance(first, BaseException) else (first.info or {}).get("tools")
        if not tools:
            ep.append(system, Role.PROMPT)
        if isinstance(first, BaseException):  # an env crash aborts its episode, never the run
            _abort(ep, stats, f"reset {ep.task.id}: {first!r}")
            continue
        admissible[i] = first.admissible_actions
        if tools:  # the template's tool list, and every text of the turn tokenized across its cuts
            pre, mid = _tool_turns(chat, tokenizer).head(tools)
            native[i] = list(tools)
            _append_segments(ep, tokenizer, [
                Segment(pre, Role.PROMPT, True), Segment(rules, Role.PROMPT, False), Segment(mid, Role.PROMPT, True),
                *_feedback_segments(first.observation, first.harness), Segment(decode(tokenizer, chat.close_turn()), Role.PROMPT, True)])
        else:
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
                                         max_context, max_action_tokens, readings[i])]
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
                sent_action = text
                if native[i] is not None:  # read in the template's call syntax, special tokens kept
                    raw = tokenizer.decode(ids[:-1] if closed else ids, skip_special_tokens=False,
                                           clean_up_tokenization_spaces=False)
                    readings[i] = chat.tools.read(raw, native[i])
                    sent_action = readings[i].action(text)
                    stats.tool_call_errors += bool(readings[i].error)
                items.append((i, sent_action))
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
              chat: ChatFormat, max_context: int, max_action_tokens: int, reading: Reading | None = None) -> bool:
    """Apply one step result (or the exception standing for it) to its episode; True if it goes on. ``reading``: how
    a native-tool episode's action was read (a call is answered in the template's tool-result turn)."""
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
    if reading is not None:  # a native-tool episode: the whole turn as (ids, roles), tokenized across its cuts
        turn = _native_turn(res, closed, reading, tokenizer, chat)
        size = len(turn[0])
    else:
        obs = _encode(tokenizer, res.observation)
        harness = _encode(tokenizer, ("\n" if res.observation else "") + res.harness) if res.harness else []
        opening = chat.after_action(closed)
        ending = chat.user_end() if res.done else chat.close_turn()
        size = len(opening) + len(obs) + len(harness) + len(ending)
    # room for the next action and for the end-of-turn id added when it hits the token cap
    need = size + (0 if res.done else max_action_tokens + len(chat.turn_end))
    if len(ep.tokens) + need > max_context:
        # The feedback does not fit: the episode ends here (done or truncated), feedback dropped.
        if not (ep.tokens and ep.tokens[-1] in chat.stop_ids):
            ep.append(list(chat.turn_end), Role.PROMPT)
        ep.end_reason = EndReason.DONE if res.done else EndReason.CONTEXT
        if res.done and res.info.get("timeout"):
            ep.end_reason = EndReason.MAX_STEPS
        return False
    if reading is not None:
        step.obs_start = len(ep.tokens)
        _append_segments(ep, tokenizer, None, turn)
        step.obs_end = len(ep.tokens)
    else:
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


def _native_turn(res, closed: bool, reading: Reading, tokenizer, chat: ChatFormat) -> tuple[list[int], list[int]]:
    """The feedback turn of a native-tool episode as (ids, roles): the template's tool-result turn after a call (user
    turn otherwise), the env's texts in it, tokenized as one text across the cuts (:mod:`cope.chat.segments`)."""
    turns, end = chat.tools, ("" if closed else decode(tokenizer, chat.turn_end))
    if reading.tool_turn:
        opening, ending = end + turns.after_call, turns.result_end if res.done else turns.result_close
    else:
        opening = decode(tokenizer, chat.after_action(closed))
        ending = decode(tokenizer, chat.user_end() if res.done else chat.close_turn())
    return encode_segments(tokenizer, [Segment(opening, Role.PROMPT, True), *_feedback_segments(res.observation, res.harness),
                                       Segment(ending, Role.PROMPT, True)])


def _feedback_segments(observation: str, harness: str) -> list[Segment]:
    """The env's texts of a turn: the observation, then the harness text on its own line."""
    return [Segment(observation, Role.OBSERVATION, False),
            Segment(("\n" if observation else "") + harness if harness else "", Role.HARNESS, False)]


def _append_segments(ep: Episode, tokenizer, segments: list[Segment] | None, encoded=None) -> None:
    """Append ``segments`` (or their ``encoded`` ``(ids, roles)``), one ``Episode.append`` per run of one role."""
    ids, roles = encoded if encoded is not None else encode_segments(tokenizer, segments)
    start = 0
    for k in range(1, len(ids) + 1):
        if k == len(ids) or roles[k] != roles[start]:
            ep.append(ids[start:k], Role(roles[start]))
            start = k


def _abort(ep: Episode, stats: RolloutStats, msg: str) -> None:
    ep.end_reason = EndReason.ABORTED
    ep.success, ep.reward = False, 0.0
    stats.env_errors += 1
    stats.errors.append(msg)
    log.warning("env error, episode aborted: %s", msg)
