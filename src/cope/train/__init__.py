"""The training side: episodes -> batches -> objectives -> optimizer, on PyTorch Lightning.

* :mod:`~cope.train.datamodule`: ``RolloutDataModule``, each epoch's experience from a rollout engine.
* :mod:`~cope.train.experience`: episodes -> advantages -> minibatches (collate transforms), plain functions.
* :mod:`~cope.train.batch`: the batch contract (``RolloutBatch``) and ``collate``.
* :mod:`~cope.train.module`: ``AgentRLModule``, the LightningModule (scoring pass, micro-batched step).
* :mod:`~cope.train.logprobs`: per-token log-probs and entropy without (N, T, V) logits.
* :mod:`~cope.train.objectives`: the ``Objective`` base, ``ForwardOut``, ``combine``.
* :mod:`~cope.train.advantages`: group-relative advantages.
* :mod:`~cope.train.grad_stats`: per-objective gradients (the math behind diagnostics and gradient balancing).
"""
