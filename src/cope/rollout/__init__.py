"""The rollout side: policy + envs -> :class:`~cope.episode.Episode` records, token-in/token-out.

* :mod:`~cope.rollout.engine`: the :class:`~cope.rollout.engine.RolloutEngine` protocol, its typed settings
  (``Sampling``, ``EnvRuntime``) and the in-process :class:`~cope.rollout.engine.HFEngine`.
* :mod:`~cope.rollout.loop`: :func:`~cope.rollout.loop.run_episodes`, the lock-step multi-turn loop every
  engine drives (the transcript's token format, context overflow, env errors).
* :mod:`~cope.rollout.hf_actor`: batched sampling with a KV cache that persists across turns (the HF engine's actor).
* :mod:`~cope.rollout.metrics`: ``rollout/*`` and ``val/*`` metrics of a list of episodes.
* :mod:`~cope.rollout.vllm`: the vLLM server engine (its own venv, HTTP, adapter hot-reload).

Nothing here imports the training side (:mod:`cope.train`).
"""
