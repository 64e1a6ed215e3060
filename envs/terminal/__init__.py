"""Terminal tasks: the adapter (:mod:`~cope.envs.terminal.env`, ``TerminalEnv``), the bubblewrap sandbox
(:mod:`~cope.envs.terminal.sandbox`, its pid-1 guards in :mod:`~cope.envs.terminal.sandbox_guard`), the work
dir archive (:mod:`~cope.envs.terminal.workdir`) and the task families (:mod:`~cope.envs.terminal.tasks`,
``tasks_files``, ``tasks_text``, ``tasks_code``). docs/envs/terminal.md."""
