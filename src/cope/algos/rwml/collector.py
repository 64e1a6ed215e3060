"""RWML as a collector (``algo=rwml``, ``algo=rwml_grpo``): the epoch's world-model episodes, for unchanged GRPO + KL.

Follows RWML (arXiv 2602.05842, self-supervised world-model RL). Each epoch of the RWML stage:

1. the run's ordinary collector (:class:`~cope.train.collect.sync.SyncCollector`) gathers the epoch's task episodes
   as usual: no extra env step is taken;
2. they are cut into triplets (:mod:`~cope.algos.rwml.triplets`), at most ``max_triplets`` drawn from them;
3. the policy, prompted to act as the environment (:mod:`~cope.algos.rwml.prompt`), samples ``predictions`` (G)
   next observations per triplet through the rollout engine (``engine.complete``: token ids in, ids out, at the
   training sampling's temperature, so the policy gradient scores them under the distribution that sampled them);
4. each prediction is scored against the real observation (:mod:`~cope.algos.rwml.rewards`: 0 or 1);
5. the too-easy filter (:mod:`~cope.algos.rwml.easy_filter`) drops most all-correct triplets;
6. every prediction becomes an :class:`~cope.episode.Episode`: the prompt ids (PROMPT) and the sampled ids
   (ACTION), one step, reward 0/1, success = reward 1; each triplet is a GRPO group. The epoch builder, the
   advantages and the objectives (``algo.objectives``: GRPO's clipped policy gradient and its KL) are the ones every
   run uses, unchanged.

Stages (``epochs``): epoch e is an RWML epoch while ``e < epochs`` (None: always), after that the collector hands
the task episodes over as they came (ordinary GRPO on the task reward, "RWML + policy RL" in one run). The stage is a
function of the epoch alone, and every draw of an RWML epoch comes from the epoch's task stream (derived from the run
seed, the rank and the epoch), so a resume inside either stage collects what the uninterrupted run collected.

Where we deliberately differ from the paper:
    * the "weaker model" of the too-easy filter is the current policy itself (its G predictions);
    * the embedder and tau_d are not published: ours are config choices (:mod:`~cope.algos.rwml.embedders`);
    * in the RWML stage the epoch's ``rollout/*`` metrics describe the world-model episodes (``rollout/success`` is
      the prediction pass rate); the task episodes' success is ``rwml/task_success``;
    * under DDP every rank trains all of its kept groups and takes the optimizer steps of the rank with the most
      (``Collected.nominal``): a rank with fewer spreads them over smaller minibatches, a rank with none trains one
      idle row (:func:`~cope.train.collect.experience.idle_row`: skipped, no target, in no failure count), so the
      ranks' steps meet;
    * an RWML epoch in which no rank kept a world-model group (a cold-start policy whose every action is malformed gets
      no observation back; or every triplet all-correct and dropped by the too-easy filter: such a group has no
      advantage anyway) trains its task episodes with every reward 0 (:func:`placeholders`: no policy gradient, the
      KL term only; ``rwml/placeholder`` 1; ``rollout/*`` then describes the placeholders, read ``rwml/reward``): an
      epoch without batches would end Lightning's fit;
    * a prediction's step is ``valid`` (it is an answer, not an env action; its correctness is the reward).

Only collect-then-train is wrapped: the world-model episodes are sampled by the current weights and carry no
behaviour log-probs, so an off-policy inner collector (``data.max_lag >= 1``) is refused.
"""
from __future__ import annotations

import copy
import dataclasses
import logging
import random
import time
from typing import Any

from cope.algos.rwml.easy_filter import all_correct, keep_triplets
from cope.algos.rwml.prompt import WorldModelPrompt, prompt_ids
from cope.algos.rwml.rewards import EmbeddingCosine, Reward
from cope.algos.rwml.triplets import extract_triplets, previous_observation
from cope.algos.rwml.world import engine_completes, reduce_over_world
from cope.episode import EndReason, Episode, Role, Step
from cope.rollout.engine import Sampling
from cope.rollout.loop import Sampled
from cope.train.collect.collector import Collected, CollectorFactory, CollectorHost
from cope.train.collect.experience import idle_row
from cope.train.collect.sync import SyncCollector

log = logging.getLogger(__name__)
METRICS = ("rwml/stage", "rwml/placeholder", "rwml/triplets", "rwml/scored", "rwml/kept", "rwml/easy_dropped", "rwml/dropped_long",
           "rwml/failed", "rwml/reward", "rwml/copy_reward", "rwml/pass_rate", "rwml/all_correct",
           "rwml/task_success", "rwml/predictions_total")


