"""Chat templates this project ships, chosen with ``model.chat_template`` (:func:`cope.models.policy.load_pretrained`).

A model's own template is used unless ``model.chat_template`` names one of :data:`TEMPLATES` or a ``.jinja`` file: a
model whose template renders no tools (the tiny model's plain ChatML) can then take native tool calls
(``env.action_format=native``), and a user can fix a template without editing the model folder.

* ``chatml``: ChatML without tools (the tiny model's own, :data:`cope.chat.CHATML_TEMPLATE`);
* ``chatml-hermes``: ChatML with Qwen2.5's tool format (written from its published prompt format, not a copy of a
  vendor's file): the tools listed in the system turn inside ``<tools>``, a call a ``<tool_call>`` JSON block, results
  a user turn of ``<tool_response>`` blocks.
"""
from __future__ import annotations

from pathlib import Path

from cope.chat import CHATML_TEMPLATE

NL = "{{ '\\n' }}"  # a newline as an expression: HF renders with trim_blocks/lstrip_blocks, which eat literal ones
HERMES = (
    "{%- if messages[0].role == 'system' %}{%- set sys = messages[0].content %}{%- set rest = messages[1:] %}"
    "{%- else %}{%- set sys = 'You are a helpful assistant.' %}{%- set rest = messages %}{%- endif %}"
    "<|im_start|>system" + NL + "{{ sys }}"
    "{%- if tools %}" + NL + NL + "# Tools" + NL + NL + "You may call one or more functions to assist with the user query."
    + NL + NL + "You are provided with function signatures within <tools></tools> XML tags:" + NL + "<tools>"
    "{%- for t in tools %}" + NL + "{{ t | tojson }}{%- endfor %}" + NL + "</tools>" + NL + NL
    + "For each function call, return a json object with function name and arguments within <tool_call></tool_call> "
    "XML tags:" + NL + "<tool_call>" + NL + '{"name": <function-name>, "arguments": <args-json-object>}' + NL
    + "</tool_call>{%- endif %}<|im_end|>" + NL
    + "{%- for m in rest %}"
    "{%- if m.role == 'assistant' %}<|im_start|>assistant" + NL + "{{ m.content or '' }}"
    "{%- for c in m.tool_calls or [] %}{%- if m.content or not loop.first %}" + NL + "{%- endif %}<tool_call>" + NL
    + '{"name": "{{ c.function.name }}", "arguments": {{ c.function.arguments | tojson }}}' + NL + "</tool_call>"
    "{%- endfor %}<|im_end|>" + NL
    + "{%- elif m.role == 'tool' %}"
    "{%- if loop.first or rest[loop.index0 - 1].role != 'tool' %}<|im_start|>user{%- endif %}" + NL
    + "<tool_response>" + NL + "{{ m.content }}" + NL + "</tool_response>"
    "{%- if loop.last or rest[loop.index0 + 1].role != 'tool' %}<|im_end|>" + NL + "{%- endif %}"
    "{%- else %}<|im_start|>{{ m.role }}" + NL + "{{ m.content }}<|im_end|>" + NL + "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant" + NL + "{%- endif %}"
)

TEMPLATES = {"chatml": CHATML_TEMPLATE, "chatml-hermes": HERMES}
RENDERS_TOOLS = {"chatml": False, "chatml-hermes": True}  # what a config rule can know before a tokenizer exists


def chat_template(choice: str) -> str:
    """The jinja text of ``choice``: a name in :data:`TEMPLATES` or the path of a template file (ValueError naming
    ``model.chat_template`` otherwise)."""
    if choice in TEMPLATES:
        return TEMPLATES[choice]
    path = Path(choice).expanduser()
    if path.is_file():
        return path.read_text()
    raise ValueError(f"model.chat_template = {choice!r}: neither a template this project ships ({sorted(TEMPLATES)}) nor "
                     "a template file")
