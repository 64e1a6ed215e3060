"""Held-out world-model and forecasting probes, computed after each validation run.

* ``probe/forecast_token_acc`` and ``probe/forecast_action_acc``: teacher-forced accuracy of
  forecasting the next K actions (CoPE's chunks, plain layout) on the *successful* held-out
  episodes of the validation run: token-level argmax accuracy, and the share of chunk actions whose
  every token is predicted exactly. ``probe/forecast_chunks`` says how many chunks were probed
  (0 early on: the probe needs held-out successes).
* ``probe/obs_nll``: mean per-token negative log-likelihood of env-output tokens (role OBSERVATION)
  on the held-out transcripts (ECHO's "does the policy compress the environment" probe).

The probes read the greedy validation episodes (``datamodule.val_record``), so they add no
env steps; they cost one no-grad forward per probed sequence and never touch training.
"""
from __future__ import annotations

import torch
from lightning.pytorch import Callback

from cope.algos.cope.targets import build_chunks, plain_forecasts
from cope.episode import Role
from cope.records import val_record
from cope.train.batch import collate
from cope.train.logprobs import token_logprobs


class HeldOutProbes(Callback):
    """Args:
        K: forecast chunk length probed.
        max_episodes: cap on held-out episodes used per probe (bounds the cost).
        batch_size: sequences per forward.
    """

    def __init__(self, K: int = 3, max_episodes: int = 32, batch_size: int = 16):
        if K < 1 or max_episodes < 1 or batch_size < 1:
            raise ValueError("HeldOutProbes: K, max_episodes and batch_size must be >= 1")
        self.K, self.max_episodes, self.batch_size = K, max_episodes, batch_size

    @torch.no_grad()
    def probe(self, pl_module, episodes, chat, pad_id: int) -> dict[str, float]:
        eps = [e for e in episodes if not e.aborted][: self.max_episodes]
        if not eps:
            return {}
        model = pl_module.model
        was = model.training
        model.eval()
        correct = total = act_ok = act_n = 0
        nll_sum, nll_n, n_chunks = 0.0, 0, 0
        try:
            for s in range(0, len(eps), self.batch_size):
                part = eps[s: s + self.batch_size]
                batch = collate(part, pad_id)
                chunks, _ = build_chunks(part, chat, K=self.K, mask_invalid=True)
                n_chunks += len(chunks)
                if chunks:
                    batch = plain_forecasts(batch, part, chunks, pad_id)
                dev = {k: v.to(pl_module.device) for k, v in batch.items()}
                logits = model(input_ids=dev["input_ids"], attention_mask=dev["attention_mask"],
                               position_ids=dev["position_ids"], use_cache=False).logits  # (N, T, V)
                lp, _ = token_logprobs(logits, dev["input_ids"], with_entropy=False)  # (N, T)
                obs = dev["roles"] == int(Role.OBSERVATION)  # (N, T)
                nll_sum += float(-(lp * obs).sum())
                nll_n += int(obs.sum())
                if chunks:
                    pred = torch.zeros_like(dev["input_ids"])  # (N, T): argmax prediction of token t
                    pred[:, 1:] = logits[:, :-1].argmax(-1)
                    hit = (pred == dev["input_ids"]) & dev["forecast_mask"]  # (N, T)
                    correct += int(hit.sum())
                    total += int(dev["forecast_mask"].sum())
                    for cid, ch in enumerate(chunks):  # exact match per forecast action
                        sel = dev["forecast_chunk"] == cid  # (N, T)
                        row = int(sel.any(-1).nonzero()[0])
                        cols = sel[row].nonzero().flatten()
                        for j in sorted({a for a, t in zip(ch.action_index, ch.target) if a >= 0 and t}):
                            toks = cols[torch.tensor([a == j for a in ch.action_index], device=cols.device)]
                            act_n += 1
                            act_ok += int(bool((pred[row, toks] == dev["input_ids"][row, toks]).all()))
        finally:
            model.train(was)
        out = {"probe/forecast_chunks": float(n_chunks)}
        if nll_n:
            out["probe/obs_nll"] = nll_sum / nll_n
        if total:
            out["probe/forecast_token_acc"] = correct / total
            out["probe/forecast_action_acc"] = act_ok / max(act_n, 1)
        return out

    def on_validation_epoch_end(self, trainer, pl_module) -> None:
        if trainer.sanity_checking:
            return
        record = val_record(trainer)
        if record is None:
            return
        m = self.probe(pl_module, record.episodes, pl_module.policy.chat, pl_module.policy.pad_id)
        if m:
            pl_module.log_dict(m, on_step=False, on_epoch=True, sync_dist=True)
