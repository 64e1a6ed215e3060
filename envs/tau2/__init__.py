"""tau2-bench: the adapter (:mod:`~cope.envs.tau2.env`, ``Tau2Env``), the action format and instructions
(:mod:`~cope.envs.tau2.format`), the task splits (:mod:`~cope.envs.tau2.tasks`) and the user simulators
(:mod:`~cope.envs.tau2.user`). docs/envs/tau2.md."""
