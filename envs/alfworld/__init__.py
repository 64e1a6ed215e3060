"""ALFWorld: the adapter (:mod:`~cope.envs.alfworld.env`, ``AlfWorldEnv``), the engine pool and memo
(:mod:`~cope.envs.alfworld.engine`), the alfworld-style game generator (:mod:`~cope.envs.alfworld.games`)
and its scenes (:mod:`~cope.envs.alfworld.scenes`). docs/envs/alfworld.md."""
