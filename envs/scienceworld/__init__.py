"""ScienceWorld: the adapter (:mod:`~cope.envs.scienceworld.env`, ``ScienceWorldEnv``), the JVM process
(:mod:`~cope.envs.scienceworld.jvm`), the task/variation map (:mod:`~cope.envs.scienceworld.tasks`) and the
simulator's text (:mod:`~cope.envs.scienceworld.text`). docs/envs/scienceworld.md."""
