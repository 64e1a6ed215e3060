"""The callback that puts CoPE's forecast samples, as its authors built them, into training (``algo=cope``).

Each epoch, from the episodes the DataModule collected, :func:`cope.algos.cope.prompted.build_prompted` makes the
prompted forecast samples (gate, look-past of invalid actions, group weights); then, by ``update``:

* ``separate`` (the authors'): the samples become batches of kind ``forecast``
  (:func:`cope.algos.cope.packing.collate_chunks`, ``minibatch_size`` samples each) that the DataModule serves after
  the epoch's policy-gradient minibatches, one optimizer step each on the same optimizer (the module computes only
  the ``forecast`` objective on them, learning rate times its ``lr_scale``). After the policy steps of the epoch,
  not of each minibatch: the authors' trainer runs its forecast pass after the policy update of a training step,
  and a training step there is one rollout batch, an epoch here. Under DDP the ranks' batch counts are evened out
  with empty batches (:class:`cope.train.collect.experience.BatchSource`). With ``share_prefix`` (``${data.share_prefix}``)
  the samples of one episode in a step are branches of one row over its transcript, forwarded once
  (:func:`cope.algos.cope.shared_prefix.collate_shared`); without it, one row per sample (the reference).
  Same samples, same order, same loss.
* ``joint``: a collate transform lays the samples of each minibatch's episodes into it (``packing``: ``packed``
  segments after their transcript, attending to it up to obs_t and to themselves, or ``plain`` rows, the
  reference), and the ``forecast`` objective is summed into the policy-gradient loss. The packed rows are trees
  (``packed``); with ``data.share_prefix`` the DataModule places them side by side and the model attends them with
  tree attention (only the cells a query sees); without it, through the trees' dense mask (the reference). Same loss.

The model's attention is switched in one place, the DataModule (``data.share_prefix``), not here.

With ``te_weight > 0`` it also gives the temporal-ensemble objective its targets: after the module's scoring pass
the epoch's samples are scored for the members of every transcript action (:mod:`cope.algos.cope.te_loss`).

The samples of an epoch are built once (the group weights are normalized over all of them) and the epoch's
``forecast/*`` (and ``te/*``) metrics are logged when its training starts.
"""
from __future__ import annotations

import functools
import logging

from lightning.pytorch import Callback

from cope.algos.cope.packing import PACKINGS, collate_chunks
from cope.algos.cope.prompted import PlanPrompt, build_prompted, check_prompted_args
from cope.algos.cope.shared_prefix import collate_shared
from cope.algos.cope.te_loss import ensemble_transform
from cope.episode import Episode

UPDATES = ("separate", "joint")
log = logging.getLogger(__name__)


