"""The env runtime: where env instances live and how the rollout engine steps them.

* :mod:`~cope.envs.runtime.batch`: the env-batch interface (``reset``/``submit``/``Pending``) and
  :class:`~cope.envs.runtime.batch.InProcessEnvs` (instances in this process);
* :mod:`~cope.envs.runtime.pool`: :class:`~cope.envs.runtime.pool.EnvWorkerPool`, the same interface over
  worker processes (deadlines, restarts, replay);
* :mod:`~cope.envs.runtime.worker`: the worker child (``python -m cope.envs.runtime.worker``) and its wire format;
* :mod:`~cope.envs.runtime.remote`: :class:`~cope.envs.runtime.remote.RemoteEnv`, one env in another interpreter;
* :mod:`~cope.envs.runtime.chaos`: :class:`~cope.envs.runtime.chaos.ChaosEnv`, fault injection for tests.

Stdlib only, like every env module (no torch): the AppWorld venv imports it. Nothing is imported here,
so ``python -m cope.envs.runtime.worker`` runs its module once.
"""
