"""User simulators for the tau2-bench adapter (`cope.envs.tau2.env`): ``canned``, ``openai``, ``local``.

Like the env, this module imports ``tau2`` (and, for ``local``, torch and transformers) lazily, inside
the functions that need it.

* ``canned`` (:class:`CannedUser`, offline, for tests and smoke runs). Its first message is the
  *opening*: the scenario the task gives the user simulator, verbatim (``reason_for_call``, then
  ``known_info`` on a new line when the task has one, for structured scenarios (airline, retail,
  telecom); the whole string for plain-string scenarios (mock)). Every later turn it answers with
  one fixed text (``canned_reply``, default ``Yes, please go ahead.``). It never calls a tool and
  never ends the conversation itself: the agent ends it with ``done`` (or the step limit does).
* ``openai``: tau2's own LLM user simulator (its system prompt, guidelines and tool use) through
  litellm against any OpenAI-compatible endpoint: model ``openai/<user_model>``, ``api_base`` =
  ``user_base_url``, key from the environment variable ``user_api_key_env`` (``EMPTY`` when unset,
  which local servers such as vLLM accept).
* ``local``: the same system prompt and conversation as tau2's simulator, answered by a local
  transformers chat model (``user_model`` = a folder with a chat template) in this process. No
  tool use (a telecom user needs tools: use ``openai`` or solo mode there). Models are loaded once
  per process and shared by the env instances (lazy import of torch and transformers).
"""
from __future__ import annotations

import os
import threading
from typing import Any

DEFAULT_CANNED_REPLY = "Yes, please go ahead."
_LOCAL_MODELS: dict[tuple[str, str], Any] = {}
_LOCAL_LOCK = threading.Lock()


def opening_message(task) -> str:
    """What the canned user says first: the task's scenario for the user, verbatim (see module doc)."""
    from tau2.data_model.tasks import StructuredUserInstructions

    instructions = task.user_scenario.instructions
    if isinstance(instructions, StructuredUserInstructions):
        parts = [instructions.reason_for_call.strip()]
        if instructions.known_info:
            parts.append(instructions.known_info.strip())
        return "\n".join(parts)
    return str(instructions).strip()


def _incoming(state, message) -> None:
    """Appends the message the user answers (one or several tool results) to its state."""
    from tau2.data_model.message import MultiToolMessage

    state.messages.extend(message.tool_messages if isinstance(message, MultiToolMessage) else [message])


def _stop(message) -> bool:
    from tau2.user.user_simulator import UserSimulator

    return UserSimulator.is_stop(message)


class CannedUser:
    """Offline scripted user: the opening once, then ``reply`` to every agent message (tau2's user
    interface: ``get_init_state``, ``generate_next_message``, ``is_stop``)."""

    def __init__(self, opening: str, reply: str = DEFAULT_CANNED_REPLY):
        self.opening, self.reply = opening, reply
        self._opened = False

    def get_init_state(self, message_history=None):
        from tau2.user.base import UserState

        return UserState(system_messages=[], messages=list(message_history or []))

    def is_stop(self, message) -> bool:
        return _stop(message)

    def generate_next_message(self, message, state):
        from tau2.data_model.message import UserMessage

        _incoming(state, message)
        text = self.reply if self._opened else self.opening
        self._opened = True
        out = UserMessage(role="user", content=text, cost=0.0)
        state.messages.append(out)
        return out, state


def _local_model(path: str, device: str):
    """(tokenizer, model) for ``path`` on ``device``, loaded once per process."""
    key = (path, device)
    with _LOCAL_LOCK:
        if key not in _LOCAL_MODELS:
            try:
                from transformers import AutoModelForCausalLM, AutoTokenizer
            except ImportError as e:  # pragma: no cover - transformers is a core dependency
                raise ImportError("user=local needs transformers and torch") from e
            tok = AutoTokenizer.from_pretrained(path)
            model = AutoModelForCausalLM.from_pretrained(path).to(device).eval()
            _LOCAL_MODELS[key] = (tok, model)
        return _LOCAL_MODELS[key]


class LocalUser:
    """tau2's user simulator prompt and conversation, answered by a local transformers model (no tools)."""

    def __init__(self, instructions: str, model_path: str, device: str = "cpu", temperature: float = 0.0,
                 max_new_tokens: int = 256):
        from tau2.user.user_simulator import UserSimulator

        self._sim = UserSimulator(tools=None, instructions=instructions, llm=f"local/{model_path}", llm_args={})
        self.model_path, self.device = model_path, device
        self.temperature, self.max_new_tokens = temperature, max_new_tokens

    def get_init_state(self, message_history=None):
        return self._sim.get_init_state(message_history)  # tau2's system prompt: guidelines + scenario

    def is_stop(self, message) -> bool:
        return _stop(message)

    def generate_next_message(self, message, state):
        import torch
        from tau2.data_model.message import UserMessage

        _incoming(state, message)
        chat = [{"role": m.role, "content": m.content or ""} for m in state.system_messages + state.flip_roles()]
        tok, model = _local_model(self.model_path, self.device)
        ids = tok.apply_chat_template(chat, add_generation_prompt=True, return_tensors="pt", return_dict=True)
        ids = {k: v.to(self.device) for k, v in ids.items()}
        sample = self.temperature > 0
        with torch.no_grad():
            out = model.generate(**ids, max_new_tokens=self.max_new_tokens, do_sample=sample,
                                 temperature=self.temperature if sample else None, top_p=None, top_k=None,
                                 pad_token_id=tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id)
        text = tok.decode(out[0, ids["input_ids"].shape[1]:], skip_special_tokens=True).strip()
        reply = UserMessage(role="user", content=text or "...", cost=0.0)
        state.messages.append(reply)
        return reply, state


def make_user(kind: str, task, *, user_tools, model: str | None, base_url: str | None, api_key_env: str,
              temperature: float, max_new_tokens: int, device: str, canned_reply: str):
    """The user simulator of one episode of tau2 ``task`` (see the module docstring for the kinds)."""
    if kind == "canned":
        return CannedUser(opening_message(task), canned_reply)
    if kind == "openai":
        from tau2.user.user_simulator import UserSimulator

        llm_args: dict[str, Any] = {"temperature": temperature, "api_key": os.environ.get(api_key_env) or "EMPTY"}
        if base_url:
            llm_args["api_base"] = base_url
        return UserSimulator(tools=user_tools, instructions=str(task.user_scenario), llm=f"openai/{model}",
                             llm_args=llm_args)
    if kind == "local":
        return LocalUser(str(task.user_scenario), model, device=device, temperature=temperature,
                         max_new_tokens=max_new_tokens)
    raise ValueError(f"unknown user kind {kind!r}")
