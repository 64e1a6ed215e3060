"""The end-of-turn token, watched: does the policy still stop after a complete action, and which way does the
policy gradient push it?

Once per epoch (every ``every_n_epochs``), before the epoch's first update (``on_train_epoch_start`` runs before
the module's: the policy is the one that sampled the epoch), on the epoch's rollout minibatches:

* ``stop/prob``: the policy's probability of an end-of-turn id right after a complete admissible action
  (:attr:`cope.episode.Step.complete_len`), at the sampling temperature, whatever it then sampled there;
* ``stop/share_pos``, ``stop/share_neg``: the sampled end-of-turn ids' share of the policy gradient's push on
  the sampled tokens' logits, from episodes with a positive / a negative advantage;
* ``stop/push``: the signed net push of the update on the end-of-turn logits after complete actions, in the
  same units (< 0: the update makes stopping less likely). :mod:`cope.algos.stop_stats` has the math. With
  ``data.max_lag`` >= 1 each token's weight is the loss's: the aggregation's times the behaviour weight
  ``min(pi / pi_behaviour, behaviour_cap)`` (:func:`cope.algos.grpo.behaviour_weight`; the policy "now" is the proximal one).

``stop/positions`` counts the complete actions ``stop/prob`` is over: 0 means no measurement (the logged 0 is no
probability), e.g. while every answer is prose that the env's projection reads (SmolLM2 on the maze).

After each validation run, on the greedy held-out episodes: ``stop/prob_val`` over ``stop/positions_val`` (the same probability; with
``rollout/multi_action``, ``val/multi_action``, ``*/action_cap`` from the episode metrics, this is the format's
early warning). It costs one no-grad forward over at most ``max_episodes`` episodes of the epoch, and as many
of the panel; it feeds nothing (on or off, training is the same). Under DDP each rank measures its own episodes
(at most ``max_episodes`` each) and every value is computed from the tallies summed over ranks
(:mod:`cope.callbacks.pooled`): a ratio of global sums, equal on every rank.
"""
from __future__ import annotations

import contextlib

import torch
from lightning.pytorch import Callback

from cope.algos.grpo import PolicyGradient, behaviour_weight
from cope.algos.stop_stats import TALLY, aggregation_weights, stop_metrics, stop_push
from cope.batch import collate
from cope.callbacks.pooled import log_global, pool
from cope.records import train_record, val_record
from cope.train.logprobs import causal_lm_logprobs
from cope.train.objectives import ROLLOUT, batch_kind


@contextlib.contextmanager
def _eval(pl_module):
    was = pl_module.model.training
    pl_module.model.eval()
    try:
        yield
    finally:
        pl_module.model.train(was)


def complete_positions(episodes, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows, cols) in a collate of ``episodes`` of the token right after each step's complete action (cols < length)."""
    rows, cols = [], []
    for r, e in enumerate(episodes):
        for s in e.steps:
            c = s.action_start + s.complete_len if s.complete_len is not None else -1
            if 1 <= c < min(len(e.tokens), length):
                rows.append(r)
                cols.append(c)
    return torch.tensor(rows, dtype=torch.long), torch.tensor(cols, dtype=torch.long)


