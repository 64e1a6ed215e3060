"""CoPE's forecast sample as its authors built it (``cope.sample=prompted``), token-in/token-out.

Follows the authors' public code (ulab-uiuc/CoPE, ``src/verl/agent_trainer/ppo/action_forecast.py``): for each
action turn t of a kept trajectory, the history up to the observation a_t answers, one extra user turn asking
for the next k actions (k the realized count, k = min(K, actions left)), and as target the policy's own next k
actions: one assistant turn, one action per line (layout ``list``), or k assistant turns of one action each
with a fixed "Next action?" user turn between them (layout ``turns``, for tool-calling envs: a multi-line list
looks like several tool calls in one turn). Their gates (``wins``, ``all``, ``mixed``), their look-past of
ineffective actions (``skip``: a sample anchored at an invalid a_t targets the next k effective actions) and
their group weights (1/m_g, then mean 1) are kept.

Where we deliberately differ:
    * Token-in/token-out: they re-render the conversation through the chat template and re-tokenize it; we
      continue the transcript (the prefix is ``Episode.tokens[:anchor]``) with the scaffold ids of
      :class:`~cope.chat.ChatFormat` and the ids the policy sampled (stop id dropped); only the prompt text is
      tokenized. It decodes to the text their rendering gives (tests/forecasting/test_prompted_templates.py).
    * Too long: they cut from the left (4096 tokens); we drop the sample and count it, because our samples
      continue the transcript at its own positions, and a left cut would change the history they condition on.
    * Validity comes from ``Step.valid`` (``Step.strict`` with ``mask_projected``), not from matching
      observation text; the whole sampled action is the target (our actions carry no "Thought" to strip).
    * The loss ends at the last turn end; their mask also covers the newline rendered after it, never sampled.
    * ``gate='all'`` keeps every trajectory also with group weights (theirs turns ``all`` into ``wins`` then).
    * ``mask`` and ``cut`` are ours (as in :mod:`cope.algos.cope.chunks`); they had skip-invalid on or off.

The samples go into a batch with :func:`cope.algos.cope.packing.plain_forecasts` (one row per sample); the
packed layout needs chunks that start with a_t.
"""
from __future__ import annotations

import statistics
from collections import Counter

from cope.algos.cope.chunks import ForecastChunk
from cope.algos.cope.gate import check_gate, kept_episodes
from cope.chat import ChatFormat
from cope.episode import Episode

LAYOUTS = ("list", "turns")
INVALID = ("skip", "mask", "cut")
PROMPTS = {
    "list": "Plan ahead: list the next {k} actions you will take to make progress on the task, starting with the "
            "action you take right now, one action per line.",
    "turns": "Plan ahead: give the next {k} actions you will take to make progress on the task, one action per "
             "reply, starting with the action you take right now. Reply with the action only.",
}
NEXT_PROMPT = "Next action?"


class PlanPrompt:
    """The plan-ahead user text as ids, tokenized once per distinct k.

    Args:
        tokenizer: anything with ``encode(text, add_special_tokens=False)``.
        layout: ``list`` (one assistant turn listing the actions) or ``turns`` (one turn per action).
        prompt: the user text, ``{k}`` standing for the realized count (default: the authors' text of ``layout``).
        next_prompt: the user turn between two actions of layout ``turns``.
    """

    def __init__(self, tokenizer, layout: str = "list", prompt: str | None = None, next_prompt: str = NEXT_PROMPT):
        if layout not in LAYOUTS:
            raise ValueError(f"forecast layout must be one of {LAYOUTS}, got {layout!r}")
        self.layout, self.prompt = layout, PROMPTS[layout] if prompt is None else prompt
        if "{k}" not in self.prompt:
            raise ValueError(f"the forecast prompt needs '{{k}}' for the number of actions, got {self.prompt!r}")
        self._tokenizer, self._ids = tokenizer, {}
        self.next_ids = self._encode(next_prompt)

    def _encode(self, text: str) -> list[int]:
        return list(self._tokenizer.encode(text, add_special_tokens=False))

    def ids(self, k: int) -> list[int]:
        """The ids of the prompt for ``k`` actions."""
        if k not in self._ids:
            self._ids[k] = self._encode(self.prompt.replace("{k}", str(k)))
        return self._ids[k]


