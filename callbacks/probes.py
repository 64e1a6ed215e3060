"""Held-out world-model and forecasting probes, computed after each validation run.

* ``probe/forecast_token_acc`` and ``probe/forecast_action_acc``: teacher-forced accuracy of
  forecasting the next K actions on the *successful* held-out episodes of the validation run (``sample``:
  ``prompted``, CoPE's sample as its authors built it, the default, in ``layout`` ``list`` or ``turns``;
  ``continuation``, the earlier reading):
  token-level argmax accuracy, and the share of chunk actions whose every token is predicted exactly.
  ``probe/forecast_chunks`` says how many chunks were probed
  (0 early on: the probe needs held-out successes); ``probe/forecast_tokens`` and
  ``probe/forecast_actions`` are the two accuracies' denominators.
* ``probe/obs_nll``: mean per-token negative log-likelihood of env-output tokens (role OBSERVATION)
  on the held-out transcripts (ECHO's "does the policy compress the environment" probe), over
  ``probe/obs_tokens`` tokens.

The probes read the greedy validation episodes (``datamodule.val_record``), so they add no
env steps; they cost one no-grad forward per probed sequence and never touch training.

Memory: sequences are scored in the module's micro-batches (``module.max_tokens_per_microbatch``) by
:func:`cope.train.logprobs.causal_lm_predictions` (output head in vocabulary-sized chunks of positions,
untempered): no (N, T, V) logits, whatever the vocabulary.

DDP: each rank probes its own share of the panel, so a rank may have no successful episode (no
chunk) or no episode at all. Every rank still logs the same keys: the per-rank sums and counts are
summed over ranks (:func:`cope.callbacks.pooled.pool`, one collective) and each mean is the pooled
sum / count (0 when the pooled count is 0; the count says so), not a mean of per-rank means (which would
weigh a rank with one episode like a rank with thirty). The pooled values are equal on every rank and are
logged as global (:func:`cope.callbacks.pooled.log_global`).
"""
from __future__ import annotations

import torch
from lightning.pytorch import Callback

from cope.algos.cope.chunks import build_chunks
from cope.algos.cope.packing import plain_forecasts
from cope.algos.cope.prompted import LAYOUTS, PlanPrompt, build_prompted
from cope.batch import collate
from cope.callbacks.pooled import log_global, pool
from cope.episode import Role
from cope.records import val_record
from cope.train.logprobs import causal_lm_predictions

# What a rank contributes; every logged value is one of these or a quotient of two of them.
TALLY = ("obs_nll_sum", "obs_tokens", "token_hits", "forecast_tokens", "action_hits", "forecast_actions", "forecast_chunks")


def probe_metrics(tally: dict[str, float]) -> dict[str, float]:
    """The logged ``probe/*`` values of a tally (one rank's, or the sum over ranks): always the same keys."""
    def mean(num: str, den: str) -> float:
        return tally[num] / tally[den] if tally[den] else 0.0

    return {
        "probe/forecast_chunks": float(tally["forecast_chunks"]),
        "probe/forecast_tokens": float(tally["forecast_tokens"]),
        "probe/forecast_actions": float(tally["forecast_actions"]),
        "probe/obs_tokens": float(tally["obs_tokens"]),
        "probe/obs_nll": mean("obs_nll_sum", "obs_tokens"),
        "probe/forecast_token_acc": mean("token_hits", "forecast_tokens"),
        "probe/forecast_action_acc": mean("action_hits", "forecast_actions"),
    }


