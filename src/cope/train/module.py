"""The LightningModule: the training *system* around an injected policy (Lightning's "systems vs models").

It holds no rollout logic (the DataModule does) and no loss math (the objectives do). The forward
pass gives every objective the per-token log-probs and entropy (:mod:`cope.train.logprobs`: chunked over
the vocabulary, action tokens at the sampling temperature), plus what the run's objectives declare
(:class:`cope.train.objectives.Needs`: reference log-probs, full predictive rows at the positions a batch key lists),
filled without knowing which objective asked; the objectives are summed in :func:`cope.train.objectives.combine`.
The reference is :meth:`cope.models.policy.Policy.reference` (the adapter-disabled model under LoRA, a frozen copy
under full fine-tuning).

One optimizer step per batch, written out here (Lightning's manual optimization): zero the gradients,
forward + backward over micro-batches of at most ``max_tokens_per_microbatch`` tokens (rows of the
batch; :mod:`cope.train.step.backward`, exact), clip, skip a non-finite step (:mod:`cope.train.step.guard`) or one
outside the epoch's trust region (:mod:`cope.train.step.trust_region`), step the optimizer and the scheduler. The epoch's
old and reference log-probs come from one scoring pass before its first step (:mod:`cope.train.step.scoring`).
A batch is a rollout minibatch, or a batch source's own batch of another kind (e.g. CoPE's separate update: only
the objectives of that kind, the learning rate times their ``lr_scale``, the schedule not advanced, its metrics under
the prefix they declare). Every batch runs through one path: the model forwards its packed rows (shared prefixes
stored once, :mod:`cope.train.packing.tree_batch`; a batch that packs nothing is its own packing) and the log-probs
come back in the batch rows' shape. Step metrics go straight to the loggers. Checkpoints hold only trainable weights
and the run's counters (:mod:`cope.train.module_checkpoint`).
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, Callable

import lightning.pytorch as pl
import torch
from lightning.pytorch.trainer.states import TrainerFn

from cope.models.policy import Policy
from cope.train.collect.sync import training_precision
from cope.train.dist import log_now, log_rollout_metrics, log_val_metrics
from cope.train.fsdp.sharding import configure_sharding, step_weights, total_grad_norm
from cope.train.logprobs import sampler_gap
from cope.train.module_checkpoint import load_state, save_state
from cope.train.objectives import ROLLOUT, ForwardOut, Needs, Objective, TokenScores, batch_kind, check_objectives, step_prefix
from cope.train.packing.tree_batch import packed_logprobs, packed_view
from cope.train.seeding import seed_globals
from cope.train.step.backward import backward_microbatched
from cope.train.step.guard import StepGuard, lr_scaled
from cope.train.step.scoring import score_minibatches
from cope.train.step.trust_region import TrustRegion, kl_stop

ScoredTransform = Callable[[list[dict], list], None]


class AgentRLModule(pl.LightningModule):
    """GRPO-family training of a LoRA policy on on-policy rollouts.

    Args:
        policy: the LoRA-wrapped causal LM, tokenizer and chat scaffold (built by a factory).
        objectives: the named, weighted loss terms (``algo.objectives``).
        optimizer: partial optimizer, finished over the trainable (LoRA) parameters.
        scheduler: optional partial LR scheduler, stepped every optimizer step.
        temperature: the rollouts' sampling temperature (``${data.sampling.temperature}``): action
            tokens are scored under ``softmax(logits / temperature)``, the distribution they were drawn from.
        gradient_clip_val: clip the global gradient norm to this before each step (None: no clipping).
        max_tokens_per_microbatch: forward/backward at most this many tokens (rows x padded length)
            at once, accumulating into one optimizer step (None: the whole minibatch in one forward).
            The scoring pass uses the same budget.
        max_nonfinite_steps: an optimizer step whose gradient norm is not finite is skipped (gradients dropped,
            no optimizer or scheduler step; counted in ``train/skipped_steps``); this many in a row stop the run.
        skip_zero_grad_steps: an optimizer step whose gradient is exactly zero is not taken either (no AdamW momentum
            step on a batch without signal; :mod:`cope.train.step.guard`); counted in ``train/zero_grad_steps``.
        max_approx_kl: the epoch's trust region (:mod:`cope.train.step.trust_region`): once a rollout minibatch's
            ``policy/approx_kl`` exceeds this, that policy step and the epoch's later ones are not taken (steps on
            batches of another kind still run). ``train/kl_stopped`` marks the dropped steps,
            ``train/kl_stopped_steps`` counts them over the run (None: no limit).
        seed: the run seed; at the start of every training epoch the process-global generators (dropout)
            are seeded from it, the rank and the epoch (:func:`cope.train.seeding.seed_globals`), so ranks
            differ and a resumed run draws what the uninterrupted one drew.
    """

    def __init__(self, policy: Policy, objectives: list[Objective], optimizer: Callable[..., torch.optim.Optimizer],
                 scheduler: Callable[..., Any] | None = None, temperature: float = 1.0,
                 gradient_clip_val: float | None = 1.0, max_tokens_per_microbatch: int | None = None,
                 max_nonfinite_steps: int = 3, skip_zero_grad_steps: bool = False,
                 max_approx_kl: float | None = None, seed: int = 0):
        super().__init__()
        if temperature < 0:
            raise ValueError(f"module.temperature must be >= 0, got {temperature}")
        if gradient_clip_val is not None and gradient_clip_val <= 0:
            raise ValueError(f"module.gradient_clip_val must be null or > 0, got {gradient_clip_val}")
        if max_tokens_per_microbatch is not None and max_tokens_per_microbatch < 1:
            raise ValueError(f"module.max_tokens_per_microbatch must be null or >= 1, got {max_tokens_per_microbatch}")
        self.automatic_optimization = False  # the step is written out in training_step (micro-batches)
        self.temperature, self.gradient_clip_val = float(temperature), gradient_clip_val
        self.max_tokens_per_microbatch, self.seed = max_tokens_per_microbatch, int(seed)
        self.step_guard = StepGuard(max_nonfinite_steps, skip_zero_grad_steps)  # drops non-finite (and zero) steps
        self.trust_region = TrustRegion(max_approx_kl)  # drops an epoch's policy steps past max_approx_kl
        check_objectives(objectives)
        self.policy = policy
        self.model = policy.model  # registered so Lightning moves it and the strategy wraps it
        self.objectives = objectives
        self.optimizer_factory, self.scheduler_factory = optimizer, scheduler
        self.strict_loading = False  # checkpoints carry adapter weights only
        self.last_validation: dict[str, float] = {}  # val/* of the newest validation, with val/epoch
        self._scored_transforms: list[ScoredTransform] = []
        self._whole = None  # trainer=fsdp: the policy's WholeWeights switch (cope.train.fsdp.sharding)

    @property
    def needs(self) -> Needs:
        """What the forward gives the objectives beyond log-probs and entropy (:meth:`~cope.train.objectives.Needs.of`)."""
        return Needs.of(self.objectives)

    @property
    def needs_ref(self) -> bool:
        return self.needs.ref_logprobs

    def logprobs(self, batch: dict, rows: torch.Tensor | None = None, length: int | None = None,
                 entropy: bool = True, model=None, rows_at: Sequence[str] = ()) -> TokenScores:
        """Per-token log-probs and entropy of ``batch`` rows ``rows`` (all: None), first ``length`` columns; action
        tokens at the sampling temperature, entropy at action tokens only (see :mod:`cope.train.logprobs`). For each
        key of ``rows_at`` the batch has, also the full predictive rows at its listed positions that fall in this part,
        from the same forward. The model sees the batch's packed rows (:func:`cope.train.packing.tree_batch.packed_view`:
        its own rows when it packs nothing); the results have the batch rows' shape. ``model``: another model to score
        with (the reference), else the policy's."""
        at = {k: batch[k].to(batch["input_ids"].device) for k in rows_at if k in batch}  # key -> (P, 2) [row, column]
        model = model if model is not None else self.model
        return packed_logprobs(model, packed_view(batch), rows, length, at, self.temperature, entropy)

    def micro_batches(self, batch: dict) -> list[tuple[torch.Tensor | None, int | None]]:
        """(rows, length) of each micro-batch under ``max_tokens_per_microbatch``: whole consecutive packed rows (a
        batch's own rows when it packs nothing) whose count times their longest real length fits the budget (one row
        at least); [(None, None)]: all at once."""
        return packed_view(batch).micro_batches(self.max_tokens_per_microbatch)

    def forward(self, batch: dict) -> ForwardOut:
        """Every row of ``batch`` at once, with what the objectives declared (:attr:`needs`)."""
        needs = self.needs
        scores = self.logprobs(batch, rows_at=needs.rows_at)
        ref = batch.get("ref_logprobs") if needs.ref_logprobs else None
        return ForwardOut(logprobs=scores.logprobs, entropy=scores.entropy, ref_logprobs=ref, rows=scores.rows)

    def precision_context(self):
        """The precision plugin's training context (e.g. bf16 autocast under ``bf16-mixed``): Lightning applies it
        to ``training_step`` only; the scoring pass must compute under the same numerics, or the first PPO ratio
        of an update is not 1 (the rollouts sample under it too). A no-op without a trainer (tests drive the module
        directly)."""
        return training_precision(self._trainer)

    def score_minibatches(self, minibatches: list[dict]) -> None:
        """Fill ``old_logprobs``, ``old_entropy`` (and ``ref_logprobs``) of each minibatch before any update, as the
        training forward computes them (:mod:`cope.train.step.scoring`)."""
        score_minibatches(self, minibatches)

    def configure_model(self) -> None:
        """Full fine-tuning with a KL term: the frozen reference copy, taken before any update or checkpoint load.
        ``trainer=fsdp``: the policy's (and that copy's) layers in FSDP2 groups (:mod:`cope.train.fsdp.sharding`)."""
        if self.needs_ref:
            self.policy.freeze_reference()
        self._whole = configure_sharding(self)

    # -- training --------------------------------------------------------------------------------
    def on_validation_start(self) -> None:
        if self._whole is not None:
            self._whole.gather()

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        if self._whole is not None:
            self._whole.shard()

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self._whole is not None:
            self._whole.gather()

    def on_train_start(self) -> None:
        if self._whole is not None:  # sharded only inside optimizer steps (cope.train.fsdp.sharding: "Which phase"); after
            self._whole.gather()     # a resume's checkpoint is loaded into the shards
        # rows an earlier process logged for the epoch this fit starts at (or later) are gone from the
        # run's history: that epoch is run again (a resume after a crash) or the folder is reused
        for lg in self.trainer.loggers:
            if hasattr(lg, "rewind"):
                lg.rewind(self.current_epoch)

    def add_scored_transform(self, fn: ScoredTransform) -> None:
        """``fn(minibatches, episodes)`` runs once per epoch after scoring, before any update (e.g. EMPG)."""
        self._scored_transforms.append(fn)

    def on_train_epoch_start(self) -> None:
        """Prepares the epoch's experience for training: scores every minibatch with the policy as it is
        now (old/reference log-probs), runs the scored transforms, logs the epoch's rollout metrics (with
        the gap to the sampler's own log-probs when the engine reported them, :func:`sampler_gap`)."""
        seed_globals(self.seed, self.global_rank, self.current_epoch)
        dm = self.trainer.datamodule
        record = getattr(dm, "train_record", None)
        if record is None:
            return
        if not record.scored:
            self.score_minibatches(record.minibatches)
            for fn in self._scored_transforms:
                fn(record.minibatches, record.episodes)
            record.scored = True
        gap = sampler_gap(record.minibatches, record.episodes)
        if record.sampler_logprobs:  # the same keys on every rank (DDP reduces them), also with nothing to compare
            gap = {"rollout/logprob_gap": 0.0, "rollout/logprob_gap_max": 0.0, **gap}
        metrics = {**record.metrics, **gap}
        log_rollout_metrics(self, metrics, record.tally)  # rollout/*, env/*: from the tallies of all ranks

    def _backward(self, batch: dict) -> tuple[ForwardOut, torch.Tensor, dict]:
        with step_weights(self, batch) as step:  # trainer=fsdp: sharded unless the ranks' micro-batch counts differ
            return backward_microbatched(self, batch, pad_to=step.pad_to)

    def training_step(self, batch: dict, batch_idx: int) -> dict:
        """One optimizer step on a rollout minibatch (the objectives of kind ``rollout``) or on a batch of another kind
        (its objectives alone, the learning rate times their ``lr_scale``, the LR schedule not advanced: it counts
        policy steps; its metrics under their :func:`~cope.train.objectives.step_prefix`).

        A rollout minibatch after the one that stopped the epoch's trust region
        (:func:`~cope.train.step.trust_region.kl_stop`) is not forwarded: its gradient would be dropped. Its row logs
        ``train/kl_stopped`` (1), ``train/kl_stopped_steps`` and ``train/skipped_steps`` only: no loss, ``policy/*`` or
        ``train/grad_norm`` (nothing measured them); it returns no ``loss``. The step that trips the limit was
        forwarded and logs all of its metrics. Weights, optimizer moments, schedule, counts and checkpoints are those
        of the forward-and-drop it replaces, except where something used the dropped steps' forward:
        ``cope.normalize=adaptive``'s loss balance now averages the forwarded steps' losses only, and with LoRA
        dropout the epoch's later steps of another kind draw other masks."""
        kind, step = batch_kind(batch), self.global_step
        if kl_stop(self, kind):  # an earlier minibatch stopped the epoch: every rank skips this one alike
            skipped = {"train/skipped_steps": float(self.step_guard.skipped), "train/kl_stopped": 1.0,
                       "train/kl_stopped_steps": float(self.trust_region.stopped_steps)}
            result = {k: torch.tensor(v) for k, v in skipped.items()}
            self._log_step(result, step)
            return result
        opt = self.optimizers()
        opt.zero_grad()
        _, total, metrics = self._backward(batch)
        grads = [p.grad for p in self.policy.trainable_parameters() if p.grad is not None]
        norm = total_grad_norm(grads)  # before clipping; DDP: already synced; FSDP: the shards' global norm
        stopped = kl_stop(self, kind, metrics)
        if stopped:
            opt.zero_grad()  # weights, moments and schedule stay as they were; no step count either
        elif self.step_guard.allow(norm, self.global_step):
            if self.gradient_clip_val is not None:
                self.clip_gradients(opt, gradient_clip_val=self.gradient_clip_val, gradient_clip_algorithm="norm")
            scale = math.prod(o.lr_scale for o in self.objectives if o.batch_kind == kind and o.weight_at(self.global_step) != 0)
            with lr_scaled(opt, scale):
                opt.step()
            sch = self.lr_schedulers()
            if sch is not None and kind == ROLLOUT:
                sch.step()
        else:
            opt.zero_grad()  # the weights, optimizer moments and schedule stay as they were
        if kind == ROLLOUT:
            metrics = {**metrics, "train/grad_norm": norm.detach(), "train/skipped_steps": float(self.step_guard.skipped)}
            if self.step_guard.skip_zero:
                metrics["train/zero_grad_steps"] = float(self.step_guard.zero_skipped)
            if self.trust_region.on:
                metrics = {**metrics, "train/kl_stopped": float(stopped),
                           "train/kl_stopped_steps": float(self.trust_region.stopped_steps)}
        else:  # its objectives' own names: loss/total and train/grad_norm stay the policy steps'
            prefix = step_prefix(self.objectives, kind)
            metrics = {(f"{prefix}/loss_total" if k == "loss/total" else k): v for k, v in metrics.items()}
            metrics[f"{prefix}/grad_norm"] = norm.detach()
            metrics[f"{prefix}/tokens_forwarded"] = float(batch["attention_mask"].ne(0).sum())  # shared prefixes: once
        result = {k: (v.detach() if torch.is_tensor(v) else torch.tensor(float(v))) for k, v in metrics.items()}
        self._log_step(result, step)
        result["loss"] = total
        return result

    def _log_step(self, metrics: dict[str, torch.Tensor], step: int) -> None:
        """This step's metrics, straight to the loggers at the step's index (rank zero: its own rows' values). Not
        ``self.log``: Lightning reports a key logged on an earlier step of the epoch again on every later step
        that does not log it, so the policy steps' losses reappeared on the rows of the steps of another kind."""
        if self.trainer.is_global_zero:
            # with the epoch, as Lightning adds it to its own rows: a resumed run's logger rewinds by it
            log_now(self.trainer.loggers, {**{k: float(v) for k, v in metrics.items()}, "epoch": self.current_epoch}, step)

    def validation_step(self, batch: list[int], batch_idx: int) -> None:
        """Greedy held-out episodes of one chunk of the panel (the datamodule's engine runs them and keeps
        them in its ``val_record``; ``val/*`` is logged once for the whole panel, at the epoch's end)."""
        self.trainer.datamodule.evaluate(batch, first=batch_idx == 0)

    def on_validation_epoch_end(self) -> None:
        """``val/*`` of the held-out panel: every rank's episodes pooled (a share of all episodes or steps)."""
        log_val_metrics(self, self.trainer.datamodule.val_record)

    def on_validation_end(self) -> None:
        if self.trainer.sanity_checking or self.trainer.state.fn != TrainerFn.FITTING:  # not the pre-fit validation
            return
        vals = {k: float(v) for k, v in self.trainer.callback_metrics.items() if k.startswith("val/")}
        self.last_validation = {**vals, "val/epoch": float(self.current_epoch)}

    def configure_optimizers(self):
        if self._whole is not None:  # trainer=fsdp: the optimizer holds the shards, whatever a validation left gathered
            self._whole.shard()
        params = self.policy.trainable_parameters()
        if not params:
            raise ValueError("the policy has no trainable parameters (check model.lora)")
        opt = self.optimizer_factory(params)
        if self.scheduler_factory is None:
            return opt
        return {"optimizer": opt, "lr_scheduler": {"scheduler": self.scheduler_factory(opt), "interval": "step"}}

    # -- checkpoints (cope.train.module_checkpoint) ----------------------------------------------
    def on_save_checkpoint(self, checkpoint: dict) -> None:
        save_state(self, checkpoint)

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        load_state(self, checkpoint)
