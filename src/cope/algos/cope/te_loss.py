"""CoPE's temporal-ensemble term as an objective, and the scored transform that gives it its targets.

``L = L_GRPO + lambda_TE x KL(pi_theta(. | h_t) || q_t)`` at the transcript's action tokens (the math and where we
differ: :mod:`cope.algos.cope.temporal_ensemble`). The targets q^F come from the epoch's forecast samples, scored
by the policy as it is at the epoch's start, with no gradient (:func:`ensemble_transform`, run by the module after
its scoring pass, before any update); the KL reads the policy's full predictive rows at the covered tokens, which the
objective declares (``Needs(rows_at=("te_position",))``) and the module's forward forms for those positions only
(``ForwardOut.rows["te_position"]``). Off by default (``cope.te.weight=0``);
``warmup_steps`` optimizer steps at weight 0 first, as in the authors' code.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from cope.algos.cope.chunks import ForecastChunk
from cope.algos.cope.shared_prefix import collate_shared
from cope.algos.cope.temporal_ensemble import (
    TOPM,
    action_spans,
    ensemble_targets,
    forecast_batch,
    member_positions,
    te_kl,
    topm_at_positions,
)
from cope.episode import Episode
from cope.train.objectives import ForwardOut, Metrics, Needs, Objective

TE_POSITION = "te_position"  # (P, 2) [row, column] of the covered tokens: where the objective needs predictive rows
TE_KEYS = (TE_POSITION, "te_ids", "te_probs")


class TemporalEnsembleLoss(Objective):
    """``lambda_TE x`` the mean full-vocabulary KL to q_t over the covered action tokens of the batch.

    Args:
        weight: lambda_TE (0: off).
        eta: the members' share of q_t, in [0, 1).
        warmup_steps: optimizer steps at weight 0 before ``weight`` applies.
    """

    name = "te"
    needs = Needs(rows_at=(TE_POSITION,))

    def __init__(self, weight: float = 0.0, eta: float = 0.5, warmup_steps: int = 50):
        if not 0.0 <= eta < 1.0:
            raise ValueError(f"cope.te.eta must be in [0, 1), got {eta}")
        if warmup_steps < 0:
            raise ValueError(f"cope.te.warmup_steps must be >= 0, got {warmup_steps}")
        warm = warmup_steps > 0 and weight > 0
        super().__init__(weight=0.0 if warm else weight, schedule="cutoff" if warm else "constant",
                         final_weight=weight if warm else 0.0, schedule_steps=warmup_steps if warm else 0)
        self.eta = float(eta)

    def __call__(self, out: ForwardOut, batch: dict) -> tuple[torch.Tensor, Metrics]:
        rows = out.rows.get(TE_POSITION)  # (P, V) untempered logits at the covered tokens
        if rows is None or "te_ids" not in batch or batch["te_ids"].shape[0] == 0:
            zero = out.logprobs.flatten()[:0].sum()  # exactly 0, attached
            return zero, {"te/kl": zero.detach(), "te/positions": 0.0, "te/eta": self.eta, "te/member_share": 0.0}
        dev = rows.device
        return te_kl(rows, batch["te_ids"].to(dev), batch["te_probs"].to(dev), self.eta)


def ensemble_transform(model_of: Callable[[], torch.nn.Module], samples: Callable[[list[Episode]], Sequence[ForecastChunk]],
                       context: Callable[[], object], top_m: int = TOPM, rows_per_forward: int = 16,
                       metrics_out: dict | None = None, share_prefix: bool = False) -> Callable[[list[dict], list[Episode]], None]:
    """A scored transform (``module.add_scored_transform``) that adds ``te_position`` (P, 2) [row, column],
    ``te_ids`` (P, M) and ``te_probs`` (P, M) to every minibatch: q^F of its rows' covered action tokens.

    ``model_of()`` gives the policy to score the members with (no grad, eval mode, under ``context()``: the
    training precision), ``samples(episodes)`` the epoch's forecast samples; the members are scored
    ``rows_per_forward`` samples at a time, one row per sample, or with ``share_prefix`` each episode's samples as
    branches of one tree over its transcript (:func:`cope.algos.cope.shared_prefix.collate_shared`): the same
    distributions, each history forwarded once. ``metrics_out`` receives the ``te/*`` counts of the epoch."""

    @torch.no_grad()
    def transform(minibatches: list[dict], episodes: list[Episode]) -> None:
        chunks = list(samples(episodes))
        members = member_positions(chunks)
        model = model_of()
        dev = next(model.parameters()).device
        ids = torch.full((len(members), top_m), -1, dtype=torch.long)
        probs = torch.zeros(len(members), top_m)
        was = model.training
        model.eval()
        try:
            for s in range(0, len(chunks), rows_per_forward):
                sel = ((members.chunk >= s) & (members.chunk < s + rows_per_forward)).nonzero().squeeze(-1)
                if sel.numel() == 0:
                    continue
                part, local = chunks[s: s + rows_per_forward], members.chunk[sel] - s
                layout, rows, cols = None, local, members.position[sel]
                if share_prefix:  # a member at column q of its sample's row sits (q - anchor) after its branch's first token
                    batch = collate_shared(episodes, part, 0)
                    inp, att, pos, layout = batch["input_ids"], batch["attention_mask"], batch["position_ids"], batch["packed"].tree
                    at = torch.stack([(batch["forecast_chunk"] == c).float().flatten().argmax() for c in range(len(part))])
                    width = inp.shape[1]
                    anchor = torch.tensor([c.anchor for c in part])
                    rows, cols = at[local] // width, at[local] % width + cols - anchor[local]
                else:
                    inp, att, pos = forecast_batch(part, [e.tokens for e in episodes])
                inp, att, pos = inp.to(dev), att.to(dev), pos.to(dev)
                with context():
                    i, p = topm_at_positions(model, inp, att, pos, rows.to(dev), cols.to(dev), M=top_m, tree=layout)
                ids[sel], probs[sel] = i.cpu(), p.float().cpu()
        finally:
            model.train(was)
        targets, m = ensemble_targets(members, ids, probs, action_spans(episodes), M=top_m,
                                      episode_tokens=[e.tokens for e in episodes])
        if metrics_out is not None:
            metrics_out.clear()
            metrics_out.update({k: float(v) for k, v in m.items()})
        for mb in minibatches:
            row_of = {int(e): r for r, e in enumerate(mb["episode_index"].tolist()) if e >= 0 and not bool(mb["aux_row"][r])}
            keep = [i for i, e in enumerate(targets.episode.tolist()) if e in row_of]
            idx = torch.tensor(keep, dtype=torch.long)
            rows = torch.tensor([row_of[int(targets.episode[i])] for i in keep], dtype=torch.long)
            mb[TE_POSITION] = torch.stack([rows, targets.position[idx]], 1) if keep else torch.zeros(0, 2, dtype=torch.long)
            mb["te_ids"], mb["te_probs"] = targets.ids[idx], targets.probs[idx]

    return transform