def check_prompted_args(K: int, invalid: str, gate: str) -> None:
    """Cross-field rules of :func:`build_prompted` (for a caller's construction)."""
    if K < 1:
        raise ValueError(f"forecast K must be >= 1, got {K}")
    if invalid not in INVALID:
        raise ValueError(f"forecast invalid must be one of {INVALID}, got {invalid!r}")
    check_gate(gate)


def _actions(ep: Episode, chat: ChatFormat, mask_projected: bool) -> list[tuple[list[int], bool]]:
    """Per step: the sampled ids without the stop id, and whether the action counts as valid."""
    out = []
    for s in ep.steps:
        ids = ep.tokens[s.action_start : s.action_end]
        if ids and ids[-1] in chat.stop_ids:
            ids = ids[:-1]
        out.append((ids, s.strict if mask_projected else s.valid))
    return out


def _select(acts: list[tuple[list[int], bool]], t: int, K: int, invalid: str) -> tuple[list[tuple[int, bool]], int]:
    """The listed actions of the sample at t as (step, supervised), and how many actions it looked past.

    An empty action (only the stop id) is never listed: ``skip`` looks past it, ``mask`` and ``cut`` leave it
    out of their window of K turns (the authors drop empty actions in both of their modes)."""
    if invalid == "skip":
        sel, past = [], 0
        for j in range(t, len(acts)):
            if len(sel) == K:
                break
            if acts[j][0] and acts[j][1]:
                sel.append((j, True))
            else:
                past += 1
        return sel, past
    sel = []
    for j in range(t, min(t + K, len(acts))):
        ids, ok = acts[j]
        if invalid == "cut" and not ok:
            break
        if ids:
            sel.append((j, ok))
    return sel, 0


def _sample(ep: Episode, ei: int, t: int, sel: list[tuple[int, bool]], acts: list[tuple[list[int], bool]],
            chat: ChatFormat, plan: PlanPrompt) -> ForecastChunk:
    """The sample at t: ``user_open prompt(k) end nl assistant_open`` and the listed actions.

    The token that ends a_j (the newline after it, or the last turn end; in ``turns`` its turn end) belongs to
    a_j: same ``action_index``, supervised with it, as the sampled stop id is part of a_j in the transcript."""
    start = ep.steps[t].action_start
    anchor, closing = start - len(chat.assistant_open), [*chat.turn_end, *chat.newline]
    if (ep.tokens[anchor - len(closing) : anchor] != closing
            or ep.tokens[anchor:start] != list(chat.assistant_open)):
        raise ValueError(f"step {t} of episode {ei} is not preceded by turn end, newline and assistant open")
    toks: list[int] = []
    target: list[bool] = []
    index: list[int] = []

    def put(ids, sup: bool = False, j: int = -1) -> None:
        toks.extend(ids)
        target.extend([sup] * len(ids))
        index.extend([j] * len(ids))

    put([*chat.user_open, *plan.ids(len(sel)), *closing, *chat.assistant_open])
    turn_joiner = [*chat.newline, *chat.user_open, *plan.next_ids, *closing, *chat.assistant_open]
    for n, (j, sup) in enumerate(sel):
        if plan.layout == "turns" and n:
            put(turn_joiner)
        put(acts[j][0], sup, j)
        last = n == len(sel) - 1
        put(chat.newline if plan.layout == "list" and not last else chat.turn_end, sup, j)
    return ForecastChunk(ei, t, anchor, toks, target, index, sum(sup for _, sup in sel))


