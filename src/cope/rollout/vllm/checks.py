"""Checks that a vLLM server samples from the trainer's model, each failing in one line.

Run by :meth:`cope.rollout.vllm.engine.VLLMEngine.connect`, before any rollout or training step:

1. the server serves a base model (``/v1/models``) whose context fits ``data.max_context``;
2. it tokenizes the chat scaffold and a probe text exactly as the trainer's tokenizer does (``/tokenize``);
3. its base-model log-probs of that probe match the trainer's base (adapter disabled) within a tolerance:
   a different checkpoint of the same tokenizer family shows up here (gaps of nats, not of 1e-6).

And after every adapter load (:func:`check_delivery`, at connect and at each ``sync`` that loads a new policy
version): the server's log-probs of the same probe under the new adapter's name match the trainer's under its
current weights (adapter on). A folder written with other weights, a load that did not happen or an adapter
evicted and reloaded from an overwritten folder shows up as a gap of nats, not of 1e-6.

The tolerance rule (:func:`probe_tolerance`): ``data.engine.check_tolerance`` if set, else 1e-3 nats per token
when the trainer's base weights are fp32 (the server then runs fp32 too unless ``data.engine.dtype`` says
otherwise, and the gap is float noise, ~1e-6), 0.1 else (bf16/fp16 rounding on both sides).
"""
from __future__ import annotations

from cope.rollout.vllm.client import Client, RequestError, ServerError, prompt_logprobs
from cope.rollout.vllm.server import VLLMError

PROBE = ("You are an agent in a text world. Reply with exactly one action.\n"
         "You see a door to the north and a key on the floor. Closer: north, east.")


def _served_base(client: Client, name: str | None) -> tuple[str, int | None]:
    models = (client.get("/v1/models") or {}).get("data", [])
    bases = [m for m in models if not m.get("parent")]  # LoRA adapters name their base as parent
    if name is not None:
        bases = [m for m in bases if m.get("id") == name]
    if not bases:
        served = sorted(m.get("id") for m in models)
        raise VLLMError(f"vLLM server at {client.url} serves no base model {name or ''!s} (it serves {served}; data.engine.model)")
    return bases[0]["id"], bases[0].get("max_model_len")


def probe_ids(policy) -> list[int]:
    """The probe as one system turn of the policy's chat scaffold: a few dozen ids."""
    chat, tok = policy.chat, policy.tokenizer
    return [*chat.system_open, *tok(PROBE, add_special_tokens=False)["input_ids"], *chat.turn_end]


def probe_tolerance(policy, tolerance: float | None) -> float:
    """The largest mean |log-prob gap| per probe token (see the module doc)."""
    if tolerance is not None:
        return tolerance
    return 1e-3 if str(policy.model.get_base_model().dtype) == "torch.float32" else 0.1


def served_logprobs(client: Client, model: str, ids: list[int]):
    """The server's log p(ids[t] | ids[<t]), t >= 1, under ``model`` (a base or adapter name): float64 (T-1,)."""
    import torch

    body = client.post("/v1/completions", {"model": model, "prompt": ids, "max_tokens": 1, "temperature": 0.0,
                                           "prompt_logprobs": 0})
    return torch.tensor(prompt_logprobs(body, ids), dtype=torch.float64)


def trainer_logprobs(policy, ids: list[int], adapter: bool = True):
    """The trainer's log p(ids[t] | ids[<t]), t >= 1: eval mode, no grad, adapter on (current weights) or off (base)."""
    import contextlib

    import torch

    model = policy.model
    was = model.training
    model.eval()
    try:
        with torch.no_grad(), (contextlib.nullcontext() if adapter else model.disable_adapter()):
            dev = next(model.parameters()).device
            logits = model(input_ids=torch.tensor([ids], device=dev)).logits[0, :-1].float()  # (T-1, V)
            lp = logits.log_softmax(-1).gather(-1, torch.tensor(ids[1:], device=dev)[:, None]).squeeze(-1)  # (T-1,)
    finally:
        model.train(was)
    return lp.double().cpu()


def check_server(client: Client, policy, max_context: int, name: str | None = None, tolerance: float | None = None) -> str:
    """Check the server against ``policy``; returns the served name of its base model."""
    try:
        base, max_len = _served_base(client, name)
        if max_len is not None and int(max_len) < max_context:
            raise VLLMError(f"vLLM server's max_model_len {max_len} < data.max_context {max_context}")
        chat, tok = policy.chat, policy.tokenizer
        text = "".join(tok.decode(list(p)) for p in (chat.system_open, chat.turn_end, chat.newline, chat.user_open)) + PROBE
        mine = tok(text, add_special_tokens=False)["input_ids"]
        theirs = client.post("/tokenize", {"model": base, "prompt": text, "add_special_tokens": False})["tokens"]
        if list(theirs) != list(mine):
            raise VLLMError(f"tokenizer mismatch: vLLM ({base}) gives {len(theirs)} ids, the trainer's tokenizer "
                            f"({policy.source}) {len(mine)} for the same probe (first ids {theirs[:8]} vs {mine[:8]})")
        ids = probe_ids(policy)
        served = served_logprobs(client, base, ids)
    except (ServerError, RequestError) as e:
        raise VLLMError(f"vLLM server at {client.url} failed the model check: {e}") from None
    gap = (trainer_logprobs(policy, ids, adapter=False) - served).abs().mean().item()
    tol = probe_tolerance(policy, tolerance)
    if not gap <= tol:
        raise VLLMError(f"model mismatch: vLLM ({base}) and the trainer ({policy.source}) differ by {gap:.3g} nats per token "
                        f"on a probe (> data.engine.check_tolerance={tol:g}): serve the trainer's base model and dtype")
    return base


def check_delivery(client: Client, policy, adapter: str, version: int, tolerance: float | None = None) -> float:
    """Check that the server's adapter ``adapter`` is the trainer's current weights (policy ``version``); returns
    the gap (mean |log-prob difference| per probe token, nats). One short request and one probe forward."""
    ids = probe_ids(policy)
    try:
        served = served_logprobs(client, adapter, ids)
    except (ServerError, RequestError) as e:
        raise VLLMError(f"vLLM server at {client.url} failed the delivery check of version {version} ({adapter}): {e}") from None
    gap = (trainer_logprobs(policy, ids) - served).abs().mean().item()
    tol = probe_tolerance(policy, tolerance)
    if not gap <= tol:
        raise VLLMError(f"the served adapter {adapter} is not the trainer's version {version}: was the sync delivered? "
                        f"(probe log-probs differ by {gap:.3g} nats per token > data.engine.check_tolerance={tol:g})")
    return gap