def placeholders(episodes: list[Episode]) -> list[Episode]:
    """Copies of ``episodes`` with every reward 0 and no success: every group's advantage is 0, so they give no
    policy gradient, only the KL term's (what an RWML epoch without a triplet trains: nothing of the task reward)."""
    out = copy.deepcopy(episodes)
    for e in out:
        e.reward = e.score = 0.0
        e.success = False
        for s in e.steps:
            s.reward = 0.0
    return out


class RWMLCollector:
    """World-model episodes from the epoch's own task episodes (see the module doc).

    Args:
        host: what the DataModule lends (:class:`~cope.train.collect.collector.CollectorHost`).
        reward: scores a prediction against the real observation (default :class:`EmbeddingCosine`).
        predictions: G, predictions sampled per triplet (a GRPO group), >= 2.
        max_triplets: at most this many triplets per rank and epoch, drawn from the epoch's stream.
        easy_keep: the keep probability of a triplet whose G predictions all scored 1, in [0, 1].
        max_prediction_tokens: the cap of one prediction (an observation is longer than an action).
        prompt: the world-model instruction (None: :data:`cope.algos.rwml.prompt.DEFAULT_INSTRUCTION`).
        skip_invalid: no triplets from steps the env refused (:mod:`~cope.algos.rwml.triplets`).
        epochs: the RWML stage's length in epochs; later epochs are ordinary GRPO (None: RWML throughout).
        max_context: a prompt plus ``max_prediction_tokens`` must fit (``data.max_context``); longer ones are dropped.
        batch_size: prediction rows sampled at once (None: all of an epoch's at once).
        inner: the wrapped collector's factory (None: :class:`SyncCollector`); it must not be off-policy.
    """

    off_policy = False  # the predictions are sampled by the weights that score them
    needs_completions = True  # engine.complete (the engine's `completes` capability), for a config rule to read

    def __init__(self, *, host: CollectorHost, reward: Reward | None = None, predictions: int = 8,
                 max_triplets: int = 8, easy_keep: float = 0.1, max_prediction_tokens: int = 64,
                 prompt: str | None = None, skip_invalid: bool = False, epochs: int | None = None,
                 max_context: int = 2048, batch_size: int | None = None, inner: CollectorFactory | None = None):
        for key, v in dict(predictions=predictions - 1, max_triplets=max_triplets, max_prediction_tokens=max_prediction_tokens).items():
            if v < 1:
                raise ValueError(f"rwml.{key} must be >= {2 if key == 'predictions' else 1}, got "
                                 f"{v + 1 if key == 'predictions' else v}")
        if not 0.0 <= easy_keep <= 1.0:
            raise ValueError(f"rwml.easy_keep must be in [0, 1], got {easy_keep}")
        if epochs is not None and epochs < 0:
            raise ValueError(f"rwml.epochs must be null (RWML throughout) or >= 0, got {epochs}")
        if batch_size is not None and batch_size < 1:
            raise ValueError(f"rwml.batch_size must be null (all at once) or >= 1, got {batch_size}")
        if prompt is not None and not prompt.strip():
            raise ValueError("rwml.prompt is empty: give the world-model instruction, or null for the default")
        if max_prediction_tokens >= max_context:
            raise ValueError(f"rwml.max_prediction_tokens={max_prediction_tokens} leaves no room for a prompt in "
                             f"data.max_context={max_context}: every triplet would be dropped")
        if host.sampling.temperature <= 0:
            raise ValueError("data.sampling.temperature=0: RWML's G predictions of a triplet would all be the same greedy "
                             "answer (every group's advantage 0); sample with a temperature > 0")
        if not engine_completes(host.engine):
            name = type(host.engine).__name__
            raise ValueError(f"data.engine: algo=rwml samples world-model predictions with engine.complete, and {name} "
                             "cannot (no `completes` capability); use rollout=hf or rollout=vllm")
        self.host, self.reward = host, reward if reward is not None else EmbeddingCosine()
        self.G, self.max_triplets, self.easy_keep = int(predictions), int(max_triplets), float(easy_keep)
        self.max_prediction_tokens, self.prompt_text, self.skip_invalid = int(max_prediction_tokens), prompt, bool(skip_invalid)
        self.epochs, self.max_context, self.batch_size = epochs, int(max_context), batch_size
        self.inner = (inner or SyncCollector)(host=host)
        if getattr(self.inner, "off_policy", False):
            raise ValueError("data.max_lag: algo=rwml wraps collect-then-train only (its world-model episodes are sampled by "
                             "the current weights and carry no behaviour log-probs); use data.max_lag=0")
        self.predictions_total = 0  # predictions sampled so far, summed over ranks (checkpointed)
        self._prompt: WorldModelPrompt | None = None
        self._warned = False  # about an epoch without triplets (logged once)

    def active(self, epoch: int) -> bool:
        """Whether ``epoch`` is an RWML epoch (else ordinary GRPO on the task episodes)."""
        return self.epochs is None or epoch < self.epochs

    def _policy(self) -> Any:
        """The bound policy (tokenizer, chat scaffold) the host lends."""
        policy = self.host.policy()
        if policy is None:
            raise RuntimeError("RWMLCollector: no policy bound yet (RolloutDataModule.connect must run first)")
        return policy

    def collect(self, epoch: int) -> Collected:
        got = self.inner.collect(epoch)
        ok = [e for e in got.episodes if not e.aborted]
        base = dict.fromkeys(METRICS, 0.0)
        base["rwml/task_success"] = sum(e.success for e in ok) / max(len(ok), 1)
        if not self.active(epoch):
            base["rwml/predictions_total"] = float(self.predictions_total)
            return dataclasses.replace(got, metrics={**got.metrics, **base})
        t0 = time.perf_counter()
        episodes, groups, metrics, tokens, gen_seconds, most = self._world_model_episodes(got, epoch)
        nominal = most * self.G if self.host.world() > 1 else None  # every rank takes the steps of the fullest one
        if most == 0:  # no world-model group on any rank: an epoch without batches would end the fit
            episodes, groups, nominal = placeholders(got.episodes), list(got.groups), None
            metrics["rwml/placeholder"] = 1.0
            if not self._warned:
                self._warned = True
                log.warning("RWML epoch %d: no rank kept a world-model group to train on (this rank: rwml/triplets=%d, "
                            "scored %d, dropped by the too-easy filter %d, too long %d): the epoch trains its task "
                            "episodes with reward 0 (no policy gradient, the KL term only; rwml/placeholder=1)", epoch,
                            int(metrics["rwml/triplets"]), int(metrics["rwml/scored"]),
                            int(metrics["rwml/easy_dropped"]), int(metrics["rwml/dropped_long"]))
        elif not episodes:  # other ranks kept groups: this one trains an idle row in each of their steps
            episodes, groups = [idle_row(got.episodes[0])], [0]
        stats = dataclasses.replace(got.stats, errors=list(got.stats.errors))
        stats.generated_tokens += tokens
        stats.gen_seconds += gen_seconds
        seconds = got.seconds + time.perf_counter() - t0
        return Collected(episodes, groups, stats, got.rng, seconds, {**got.metrics, **base, **metrics}, nominal=nominal)

    def _world_model_episodes(self, got: Collected, epoch: int):
        policy = self._policy()
        tokenizer, chat = policy.tokenizer, policy.chat
        if self._prompt is None:
            self._prompt = WorldModelPrompt(tokenizer, self.prompt_text)
        sub = random.Random(got.rng.getrandbits(63))  # the epoch's task stream: (seed, rank, epoch), resume-exact
        triplets = extract_triplets(got.episodes, chat, self.skip_invalid)
        prompts = [prompt_ids(got.episodes[tr.episode], tr, chat, self._prompt) for tr in triplets]
        fits = [i for i, p in enumerate(prompts) if len(p) + self.max_prediction_tokens <= self.max_context]
        chosen = sorted(sub.sample(fits, self.max_triplets)) if len(fits) > self.max_triplets else fits
        s = self.host.sampling
        sampling = Sampling(temperature=s.temperature, top_p=s.top_p, max_action_tokens=self.max_prediction_tokens,
                            seed=sub.randrange(2**31))
        t0 = time.perf_counter()
        with self.host.precision():  # on every rank, none chosen too: under trainer=fsdp it gathers the weights
            sampled = self.host.engine.complete([prompts[i] for i in chosen], sampling, n=self.G,
                                                batch_size=self.batch_size)
        gen_seconds = time.perf_counter() - t0
        targets = [tokenizer.decode(list(triplets[i].observation), skip_special_tokens=True) for i in chosen]
        texts, pairs = [], []  # (prediction, target) texts of the samples that came back
        for k, (row, target) in enumerate(zip(sampled, targets)):
            for j, item in enumerate(row):
                if isinstance(item, BaseException):
                    continue
                ids = item.ids if isinstance(item, Sampled) else list(item)
                closed = bool(ids) and ids[-1] in chat.stop_ids
                texts.append(tokenizer.decode(ids[:-1] if closed else ids, skip_special_tokens=True))
                pairs.append((k, j, target))
        scores = self.reward(texts, [t for _, _, t in pairs]) if texts else []
        # the diagnostic: what repeating the observation before a_t would score on the same triplets (a reward that
        # pays for it can be earned without modelling the action at all)
        copies = [tokenizer.decode(list(previous_observation(got.episodes[triplets[i].episode], triplets[i].step)),
                                   skip_special_tokens=True) for i in chosen]
        copy_scores = self.reward(copies, targets) if chosen else []
        rewards = [[0.0] * self.G for _ in chosen]
        for (k, j, _), r in zip(pairs, scores):
            rewards[k][j] = float(r)
        keep = keep_triplets(rewards, self.easy_keep, sub)
        kept = [k for k in range(len(chosen)) if keep[k]]
        most = int(reduce_over_world([len(kept)], "max", self.host.world())[0])
        predicted = {(k, j): text for (k, j, _), text in zip(pairs, texts)}
        episodes, groups = [], []
        for g, k in enumerate(kept):
            i = chosen[k]
            task = got.episodes[triplets[i].episode].task
            for j, item in enumerate(sampled[k]):
                episodes.append(self._episode(task, g, prompts[i], item, rewards[k][j], predicted.get((k, j), ""), chat,
                                              epoch))
                groups.append(g)
        tokens = sum(len(it.ids) for row in sampled for it in row if isinstance(it, Sampled))
        self.predictions_total += int(reduce_over_world([float(len(chosen) * self.G)], "sum", self.host.world())[0])
        n = max(len(chosen), 1)
        flat = [r for row in rewards for r in row]
        metrics = {
            "rwml/stage": 1.0,
            "rwml/triplets": float(len(triplets)),
            "rwml/scored": float(len(chosen)),
            "rwml/kept": float(len(kept)),
            "rwml/easy_dropped": float(sum(not x for x in keep)),
            "rwml/dropped_long": float(len(triplets) - len(fits)),
            "rwml/failed": float(len(chosen) * self.G - len(pairs)),
            "rwml/reward": sum(flat) / max(len(flat), 1),
            "rwml/copy_reward": sum(copy_scores) / n,
            "rwml/pass_rate": sum(any(r == 1.0 for r in row) for row in rewards) / n,
            "rwml/all_correct": sum(all_correct(row) for row in rewards) / n,
            "rwml/predictions_total": float(self.predictions_total),
        }
        return episodes, groups, metrics, tokens, gen_seconds, most

    @staticmethod
    def _episode(task, group: int, prompt: list[int], item: Any, reward: float, text: str, chat, epoch: int) -> Episode:
        """One prediction as a one-step episode: the prompt (PROMPT), the sampled ids (ACTION), reward 0/1."""
        ep = Episode(task=task, group=group, prompt_len=len(prompt), sampled_epoch=epoch)
        ep.append(prompt, Role.PROMPT)
        if isinstance(item, BaseException):  # a server request failed: no prediction, out of the loss
            ep.end_reason = EndReason.ABORTED
            return ep
        ids, lps = (item.ids, item.logprobs) if isinstance(item, Sampled) else (list(item), None)
        a0, a1 = ep.append(ids, Role.ACTION)
        closed = bool(ids) and ids[-1] in chat.stop_ids
        ep.steps.append(Step(a0, a1, closed, True, text, reward=reward, sampler_logprobs=lps))
        ep.reward = ep.score = reward
        ep.success = reward == 1.0
        return ep

    def cancel(self) -> None:
        self.inner.cancel()

    def state_dict(self) -> dict:
        """The wrapped collector's state and the predictions sampled so far (summed over ranks)."""
        return {**self.inner.state_dict(), "rwml_predictions": self.predictions_total}

    def load_state_dict(self, state: dict) -> None:
        self.inner.load_state_dict(state)
        self.predictions_total = int(state.get("rwml_predictions", 0))