def build_prompted(
    episodes: list[Episode],
    chat: ChatFormat,
    plan: PlanPrompt,
    K: int = 3,
    invalid: str = "skip",
    mask_projected: bool = True,
    gate: str = "wins",
    success_threshold: float | None = 0.5,
    group_weights: bool = True,
    max_context: int | None = None,
    indices: list[int] | None = None,
) -> tuple[list[ForecastChunk], dict[str, float]]:
    """The authors' forecast samples of the kept episodes, one per action turn with an action left to list.

    Pass every episode of the rollout batch at once: ``mixed`` and the group weights look at whole groups.

    Args:
        episodes: the episodes (``Episode.group`` is the GRPO group).
        chat: the chat scaffold the transcripts were built with.
        plan: the plan-ahead prompt and the layout (``list`` or ``turns``).
        K: actions asked for; a sample lists k = min(K, actions left) of them.
        invalid: ``skip`` (look past invalid actions to the next k effective ones), ``mask`` (list them
            without loss) or ``cut`` (end the list before the first one; an invalid a_t gives no sample).
        mask_projected: an action the env read out of free text (``Step.projected``) counts as invalid.
        gate: ``wins`` (reward > ``success_threshold``), ``all``, or ``mixed`` (the wins of groups holding at
            least one win and one loss). Aborted episodes never give samples.
        success_threshold: the reward a win must exceed (None: the env's success flag; :mod:`cope.algos.cope.gate`).
        group_weights: each sample of a trajectory weighs 1/m_g (m_g: trajectories of its group with
            samples), rescaled to mean 1 over the samples; off: all weights 1.
        max_context: samples longer than this (prefix included) are dropped and counted; None keeps all.
        indices: the episode index stored in each sample (default: position in ``episodes``).

    Returns:
        (samples, metrics): ``forecast/samples``, ``forecast/trajectories`` (kept, with samples),
        ``forecast/groups_skipped_mixed``, ``forecast/k_mean``, ``forecast/weight_std`` (n - 1, as theirs),
        ``forecast/target_tokens``, ``forecast/dropped_long``, ``forecast/invalid_skipped`` (actions the
        returned samples looked past), ``forecast/projected_masked`` (actions of the kept episodes the env accepted
        but read out of free text, counted invalid by ``mask_projected``).
    """
    check_prompted_args(K, invalid, gate)
    if plan.layout == "list" and not chat.newline:
        raise ValueError("forecast layout 'list' joins actions with the scaffold's newline, and this one has none")
    idx = list(indices) if indices is not None else list(range(len(episodes)))
    if len(idx) != len(episodes):
        raise ValueError(f"build_prompted: {len(idx)} indices for {len(episodes)} episodes")
    keep, skipped_groups = kept_episodes(episodes, gate, success_threshold)
    trajectories: list[tuple[int, list[ForecastChunk]]] = []
    dropped = looked_past = masked = 0
    for ei, ep, kept in zip(idx, episodes, keep):
        if not kept:
            continue
        acts, mine = _actions(ep, chat, mask_projected), []
        masked += sum(s.valid and s.projected for s in ep.steps) if mask_projected else 0
        for t in range(ep.num_steps):
            sel, past = _select(acts, t, K, invalid)
            if not any(sup for _, sup in sel):
                continue
            c = _sample(ep, ei, t, sel, acts, chat, plan)
            if max_context is not None and c.anchor + len(c.tokens) > max_context:
                dropped += 1
                continue
            looked_past += past
            mine.append(c)
        if mine:
            trajectories.append((ep.group, mine))
    chunks = [c for _, mine in trajectories for c in mine]
    if group_weights and chunks:
        m = Counter(g for g, _ in trajectories)
        for g, mine in trajectories:
            for c in mine:
                c.weight = 1.0 / m[g]
        mean = sum(c.weight for c in chunks) / len(chunks)
        for c in chunks:
            c.weight /= mean
    ks = [len({j for j in c.action_index if j >= 0}) for c in chunks]
    metrics = {
        "forecast/samples": float(len(chunks)),
        "forecast/trajectories": float(len(trajectories)),
        "forecast/groups_skipped_mixed": float(skipped_groups),
        "forecast/k_mean": sum(ks) / len(ks) if ks else 0.0,
        "forecast/weight_std": statistics.stdev(c.weight for c in chunks) if len(chunks) > 1 else 0.0,
        "forecast/target_tokens": float(sum(sum(c.target) for c in chunks)),
        "forecast/dropped_long": float(dropped),
        "forecast/invalid_skipped": float(looked_past),
        "forecast/projected_masked": float(masked),
    }
    return chunks, metrics