class HeldOutProbes(Callback):
    """Args:
        K: forecast chunk length probed.
        max_episodes: cap on held-out episodes used per probe (bounds the cost).
        batch_size: episodes collated together (their forecast chunks become extra rows); each batch is
            scored in the module's micro-batches.
        sample: ``prompted`` (CoPE's sample as its authors built it) or ``continuation``.
        layout: the prompted sample's layout, ``list`` or ``turns`` (as ``cope.layout``; the config follows the
            run's ``cope.layout`` and is ``list`` without one).
        mask_projected: actions the env read out of free text (``env.action_parsing=project``) count as invalid,
            as in ``cope.mask_projected``. Set it false where the policy's answers are read by the projection
            (SmolLM2 on the maze: ``experiment=smollm2_maze``), or no chunk is ever probed.
    """

    def __init__(self, K: int = 3, max_episodes: int = 32, batch_size: int = 16, sample: str = "prompted",
                 layout: str = "list", mask_projected: bool = True):
        if K < 1 or max_episodes < 1 or batch_size < 1:
            raise ValueError("HeldOutProbes: K, max_episodes and batch_size must be >= 1")
        if sample not in ("prompted", "continuation"):
            raise ValueError(f"callbacks.probes.sample must be 'prompted' or 'continuation', got {sample!r}")
        self.K, self.max_episodes, self.batch_size, self.sample = K, max_episodes, batch_size, sample
        if layout not in LAYOUTS:
            raise ValueError(f"callbacks.probes.layout must be one of {LAYOUTS}, got {layout!r}")
        self.layout, self.mask_projected = layout, bool(mask_projected)
        self._plan = None

    @staticmethod
    def _score(pl_module, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """(log-probs, argmax predictions), both (N, T), of ``batch`` under ``pl_module.micro_batches``."""
        N, T = batch["input_ids"].shape
        lp = torch.zeros(N, T, device=batch["input_ids"].device)  # (N, T)
        pred = torch.full((N, T), -1, dtype=torch.long, device=batch["input_ids"].device)  # (N, T)
        for rows, n in pl_module.micro_batches(batch):
            r = slice(None) if rows is None else rows
            c = slice(None) if n is None else slice(0, n)  # right padding past the rows' longest is cut
            part = [batch[k][r, c] for k in ("input_ids", "attention_mask", "position_ids")]
            lp[r, c], pred[r, c] = causal_lm_predictions(pl_module.model, *part)
        return lp, pred

    @torch.no_grad()
    def tally(self, pl_module, episodes, chat, pad_id: int) -> dict[str, float]:
        """This process's sums and counts (see ``TALLY``) over its held-out ``episodes``."""
        out = dict.fromkeys(TALLY, 0.0)
        eps = [e for e in episodes if not e.aborted][: self.max_episodes]
        if not eps:
            return out
        model = pl_module.model
        was = model.training
        model.eval()
        try:
            for s in range(0, len(eps), self.batch_size):
                part = eps[s: s + self.batch_size]
                batch = collate(part, pad_id)
                chunks = self._chunks(pl_module, part, chat)
                out["forecast_chunks"] += len(chunks)
                if chunks:
                    batch = plain_forecasts(batch, part, chunks, pad_id)
                dev = {k: v.to(pl_module.device) for k, v in batch.items()}
                lp, pred = self._score(pl_module, dev)  # (N, T) each: token t's log-prob and argmax prediction
                obs = dev["roles"] == int(Role.OBSERVATION)  # (N, T)
                out["obs_nll_sum"] += float(-(lp * obs).sum())
                out["obs_tokens"] += int(obs.sum())
                if not chunks:
                    continue
                hit = pred == dev["input_ids"]  # (N, T)
                out["token_hits"] += int((hit & dev["forecast_mask"]).sum())
                out["forecast_tokens"] += int(dev["forecast_mask"].sum())
                for cid, ch in enumerate(chunks):  # exact match per forecast action
                    sel = dev["forecast_chunk"] == cid  # (N, T)
                    row = int(sel.any(-1).nonzero()[0])
                    cols = sel[row].nonzero().flatten()
                    for j in sorted({a for a, t in zip(ch.action_index, ch.target) if a >= 0 and t}):
                        toks = cols[torch.tensor([a == j for a in ch.action_index], device=cols.device)]
                        out["forecast_actions"] += 1
                        out["action_hits"] += int(bool(hit[row, toks].all()))
        finally:
            model.train(was)
        return out

    def _chunks(self, pl_module, episodes, chat) -> list:
        if self.sample == "continuation":
            return build_chunks(episodes, chat, K=self.K, mask_invalid=True, mask_projected=self.mask_projected)[0]
        if self._plan is None:
            self._plan = PlanPrompt(pl_module.policy.tokenizer, self.layout)
        return build_prompted(episodes, chat, self._plan, K=self.K, mask_projected=self.mask_projected,
                              group_weights=False)[0]  # wins, invalid skipped

    def probe(self, pl_module, episodes, chat, pad_id: int) -> dict[str, float]:
        """The ``probe/*`` metrics of ``episodes`` in this process alone (no reduction over ranks)."""
        return probe_metrics(self.tally(pl_module, episodes, chat, pad_id))

    def on_validation_epoch_end(self, trainer, pl_module) -> None:
        if trainer.sanity_checking:
            return
        record = val_record(trainer)
        episodes = record.episodes if record is not None else []  # every rank joins the reduction
        local = self.tally(pl_module, episodes, pl_module.policy.chat, pl_module.policy.pad_id)
        log_global(pl_module, probe_metrics(pool(local, trainer.strategy, pl_module.device)))
