"""CoPE forecast targets as a callback: builds action-chunk targets for each minibatch.

Follows CoPE (arXiv 2610.20597): targets only from successful, non-aborted on-policy episodes;
see :mod:`cope.algos.cope.chunks` and :mod:`cope.algos.cope.packing` for the chunk definition and the two packings of a batch, and
:class:`cope.algos.cope.loss.ForecastLoss` for the loss that reads them.

The callback registers a collate transform on the datamodule (``add_collate_transform``), so the
targets exist before the scoring pass and the forecast segments are scored like everything else.
Per-epoch counts are accumulated in the transform and logged at ``on_train_epoch_end``
(``forecast/targets``, ``forecast/episodes``, ``forecast/ensemble_size``, ``forecast/masked_frac``).
If the datamodule ran collate transforms in worker processes, these counts would stay in the
workers; the targets themselves are unaffected.
"""
from __future__ import annotations

from collections import defaultdict

import torch
from lightning.pytorch import Callback

from cope.algos.cope.chunks import build_chunks, check_chunk_args
from cope.algos.cope.gate import check_gate
from cope.algos.cope.packing import PACKINGS
from cope.episode import Episode
from cope.train.dist import log_global, pool
from cope.train.seeding import stream

# Raw counts summed over the minibatches of an epoch; the logged means are derived from them.
INVALID = ("mask", "cut", "keep")
_SUMS = ("forecast/targets", "forecast/episodes", "forecast/supervised_actions", "forecast/supervisions",
         "forecast/action_tokens", "forecast/masked_tokens")


class ForecastTargets(Callback):
    """Adds CoPE forecast targets to every training minibatch.

    Args:
        K: actions per chunk (the paper advises 2 to 4); >= 1.
        invalid: what an invalid action does in a chunk: ``mask`` (it stays as input but gives no gradient), ``cut``
            (chunks stop before the first invalid action) or ``keep`` (trained like a valid one).
        packing: ``packed`` (segments after the transcript, each row a tree, ``packed``; cheaper) or ``plain`` (one
            extra row per chunk; the reference).
        anchors: ``all`` steps, or ``sample`` up to ``max_anchors_per_episode`` per episode.
        max_anchors_per_episode: sample size for ``anchors='sample'``.
        gate: which episodes give targets: ``wins``, ``all`` or ``mixed`` (:mod:`cope.algos.cope.gate`, the same rule
            as the authors' samples).
        success_threshold: a win's reward exceeds it (None: the env's success flag).
        seed: the run seed; the anchor sampler of each epoch is derived from it, the rank and the epoch
            (:mod:`cope.train.seeding`: distinct per rank, the same after a resume).
        mask_projected: actions the env read out of free text (``env.action_parsing=project``) are
            treated as invalid (as ``invalid`` says): forecasts learn the strict format.

    How the packed rows are attended (tree attention or their dense mask) and placed side by side is the run's
    ``data.share_prefix`` (the DataModule), not this callback's.
    """

    def __init__(
        self,
        K: int = 3,
        invalid: str = "mask",
        packing: str = "packed",
        anchors: str = "all",
        max_anchors_per_episode: int | None = None,
        gate: str = "wins",
        success_threshold: float | None = None,
        seed: int = 0,
        mask_projected: bool = True,
    ):
        if packing not in PACKINGS:
            raise ValueError(f"cope.packing must be one of {sorted(PACKINGS)}, got {packing!r}")
        if invalid not in INVALID:
            raise ValueError(f"cope.invalid must be one of {INVALID}, got {invalid!r}")
        check_chunk_args(K, anchors, max_anchors_per_episode)
        check_gate(gate)
        self.K, self.invalid, self.packing = int(K), invalid, packing
        self.anchors, self.max_anchors_per_episode = anchors, max_anchors_per_episode
        self.gate, self.success_threshold, self.mask_projected = gate, success_threshold, mask_projected
        self.seed = int(seed)
        self._rng, self._stream_of = stream(self.seed, "anchors", 0, 0), (0, 0)  # (rank, epoch) of the current stream
        self._rank = 0  # the trainer's global rank, set in setup
        self._datamodule = None
        self._chat, self._pad_id = None, 0  # the policy's, bound at setup
        self._sums: dict[str, float] = defaultdict(float)
        self._calls = 0

    def setup(self, trainer, pl_module, stage: str) -> None:
        dm = trainer.datamodule
        if dm is None or not hasattr(dm, "add_collate_transform"):
            raise TypeError("ForecastTargets needs a datamodule with add_collate_transform (cope.train.datamodule.RolloutDataModule)")
        self._chat, self._pad_id = pl_module.policy.chat, pl_module.policy.pad_id
        self._rank = trainer.global_rank
        if dm is self._datamodule:
            return  # already registered (setup runs once per stage)
        dm.add_collate_transform(self.transform)
        self._datamodule = dm

    def transform(self, batch: dict[str, torch.Tensor], episodes: list[Episode]) -> dict[str, torch.Tensor]:
        """The collate transform: chunks for this minibatch's episodes, laid out by ``packing``."""
        idx = [i for i in batch["episode_index"].tolist() if i >= 0]
        if self._datamodule is not None:  # the anchor stream of this rank in the epoch being collected
            key = (self._rank, self._datamodule.epoch)
            if key != self._stream_of:
                self._rng, self._stream_of = stream(self.seed, "anchors", *key), key
        chunks, metrics = build_chunks(
            [episodes[i] for i in idx],
            self._chat,
            K=self.K,
            mask_invalid=self.invalid == "mask",
            cut_at_invalid=self.invalid == "cut",
            anchors=self.anchors,
            max_anchors_per_episode=self.max_anchors_per_episode,
            gate=self.gate,
            success_threshold=self.success_threshold,
            rng=self._rng,
            indices=idx,
            mask_projected=self.mask_projected,
        )
        for k in _SUMS:
            self._sums[k] += metrics[k]
        self._calls += 1
        return PACKINGS[self.packing](batch, episodes, chunks, self._pad_id)

    def epoch_metrics(self, sums: dict[str, float] | None = None) -> dict[str, float]:
        """The per-epoch metrics of ``sums`` (default: this rank's accumulated so far; empty when no minibatch was
        built)."""
        s = {**self._sums, "calls": self._calls} if sums is None else sums
        if not s.get("calls"):
            return {}
        return {
            "forecast/targets": s["forecast/targets"],
            "forecast/episodes": s["forecast/episodes"],
            "forecast/ensemble_size": s["forecast/supervisions"] / max(s["forecast/supervised_actions"], 1.0),
            "forecast/masked_frac": s["forecast/masked_tokens"] / max(s["forecast/action_tokens"], 1.0),
        }

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        # the sums of every rank (each counts its own episodes), then the shares of those sums: global values
        tally = {k: float(self._sums[k]) for k in _SUMS} | {"calls": float(self._calls)}
        metrics = self.epoch_metrics(pool(tally, trainer.strategy, pl_module.device))
        if metrics:
            log_global(pl_module, metrics)
        self._sums.clear()
        self._calls = 0

