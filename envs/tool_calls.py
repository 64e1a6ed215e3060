"""Native tool calls as an env sees them (``env.action_format=native``): tool schemas, argument checks, and the one
action string the rollout loop hands to ``Env.step``. Stdlib only, like every env module.

In native mode an env declares its tools as OpenAI function schemas (:func:`function_tool`), returned in
``EnvReset.info["tools"]`` (per episode: a task may bring its own tools) and as the optional ``tools`` attribute.
The model's chat template renders them, the model calls them in its template's own syntax, and the rollout loop
reads the call (:mod:`cope.chat.calls`), checks it against the schemas (:func:`check_call`) and hands the env one
JSON string, whatever the template family:

* ``{"tool_call": {"name": ..., "arguments": {...}}}``: a well-formed call of a declared tool with valid arguments;
* ``{"message": "..."}``: a turn without a call (a message to the user where the env has one);
* ``{"refused": "..."}``: a malformed call, an unknown tool or arguments that fail the schema. The env counts the
  step (its budget, its final check on the last step) and answers it as invalid with the reason as harness text,
  without running anything.

:func:`read_action` turns the string back into a :class:`NativeAction`. Why the loop and not the env reads the
call: the syntax is the model's (its chat template), which an env, model-free by design, does not know.

The schema check is the JSON-Schema subset function schemas use (type, properties, required, additionalProperties,
enum, items, minimum/maximum, minLength/maxLength); keywords outside it are not checked (documented, not guessed).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

ACTION_FORMATS = ("text", "native")
_TYPES = {"string": str, "integer": int, "number": (int, float), "boolean": bool, "object": dict, "array": list,
          "null": type(None)}


def check_action_format(value: str, key: str = "env.action_format") -> str:
    """``value`` itself, or a ValueError naming ``key`` and the choices."""
    if value not in ACTION_FORMATS:
        raise ValueError(f"{key} must be one of {ACTION_FORMATS}, got {value!r}")
    return value


def function_tool(name: str, description: str, properties: dict[str, dict] | None = None,
                  required: list[str] | None = None) -> dict:
    """An OpenAI function schema (what ``apply_chat_template(tools=...)`` takes)."""
    params = {"type": "object", "properties": dict(properties or {}), "required": list(required or []),
              "additionalProperties": False}
    return {"type": "function", "function": {"name": name, "description": description, "parameters": params}}


def tool_name(schema: dict) -> str:
    return schema.get("function", schema)["name"]


def _check(value: Any, schema: dict, where: str) -> str | None:
    kind = schema.get("type")
    kinds = kind if isinstance(kind, list) else [kind] if kind else []
    if kinds:
        ok = any(isinstance(value, _TYPES.get(k, object)) and not (k in ("integer", "number") and isinstance(value, bool))
                 for k in kinds)
        if not ok:
            return f"{where} must be of type {' or '.join(kinds)}, got {type(value).__name__}"
    if "enum" in schema and value not in schema["enum"]:
        return f"{where} must be one of {schema['enum']}, got {value!r}"
    if isinstance(value, str):
        if len(value) < schema.get("minLength", 0) or len(value) > schema.get("maxLength", len(value)):
            return f"{where} has {len(value)} characters, outside [{schema.get('minLength', 0)}, {schema.get('maxLength')}]"
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if "minimum" in schema and value < schema["minimum"] or "maximum" in schema and value > schema["maximum"]:
            return f"{where} must be within [{schema.get('minimum')}, {schema.get('maximum')}], got {value!r}"
    if isinstance(value, dict):
        props = schema.get("properties", {})
        missing = [k for k in schema.get("required", []) if k not in value]
        if missing:
            return f"{where} is missing the required argument(s) {missing}"
        if schema.get("additionalProperties", True) is False:
            extra = sorted(set(value) - set(props))
            if extra:
                return f"{where} has unknown argument(s) {extra}; known: {sorted(props)}"
        for k, v in value.items():
            if k in props and (problem := _check(v, props[k], f"argument {k!r}" if where == "the arguments" else f"{where}.{k}")):
                return problem
    if isinstance(value, list) and isinstance(schema.get("items"), dict):
        for i, v in enumerate(value):
            if problem := _check(v, schema["items"], f"{where}[{i}]"):
                return problem
    return None


def check_call(name: str, arguments: dict, tools: list[dict]) -> str | None:
    """Why the call of ``name`` with ``arguments`` is refused against ``tools`` (unknown tool, arguments that fail
    the tool's parameter schema), or None when it is valid."""
    by_name = {tool_name(t): t.get("function", t) for t in tools}
    if name not in by_name:
        return f"unknown tool {name!r}; the tools are {sorted(by_name)}"
    params = by_name[name].get("parameters") or {"type": "object"}
    problem = _check(arguments, {**params, "type": "object"}, "the arguments")
    return f"invalid arguments for {name!r}: {problem}" if problem else None


@dataclass
class NativeAction:
    """An action of a native-format episode, as the env reads it."""

    kind: str  # "call", "message" or "refused"
    name: str = ""
    arguments: dict[str, Any] = field(default_factory=dict)
    text: str = ""  # the message, or why the call was refused

    def encode(self) -> str:
        """The action string ``Env.step`` receives."""
        if self.kind == "call":
            return json.dumps({"tool_call": {"name": self.name, "arguments": self.arguments}}, ensure_ascii=False)
        return json.dumps({"message" if self.kind == "message" else "refused": self.text}, ensure_ascii=False)


def read_action(action: str) -> NativeAction:
    """The :class:`NativeAction` an action string stands for. A string that is not one (an env in native mode
    stepped with plain text, e.g. by hand) is refused, with the reason as its text."""
    try:
        obj = json.loads(action)
    except (json.JSONDecodeError, RecursionError, TypeError):
        obj = None
    if isinstance(obj, dict) and len(obj) == 1:
        (key, value), = obj.items()
        if key == "tool_call" and isinstance(value, dict) and isinstance(value.get("name"), str) \
                and isinstance(value.get("arguments", {}), dict):
            return NativeAction("call", value["name"], dict(value.get("arguments", {})))
        if key in ("message", "refused") and isinstance(value, str):
            return NativeAction(key, text=value)
    return NativeAction("refused", text="not a native tool action (env.action_format=native expects the rollout "
                                        "loop's tool-call envelope, cope.envs.tool_calls)")


def refusal_notice(reason: str) -> str:
    """The harness text of a refused native action."""
    return f"[Invalid tool call: {reason}. Nothing was run.]"
