"""Text environments behind one protocol (`cope.envs.base.Env`). Importable without torch."""
from cope.envs.base import Env, EnvReset, EnvStep, Task

__all__ = ["Env", "EnvReset", "EnvStep", "Task"]
