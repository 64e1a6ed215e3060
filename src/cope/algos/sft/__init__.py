"""Supervised fine-tuning on demonstration episodes (``algo=sft``), as an algorithm of the same trainer.

Behaviour cloning of an expert's multi-turn episodes: the demonstrations are made by the rollout loop
(:func:`cope.rollout.loop.run_episodes`) with an actor that emits the demonstration's actions instead of sampling, so
each one is this trainer's normal :class:`~cope.episode.Episode` in the policy's own chat scaffold, and everything
after collection (minibatches, packing, micro-batching, checkpoints, adapter export, validation) is RL's.

* :mod:`~cope.algos.sft.demos`: where demonstrations come from: the env's own expert (``expert_action()``, the
  optional capability of :class:`cope.envs.base.Env`) or a ``trajectories.jsonl`` of this trainer, read and checked;
* :mod:`~cope.algos.sft.actors`: the actors that emit them (token ids ``encode(action) + [stop id]``);
* :mod:`~cope.algos.sft.collector`: :class:`~cope.algos.sft.collector.DemoCollector`, the collector
  (``data.collector``) that hands each epoch's demonstrations to the DataModule;
* :mod:`~cope.algos.sft.loss`: :class:`~cope.algos.sft.loss.SFTLoss`, the cross-entropy on action tokens.
"""
