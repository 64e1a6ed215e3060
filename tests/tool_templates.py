"""Chat templates and tokenizers of the tool-calling template families, written for the tests from each family's
published prompt format (not copies of the vendors' template files), and a small tool env that records its turns.

Families:

* ``chatml-hermes`` (Qwen2.5 and other ChatML models): tools listed in the system turn inside ``<tools>``, calls in
  ``<tool_call>`` blocks, results as a user turn of ``<tool_response>`` blocks.
* ``llama3.1`` (JSON tool calling): ``Environment: ipython`` in the system turn, the tool list at the top of the first
  user message, a call is the whole assistant turn as ``{"name": ..., "parameters": ...}``, results in the
  ``ipython`` role.
* ``mistral`` (v7-style control tokens): ``[SYSTEM_PROMPT]``, the tool list in ``[AVAILABLE_TOOLS]`` before the last
  user message, calls after ``[TOOL_CALLS]``, results between ``[TOOL_RESULTS]`` and ``[/TOOL_RESULTS]``.

Each family gets a byte-level BPE tokenizer trained here (under a second) with the family's special tokens and its
pre-tokenizer rule (the Llama 3 / Qwen2 / Tekken split, which glues punctuation to following newlines: the case where
tokenizing pieces on their own drifts from tokenizing the rendered text).
"""
from __future__ import annotations

import functools

from cope.chat.templates import HERMES, NL  # the hermes family is the template this project ships
from cope.envs.base import EnvReset, EnvStep, Task, TaskEnv
from cope.envs.tool_calls import check_action_format, function_tool, read_action, refusal_notice

LLAMA31 = (
    "{{- bos_token }}"
    "{%- if messages[0].role == 'system' %}{%- set sys = messages[0].content %}{%- set rest = messages[1:] %}"
    "{%- else %}{%- set sys = '' %}{%- set rest = messages %}{%- endif %}"
    "<|start_header_id|>system<|end_header_id|>" + NL + NL
    + "{%- if tools %}Environment: ipython" + NL + "{%- endif %}"
    "Cutting Knowledge Date: December 2023" + NL + "Today Date: 26 Jul 2024" + NL + NL + "{{ sys }}<|eot_id|>"
    "{%- for m in rest %}"
    "{%- if m.role == 'user' and loop.first and tools %}<|start_header_id|>user<|end_header_id|>" + NL + NL
    + "Given the following functions, please respond with a JSON for a function call with its proper arguments that "
    "best answers the given prompt." + NL + NL + 'Respond in the format {"name": function name, "parameters": '
    'dictionary of argument name and its value}. Do not use variables.' + NL + NL
    + "{%- for t in tools %}{{ t | tojson(indent=4) }}" + NL + NL + "{%- endfor %}{{ m.content }}<|eot_id|>"
    "{%- elif m.role == 'assistant' and m.tool_calls %}<|start_header_id|>assistant<|end_header_id|>" + NL + NL
    + "{%- for c in m.tool_calls %}"
    '{"name": "{{ c.function.name }}", "parameters": {{ c.function.arguments | tojson }}}'
    "{%- endfor %}<|eot_id|>"
    "{%- elif m.role in ('tool', 'ipython') %}<|start_header_id|>ipython<|end_header_id|>" + NL + NL
    + "{{ m.content }}<|eot_id|>"
    "{%- else %}<|start_header_id|>{{ m.role }}<|end_header_id|>" + NL + NL + "{{ m.content }}<|eot_id|>"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>" + NL + NL + "{%- endif %}"
)
MISTRAL = (
    "{{- bos_token }}"
    "{%- if messages[0].role == 'system' %}[SYSTEM_PROMPT]{{ messages[0].content }}[/SYSTEM_PROMPT]"
    "{%- set rest = messages[1:] %}{%- else %}{%- set rest = messages %}{%- endif %}"
    "{%- set ns = namespace(last=-1) %}"
    "{%- for m in rest %}{%- if m.role == 'user' %}{%- set ns.last = loop.index0 %}{%- endif %}{%- endfor %}"
    "{%- for m in rest %}"
    "{%- if m.role == 'user' %}"
    "{%- if tools and loop.index0 == ns.last %}[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]{%- endif %}"
    "[INST]{{ m.content }}[/INST]"
    "{%- elif m.role == 'assistant' %}{{ m.content or '' }}"
    "{%- if m.tool_calls %}[TOOL_CALLS][{%- for c in m.tool_calls %}"
    '{"name": "{{ c.function.name }}", "arguments": {{ c.function.arguments | tojson }}}'
    "{%- if not loop.last %}, {% endif %}{%- endfor %}]{%- endif %}{{ eos_token }}"
    "{%- elif m.role == 'tool' %}[TOOL_RESULTS]{{ m.content }}[/TOOL_RESULTS]"
    "{%- endif %}{%- endfor %}"
)
# The split rule of the Llama 3, Qwen2 and Tekken pre-tokenizers (punctuation takes the newlines after it).
SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
         r"|\s+(?!\S)|\s+")
