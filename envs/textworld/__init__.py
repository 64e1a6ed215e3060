"""TextWorld: the adapter (:mod:`~cope.envs.textworld.env`, ``TextWorldEnv``) and the seeded game
generation and cache (:mod:`~cope.envs.textworld.games`). docs/envs/textworld.md."""
