"""The vLLM tests' fixtures live in vllm_fixtures.py (importable by the test modules); they are registered here."""
from vllm_fixtures import served_policy, vllm_engine, vllm_python  # noqa: F401