class CopeForecasts(Callback):
    """CoPE's prompted forecast samples, trained by a separate optimizer step or in the same forward.

    Args:
        K: actions per sample (a_t .. a_{t+k-1}, k = min(K, actions left)).
        layout: ``list`` (one assistant turn listing the actions) or ``turns`` (one turn per action: tau2).
        prompt: the plan-ahead user text with ``{k}`` (None: the authors' text of ``layout``).
        invalid: ``skip`` (look past invalid actions), ``mask`` (keep, no loss) or ``cut`` (end the list).
        mask_projected: actions the env read out of free text count as invalid here.
        gate: ``wins``, ``all`` or ``mixed`` (wins of groups that also lost): :mod:`cope.algos.cope.gate`, one rule
            with the continuation targets.
        success_threshold: a win's reward exceeds it (None: the env's success flag).
        group_weights: weight each sample 1/m_g (kept trajectories of its group), renormalized to mean 1.
        update: ``separate`` (the authors') or ``joint`` (must match the ``forecast`` objective's ``update``).
        packing: ``joint`` only: ``packed`` (segments in the transcript's row) or ``plain`` (a row per sample).
        minibatch_size: ``separate`` only: samples per optimizer step.
        share_prefix: ``separate``: a step's samples of one episode share one row, the transcript forwarded once (and
            so do the temporal ensemble's scoring forwards); ``${data.share_prefix}``, the run's one switch, which
            also turns the model's tree attention on. False: one row per sample, the reference.
        max_context: samples longer than this are dropped and counted (None: no limit).
        te_weight: lambda_TE of the temporal-ensemble objective (``algo.objectives.te``); > 0 makes this callback
            score the members each epoch.
        te_top_m: the vocabulary entries each member token keeps.
    """

    def __init__(self, K: int = 3, layout: str = "list", prompt: str | None = None, invalid: str = "skip",
                 mask_projected: bool = True, gate: str = "wins", success_threshold: float | None = 0.5,
                 group_weights: bool = True, update: str = "separate", packing: str = "packed",
                 minibatch_size: int = 16, share_prefix: bool = False, max_context: int | None = None, te_weight: float = 0.0,
                 te_top_m: int = 64):
        check_prompted_args(K, invalid, gate)
        if update not in UPDATES:
            raise ValueError(f"cope.update must be one of {UPDATES}, got {update!r}")
        if packing not in PACKINGS:
            raise ValueError(f"cope.packing must be one of {sorted(PACKINGS)}, got {packing!r}")
        if minibatch_size < 1:
            raise ValueError(f"cope.minibatch_size must be >= 1, got {minibatch_size}")
        self.K, self.layout, self.prompt, self.invalid = int(K), layout, prompt, invalid
        self.mask_projected, self.gate, self.success_threshold = mask_projected, gate, (
            None if success_threshold is None else float(success_threshold))
        self.group_weights, self.update, self.packing = group_weights, update, packing
        self.minibatch_size, self.max_context = int(minibatch_size), max_context
        self.share_prefix = bool(share_prefix)
        if te_top_m < 1:
            raise ValueError(f"cope.te.top_m must be >= 1, got {te_top_m}")
        self.te_weight, self.te_top_m = float(te_weight), int(te_top_m)
        self._te_metrics: dict[str, float] = {}
        self._plan: PlanPrompt | None = None
        self._chat, self._pad_id, self._datamodule, self._row_tokens = None, 0, None, None
        self._built: tuple[list, list, dict] | None = None  # (the epoch's episode list, its chunks, their metrics)
        self._warned_projected = False  # warned once: projected actions masked left an epoch without a sample

    def setup(self, trainer, pl_module, stage: str) -> None:
        dm = trainer.datamodule
        if dm is None or not hasattr(dm, "add_batch_source"):
            raise TypeError("CopeForecasts needs the RolloutDataModule (cope.train.datamodule), which serves its batches")
        fc = [o for o in pl_module.objectives if o.name == "forecast"]
        if len(fc) != 1 or getattr(fc[0], "update", None) != self.update:
            raise ValueError(f"cope.update={self.update!r} needs one algo.objectives.forecast with update={self.update!r}, "
                             f"got {[getattr(o, 'update', None) for o in fc]}")
        policy = pl_module.policy
        self._chat, self._pad_id = policy.chat, policy.pad_id
        self._row_tokens = pl_module.max_tokens_per_microbatch  # shared rows never exceed a micro-batch
        self._plan = PlanPrompt(policy.tokenizer, self.layout, self.prompt)
        if dm is self._datamodule:
            return  # registered already (setup runs once per stage)
        if self.update == "separate":
            dm.add_batch_source(self)
        else:
            dm.add_collate_transform(self.transform)
        if self.te_weight > 0:
            context = pl_module.trainer.precision_plugin.train_step_context  # the training forward's numerics
            pl_module.add_scored_transform(ensemble_transform(lambda: pl_module.model, lambda eps: self.samples(eps)[0],
                                                              context, self.te_top_m, self.minibatch_size, self._te_metrics,
                                                              share_prefix=self.share_prefix))
        self._datamodule = dm

    def samples(self, episodes: list[Episode]) -> tuple[list, dict[str, float]]:
        """The epoch's forecast samples (built once per epoch) and their metrics."""
        if self._built is None or self._built[0] is not episodes:  # the list object, not its id (ids are reused)
            chunks, metrics = build_prompted(
                episodes, self._chat, self._plan, K=self.K, invalid=self.invalid, mask_projected=self.mask_projected,
                gate=self.gate, success_threshold=self.success_threshold, group_weights=self.group_weights,
                max_context=self.max_context)
            self._built = (episodes, chunks, metrics)
            if not chunks and metrics["forecast/projected_masked"] and not self._warned_projected:
                self._warned_projected = True
                log.warning("CoPE built no forecast sample this epoch: %d actions of the kept episodes (cope.gate) were read out of "
                            "free text (env.action_parsing=project) and cope.mask_projected=true counts them as invalid. "
                            "Where the policy's answers are read by the projection (SmolLM2 on the maze), set "
                            "cope.mask_projected=false, or the run is GRPO (forecast/projected_masked counts them)",
                            int(metrics["forecast/projected_masked"]))
        return self._built[1], self._built[2]

    # -- separate: a batch source --------------------------------------------------------------
    def batches(self, episodes: list[Episode]) -> list[dict]:
        chunks, _ = self.samples(episodes)
        collate = functools.partial(collate_shared, max_row_tokens=self._row_tokens) if self.share_prefix else collate_chunks
        return [collate(episodes, chunks[s: s + self.minibatch_size], self._pad_id)
                for s in range(0, len(chunks), self.minibatch_size)]

    def empty(self) -> dict:
        return collate_chunks([], [], self._pad_id)

    # -- joint: a collate transform ------------------------------------------------------------
    def transform(self, batch: dict, episodes: list[Episode]) -> dict:
        chunks, _ = self.samples(episodes)
        return PACKINGS[self.packing](batch, episodes, chunks, self._pad_id)

    def on_train_epoch_start(self, trainer, pl_module) -> None:
        if self._built is not None:
            pl_module.log_dict(self._built[2], on_step=False, on_epoch=True, batch_size=1, sync_dist=True)

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        if self._te_metrics:  # counted by the scored transform at the epoch's start (after this callback's hook)
            pl_module.log_dict(dict(self._te_metrics), on_step=False, on_epoch=True, batch_size=1, sync_dist=True)
