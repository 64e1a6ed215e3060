"""Episode records: the single source of truth for which token is prompt scaffold, action,
observation or harness text, and which action was valid.

Token-in/token-out: ``Episode.tokens`` holds exactly the ids the policy sampled for its actions,
interleaved with the ids of the scaffold and of the env's text (each tokenized once, on its own).
Nothing downstream decodes and re-encodes; every mask is read from ``roles`` and ``steps``.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from enum import IntEnum

from cope.envs.base import Task


class Role(IntEnum):
    PAD = -1  # right padding in a batch
    PROMPT = 0  # system prompt, chat-template tokens, end-of-turn ids the engine had to add
    ACTION = 1  # sampled by the policy (policy-gradient targets)
    OBSERVATION = 2  # env output (ECHO targets)
    HARNESS = 3  # text our adapters add (warnings, truncation notices): never a target


class EndReason:
    DONE = "done"  # the env said done (success or failure)
    MAX_STEPS = "max_steps"  # step budget used up: a failure
    CONTEXT = "context"  # the next turn would not fit the context: truncated, counted, kept as a failure
    ABORTED = "aborted"  # the env crashed or timed out: excluded from the loss, counted
    # left out on purpose by its collector (an SFT demonstration it cannot train as it is): excluded from the loss like
    # an aborted one (Episode.aborted), but no failure: not in env/aborted_episodes, rollout/aborted, health/aborted_frac
    SKIPPED = "skipped"


@dataclass
class Step:
    """One agent turn: the sampled action and what came back."""

    action_start: int  # first token of the sampled action in Episode.tokens
    action_end: int  # one past the last sampled token (the end-of-turn id when it was sampled)
    closed: bool  # the policy sampled the end-of-turn id itself (False: hit the per-action token cap)
    valid: bool  # the env accepted the action
    action_text: str  # decoded for logs and tables only; never re-encoded
    reward: float = 0.0
    obs_start: int = -1  # span of the feedback turn after the action (scaffold + observation + harness)
    obs_end: int = -1
    # The env read this action out of free text (``env.action_parsing=project``, ``info["projected"]``):
    # ``valid`` still says whether the env accepted the move (and the reward counts), but the action was
    # not in the strict format. Counted in ``rollout/projected_actions``; see :attr:`strict`.
    projected: bool = False
    sampler_logprobs: list[float] | None = None  # log p of each action token as the sampler saw it (a server engine), else None
    # Sampled ids (from action_start) up to the end of the first complete admissible action, or None (no prefix of
    # the action is an admissible action, or the env lists none): cope.rollout.complete.complete_prefix_len.
    complete_len: int | None = None

    @property
    def content_len(self) -> int:
        """Sampled ids of the action without its end-of-turn id."""
        return self.action_end - self.action_start - int(self.closed)

    @property
    def multi_action(self) -> bool:
        """A complete admissible action followed by more sampled text (``westwest``): the policy did not stop."""
        return self.complete_len is not None and self.complete_len < self.content_len

    @property
    def strict(self) -> bool:
        """Valid and in the env's strict format (not projected): what a consumer that must learn the
        format (CoPE's forecast targets) should treat as a valid action."""
        return self.valid and not self.projected


@dataclass
class Episode:
    task: Task
    group: int  # index of the GRPO group (same task) inside the rollout batch
    tokens: list[int] = field(default_factory=list)
    roles: list[int] = field(default_factory=list)
    steps: list[Step] = field(default_factory=list)
    reward: float = 0.0  # total reward (sum over steps)
    success: bool = False
    score: float = 0.0
    end_reason: str = EndReason.DONE
    advantage: float = 0.0  # filled by the advantage estimator
    # per step, where the estimator gives each step its own (algo.advantage_mode=node_value); None: ``advantage``
    # on every action token
    step_advantages: list[float] | None = None
    prompt_len: int = 0  # tokens before the first action
    sampled_epoch: int = 0  # the epoch whose starting weights sampled it (set by the collector; < epoch with data.max_lag)
    # Branched rollouts (cope.train.collect.branching): the index, in its epoch's episode list, of the episode this one
    # forked from (-1: a root, or any unbranched episode), and how many of its first steps it shares with that parent
    # (their tokens, up to the end of step ``shared_steps``'s feedback, are the parent's ids; never re-sampled).
    branch_of: int = -1
    shared_steps: int = 0

    def append(self, ids: list[int], role: Role) -> tuple[int, int]:
        start = len(self.tokens)
        self.tokens.extend(ids)
        self.roles.extend([int(role)] * len(ids))
        return start, len(self.tokens)

    @property
    def num_steps(self) -> int:
        return len(self.steps)

    @property
    def truncated(self) -> bool:
        return self.end_reason == EndReason.CONTEXT

    @property
    def aborted(self) -> bool:
        """No loss trains it: the env or a worker failed (``ABORTED``), or its collector skipped it (``SKIPPED``)."""
        return self.end_reason in (EndReason.ABORTED, EndReason.SKIPPED)

    @property
    def skipped(self) -> bool:
        """Left out on purpose (``EndReason.SKIPPED``): :attr:`aborted`, but not counted as a failure."""
        return self.end_reason == EndReason.SKIPPED

    @property
    def failed(self) -> bool:
        """Aborted by a failure of the env, a worker or the server (not :attr:`skipped`): what ``env/aborted_episodes``,
        ``rollout/aborted`` and ``health/aborted_frac`` count."""
        return self.end_reason == EndReason.ABORTED

    @property
    def num_action_tokens(self) -> int:
        return sum(1 for r in self.roles if r == Role.ACTION)

    def step_of_token(self) -> list[int]:
        """For each token, the index of the step whose action or feedback it belongs to (-1: prompt)."""
        out = [-1] * len(self.tokens)
        for i, s in enumerate(self.steps):
            end = s.obs_end if s.obs_end >= 0 else s.action_end
            for j in range(s.action_start, end):
                out[j] = i
        return out