FAMILIES = {
    "chatml-hermes": dict(template=HERMES, special=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                          added=["<tool_call>", "</tool_call>"], eos="<|im_end|>", bos=None),
    "llama3.1": dict(template=LLAMA31, special=["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>",
                                                "<|end_header_id|>", "<|eot_id|>", "<|eom_id|>", "<|python_tag|>"],
                     added=[], eos="<|eot_id|>", bos="<|begin_of_text|>"),
    "mistral": dict(template=MISTRAL, special=["<unk>", "<s>", "</s>", "[INST]", "[/INST]", "[SYSTEM_PROMPT]",
                                               "[/SYSTEM_PROMPT]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]",
                                               "[TOOL_CALLS]", "[TOOL_RESULTS]", "[/TOOL_RESULTS]"],
                    added=[], eos="</s>", bos="<s>"),
}


@functools.lru_cache(maxsize=None)
def family_tokenizer(family: str):
    """A byte-level BPE tokenizer of ``family`` (its special tokens, its split rule, its template), trained on the
    texts of :class:`ToolEnv` and the templates."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    spec = FAMILIES[family]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(SPLIT), behavior="isolated"),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    env = ToolEnv()
    texts = [env.instructions, *TRAIN_TEXT] * 20
    trainer = trainers.BpeTrainer(vocab_size=700, special_tokens=spec["special"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=spec["eos"], bos_token=spec["bos"],
                                   pad_token=spec["special"][0], chat_template=spec["template"])
    if spec["added"]:
        fast.add_tokens(spec["added"])
    fast.name_or_path = f"test-{family}"
    return fast


TRAIN_TEXT = ['{"name": "add", "arguments": {"a": 2, "b": 3}}', "<tool_response>\n5\n</tool_response>",
              "Given the following functions, please respond with a JSON", "[exit code 0]\n", "Environment: ipython\n",
              '{"type": "function", "function": {"name": "lookup", "description": "Look up a key."}}',
              "user: I need the total.\n", "What is 2 plus 3? Then look up the key alpha."]


class ToolEnv(TaskEnv):
    """A calculator with a notebook: ``add(a, b)``, ``lookup(key)`` and ``finish(answer)``; the task is to finish with
    ``a + b + value(key)``. ``action_format``: ``native`` (tool calls, :mod:`cope.envs.tool_calls`) or ``text``
    (``add 2 3``, ``lookup alpha``, ``finish 12``). Any other turn is a message: the user answers it. Records every
    text it showed (``turns``: the reset observation, then one (observation, harness) per step)."""

    name, max_steps = "tools", 8
    VALUES = {"alpha": 7, "beta": 11}
    TOOLS = [function_tool("add", "Add two integers.", {"a": {"type": "integer"}, "b": {"type": "integer"}}, ["a", "b"]),
             function_tool("lookup", "Look up a key in the notebook.", {"key": {"type": "string", "enum": ["alpha", "beta"]}},
                           ["key"]),
             function_tool("finish", "Give the final answer.", {"answer": {"type": "integer"}}, ["answer"])]

    def __init__(self, action_format: str = "native", trailing_newline: bool = False):
        self.action_format = check_action_format(action_format)
        self.trailing_newline = trailing_newline  # results end with a newline (the drift case of separate tokenizing)
        self._num_tasks = {"train": 100, "test": 10}
        self.turns: list[tuple[str, str]] = []

    @property
    def instructions(self) -> str:
        return "Compute what the user asks with the tools. Finish with the answer."

    @property
    def tools(self) -> list[dict] | None:
        return self.TOOLS if self.action_format == "native" else None

    def reset(self, task: Task) -> EnvReset:
        self._reset_started()
        self.check_index(task.split, task.index)
        self._episode_started()
        obs = f"What is 2 plus {task.index}, plus the value of alpha?"
        self.turns = [(obs, "")]
        self.goal = 2 + task.index + self.VALUES["alpha"]
        return EnvReset(observation=obs, info={"tools": self.tools} if self.tools else {})

    def _parse(self, action: str):
        if self.action_format == "native":
            a = read_action(action)
            return (a.kind, a.name, a.arguments, a.text)
        words = action.strip().split()
        if words and words[0] in ("add", "lookup", "finish"):
            try:
                args = {"add": lambda w: {"a": int(w[1]), "b": int(w[2])}, "lookup": lambda w: {"key": w[1]},
                        "finish": lambda w: {"answer": int(w[1])}}[words[0]](words)
            except (IndexError, ValueError):
                return ("refused", "", {}, f"bad arguments for {words[0]}")
            return ("call", words[0], args, "")
        return ("message", "", {}, action)

    def step(self, action: str) -> EnvStep:
        self._step_started()
        kind, name, args, text = self._parse(action)
        obs, harness, valid, done, success = "", "", True, False, False
        if kind == "refused":
            harness, valid = refusal_notice(text), False
        elif kind == "message":
            obs = "user: Please use the tools."
        elif name == "add":
            obs = str(args["a"] + args["b"])
        elif name == "lookup":
            obs = f"{args['key']} = {self.VALUES[args['key']]}"
        else:
            done, success = True, args["answer"] == self.goal
            obs = "correct" if success else "wrong"
        if obs and self.trailing_newline:
            obs += "\n"
        timeout = self._step_ended(done)
        self.turns.append((obs, harness))
        return EnvStep(observation=obs, reward=float(success), done=done or timeout, valid=valid, success=success,
                       score=float(success), harness=harness, info={"timeout": timeout})

    def close(self) -> None:
        self._no_episode()


# -- scripted tool conversations -------------------------------------------------------------------------------------
def call(name: str, **arguments):
    from cope.chat.calls import ToolCall

    return ToolCall(name, arguments)


GOOD_SCRIPT = [call("add", a=2, b=3), call("lookup", key="alpha"), call("finish", answer=12)]  # solves task 3


def action_ids(tok, chat, act, closed: bool = True) -> list[int]:
    """The ids a model trained on the template samples for ``act`` (a ToolCall: the template's own text of it; a
    string: that text), with the stop id."""
    text = chat.tools.call_text(act) if not isinstance(act, str) else act
    return [*tok.encode(text, add_special_tokens=False), *([chat.stop_id] if closed else [])]


def run_tool_episodes(tok, chat, scripts: list[list], **env_kwargs):
    """One ToolEnv episode per script (a list of actions: ToolCall or text); returns (episodes, envs, stats)."""
    from tiny_fixtures import Scripted

    from cope.rollout.loop import run_episodes

    envs = [ToolEnv(**env_kwargs) for _ in scripts]
    actor = Scripted({k: [action_ids(tok, chat, a) for a in s] for k, s in enumerate(scripts)})
    tasks = [Task("tools", "train", 3 + k) for k in range(len(scripts))]
    eps, stats = run_episodes(envs, tasks, list(range(len(scripts))), actor, tok, chat, 4096, 200)
    return eps, envs, stats


def expected_messages(env: ToolEnv, script: list, syntax_reads=None) -> tuple[list[dict], list[dict] | None]:
    """The conversation as the env and the actor had it (independent of the transcript): OpenAI messages."""
    from cope.chat.calls import ToolCall

    def joined(obs, harness):
        return obs + ("\n" if obs and harness else "") + harness

    msgs = [{"role": "system", "content": env.instructions}, {"role": "user", "content": joined(*env.turns[0])}]
    for k, (act, turn) in enumerate(zip(script, env.turns[1:])):
        if isinstance(act, ToolCall):
            msgs.append({"role": "assistant", "content": None, "tool_calls": [act.openai(f"call_{k}")]})
            msgs.append({"role": "tool", "tool_call_id": f"call_{k}", "content": joined(*turn)})
        else:
            msgs.append({"role": "assistant", "content": act})
            msgs.append({"role": "user", "content": joined(*turn)})
    return msgs, env.tools
