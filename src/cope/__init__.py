"""cope-trainer: on-policy RL for language agents (GRPO + CoPE forecasting + ECHO + EMPG)."""

__version__ = "0.1.0"