class StopTokenStats(Callback):
    """Args:
        every_n_epochs: measure on epochs that are a multiple of this (0: off, no work).
        max_episodes: at most this many episodes measured per epoch and per validation run (bounds the cost).
    """

    def __init__(self, every_n_epochs: int = 1, max_episodes: int = 64):
        if every_n_epochs < 0 or max_episodes < 1:
            raise ValueError("callbacks.stop_token: every_n_epochs must be >= 0 (0: off) and max_episodes >= 1")
        self.every_n_epochs, self.max_episodes = int(every_n_epochs), int(max_episodes)

    @torch.no_grad()
    def _measure(self, pl_module, plain: dict, pos: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """(probability of each sampled token (N, T), probability of any end-of-turn id at ``pos`` (P,)) under the policy."""
        dev = {k: v.to(pl_module.device) for k, v in plain.items()}
        N, T = dev["input_ids"].shape
        sampled = torch.zeros(N, T, device=pl_module.device)
        p_stop = torch.zeros(pos[0].numel(), device=pl_module.device)
        stop_ids = torch.tensor(pl_module.policy.chat.stop_ids, device=pl_module.device)
        tau = pl_module.temperature if pl_module.temperature > 0 else 1.0
        for rows, n in pl_module.micro_batches(dev):
            r = torch.arange(N, device=pl_module.device) if rows is None else rows
            n = T if n is None else n
            inside = ((pos[0] >= int(r[0])) & (pos[0] <= int(r[-1])) & (pos[1] < n)).nonzero().squeeze(-1)
            at = torch.stack([pos[0][inside] - int(r[0]), pos[1][inside]], -1).to(pl_module.device)  # (P_live, 2)
            part = [dev[k][r, :n] for k in ("input_ids", "attention_mask", "position_ids", "action_mask")]
            with pl_module.precision_context():
                lp, _, z = causal_lm_logprobs(pl_module.model, *part[:3], tempered=part[3], temperature=tau, rows_at=at)
            sampled[r, :n] = lp.exp() * part[3]
            p_stop[inside.to(pl_module.device)] = torch.softmax(z / tau, -1)[:, stop_ids].sum(-1)
        return sampled, p_stop

    def rollout_tally(self, pl_module, record) -> dict[str, float]:
        """This process's tally (:data:`cope.algos.stop_stats.TALLY`) over the rollout minibatches of ``record``
        (an :class:`cope.records.EpochRecord`), under the policy as it is now; zeros without a policy-gradient objective."""
        tally = dict.fromkeys(TALLY, 0.0)
        pg = next((o for o in pl_module.objectives if isinstance(o, PolicyGradient)), None)
        if pg is None:
            return tally
        stop_ids = torch.tensor(pl_module.policy.chat.stop_ids)
        left = self.max_episodes
        with _eval(pl_module):
            for mb in record.minibatches:
                if batch_kind(mb) != ROLLOUT or left <= 0:
                    continue
                rows = [(r, e) for r, e in enumerate(mb["episode_index"].tolist()) if e >= 0][:left]
                left -= len(rows)
                eps = [record.episodes[e] for _, e in rows]
                plain = collate(eps, pl_module.policy.pad_id)  # the transcripts alone, columns as in the minibatch
                T = plain["input_ids"].shape[1]
                w = aggregation_weights(pg.agg, mb["action_mask"], pg.norm_len)[[r for r, _ in rows], :T]  # (n, T)
                pos = complete_positions(eps, T)
                sampled, p_stop = self._measure(pl_module, plain, pos)
                if "behaviour_logprobs" in mb:  # data.max_lag: the loss weighs each token by min(pi / pi_behaviour, cap)
                    bw, _ = behaviour_weight(sampled.cpu().clamp_min(1e-30).log(), mb["behaviour_logprobs"][[r for r, _ in rows], :T],
                                             plain["action_mask"].bool(), pg.behaviour_cap)
                    w = w * bw
                is_stop = torch.isin(plain["input_ids"], stop_ids)
                one = stop_push(plain["advantages"], w, plain["action_mask"], sampled.cpu(), is_stop, pos, p_stop.cpu())
                for k in TALLY:
                    tally[k] += one[k]
        return tally

    def panel_tally(self, pl_module, episodes) -> dict[str, float]:
        """The end-of-turn probability sums (``p_stop_sum``, ``positions``) over held-out ``episodes``."""
        tally = dict.fromkeys(TALLY, 0.0)
        eps = [e for e in episodes if not e.aborted][: self.max_episodes]
        if eps:
            plain = collate(eps, pl_module.policy.pad_id)
            pos = complete_positions(eps, plain["input_ids"].shape[1])
            with _eval(pl_module):
                p_stop = self._measure(pl_module, plain, pos)[1]
            tally["p_stop_sum"], tally["positions"] = float(p_stop.sum()), float(p_stop.numel())
        return tally

    def on_train_epoch_start(self, trainer, pl_module) -> None:
        if self.every_n_epochs < 1 or trainer.current_epoch % self.every_n_epochs:
            return
        record = train_record(trainer)
        tally = self.rollout_tally(pl_module, record) if record is not None else dict.fromkeys(TALLY, 0.0)
        log_global(pl_module, stop_metrics(pool(tally, trainer.strategy, pl_module.device)))

    def on_validation_epoch_end(self, trainer, pl_module) -> None:
        if trainer.sanity_checking or self.every_n_epochs < 1:
            return
        record = val_record(trainer)
        pooled = pool(self.panel_tally(pl_module, record.episodes if record is not None else []), trainer.strategy, pl_module.device)
        m = stop_metrics(pooled)
        log_global(pl_module, {"stop/prob_val": m["stop/prob"], "stop/positions_val": m["stop/positions"]})
