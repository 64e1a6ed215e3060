"""The training side: episodes -> batches -> objectives -> optimizer, on PyTorch Lightning.

Top level (the system and its contracts):

* :mod:`~cope.train.datamodule`: ``RolloutDataModule``, each epoch's experience from its collector.
* :mod:`~cope.train.module`: ``AgentRLModule``, the LightningModule (scoring pass, micro-batched step); its part of a
  checkpoint in :mod:`~cope.train.module_checkpoint`.
* :mod:`~cope.batch`: the batch contract (``RolloutBatch``) and ``collate``.
* :mod:`~cope.train.objectives`: the ``Objective`` base, what it asks of the forward (``Needs``), ``ForwardOut``,
  ``combine``.
* :mod:`~cope.train.logprobs`: per-token log-probs and entropy without (N, T, V) logits.
* :mod:`~cope.train.advantages`: group-relative advantages.
* :mod:`~cope.train.dist`: epoch metrics pooled over ranks, step rows written at once (``log_now``);
  :mod:`~cope.train.seeding`: derived random streams.

Subpackages, one concern each:

* :mod:`~cope.train.collect`: how an epoch's episodes are gathered (collect-then-train, lagged) and turned into
  experience (advantages, minibatches, counters).
* :mod:`~cope.train.step`: one optimizer step (micro-batched backward, the scoring pass, the step guard, the trust
  region, per-objective gradients).
* :mod:`~cope.train.packing`: shared prefixes forwarded once (prefix trees, tree attention, packed rows).
* :mod:`~cope.train.fsdp`: ``trainer=fsdp`` (the strategy, when the weights are sharded, sharded checkpoints).
"""
