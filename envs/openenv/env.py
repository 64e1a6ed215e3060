"""Any OpenEnv environment (``openenv-core``; extra ``openenv``) behind this project's `cope.envs.base.Env` protocol:
``env=openenv``, by URL or as a local server the trainer starts and stops (:mod:`cope.envs.openenv.server`).

One env instance is one OpenEnv session (a WebSocket, through openenv-core's ``GenericEnvClient``), opened at the
first reset and kept across episodes; the server's ``/schema`` is read once per instance. How the types map:

* Tasks: OpenEnv has none; task ``(split, index)`` resets with ``seed = index`` (train) or
  ``test_seed_offset + index`` (test) and ``episode_id = task id``. What a seed means is the env's.
* Actions, text format: the turn's text fills the action's one field (``text_field``, or the only field the action
  schema has besides ``metadata``; a number or boolean field is read as JSON); an action with several fields takes a
  JSON object of them. Native format: one tool (named ``tool_name``, default the action class's name without
  ``Action``, snake-cased) whose parameters are the action's fields, described by the env's own schema. Arguments
  are checked against the schema here (:func:`cope.envs.tool_calls.check_call`), so a bad action is an invalid step
  with a precise harness message; what the server still refuses (``VALIDATION_ERROR``) is one too.
* Observations: the text is ``observation_field`` of the observation (default: its only string field, else the
  whole observation as JSON); ``admissible_field`` (a list of strings) gives the admissible actions; reward and done
  are OpenEnv's; ``success``: the boolean ``success_field`` when given, else an episode ending with a step reward of
  at least ``success_reward``; ``score``: the summed reward.

Failures, as for env workers: each request has the deadline ``timeout_s``; a session that times out, or whose
server dies, raises, so the engine aborts that episode only (counted in ``env/aborted_episodes``); the session is
dropped and the next reset opens a new one, on a restarted local server (``LocalServer.restarts``). A reset whose
idle session broke since the last episode (the server restarted meanwhile) retries once on a new session: no episode
was in flight there, so none is lost. A server that
does not answer at construction is a clear error at start (``env_facts`` builds one instance before anything else).
MCP tool envs (``ListToolsAction``/``CallToolAction``) are not mapped yet.
"""
from __future__ import annotations

import json
import re

from cope.envs.actions import unencodable
from cope.envs.base import EnvReset, EnvStep, Task, TaskEnv
from cope.envs.openenv.server import check_reachable, get_json, local_server
from cope.envs.tool_calls import check_action_format, check_call, read_action, refusal_notice


def action_tool(schema: dict, tool_name: str | None = None) -> dict:
    """The OpenAI function schema of an OpenEnv action's JSON schema (``metadata`` left out, titles dropped)."""
    props = {k: {kk: vv for kk, vv in v.items() if kk != "title"}
             for k, v in schema.get("properties", {}).items() if k != "metadata"}
    title = schema.get("title", "Action")
    name = tool_name or re.sub(r"(?<!^)(?=[A-Z])", "_", title.removesuffix("Action") or "act").lower()
    return {"type": "function", "function": {
        "name": name, "description": schema.get("description", f"Take one {title}."),
        "parameters": {"type": "object", "properties": props,
                       "required": [k for k in schema.get("required", []) if k != "metadata"], "additionalProperties": False}}}


class OpenEnvEnv(TaskEnv):
    """An OpenEnv environment as an :class:`~cope.envs.base.Env` (see the module doc).

    Args:
        url: an OpenEnv server that already runs (``http://host:port``); None: serve ``app`` locally.
        app: ``module:attribute`` of the OpenEnv app to serve locally (with ``url`` None).
        factory: ``app`` names a function returning the app.
        python: interpreter of the local server (None: this one).
        max_steps: actions per episode (the env may end it sooner).
        num_train_tasks: tasks (reset seeds) of the train split.
        num_test_tasks: tasks of the test split, seeds from ``test_seed_offset``.
        test_seed_offset: first reset seed of the test split.
        action_format: ``text`` or ``native`` (the action as a tool in the model's own tool-call format).
        text_field: the action field a text action fills (None: the action's only field).
        tool_name: the native tool's name (None: from the action class).
        observation_field: the observation field shown as text (None: its only string field, else all as JSON).
        admissible_field: an observation field listing the admissible actions (None: unknown).
        success_field: a boolean observation field saying success (None: the reward rule).
        success_reward: with no ``success_field``, an episode succeeds when it ends on a step reward >= this.
        timeout_s: deadline of one reset or step.
        connect_timeout_s: deadline of opening a session and of the reachability check.
        startup_timeout_s: deadline of the local server's start.
        name: env name in task ids.
    """

    # No fork capability (no fork(), no forks_by_replay): the episode lives in a server session, and whether a reset
    # with the same seed and the same actions says the same again is the served env's own affair, which this generic
    # adapter cannot vouch for (the example's guessing game would, another env need not); branching refuses it by name.

    def __init__(self, url: str | None = None, app: str | None = "cope.envs.openenv.example:create_app",
                 factory: bool = True, python: str | None = None, max_steps: int = 8, num_train_tasks: int = 10_000,
                 num_test_tasks: int = 500, test_seed_offset: int = 1_000_000, action_format: str = "text",
                 text_field: str | None = None, tool_name: str | None = None, observation_field: str | None = None,
                 admissible_field: str | None = None, success_field: str | None = None, success_reward: float = 1.0,
                 timeout_s: float = 30.0, connect_timeout_s: float = 10.0, startup_timeout_s: float = 60.0,
                 name: str = "openenv") -> None:
        if not url and not app:
            raise ValueError("env=openenv needs env.url (a running OpenEnv server) or env.app (one to start)")
        for key, value in (("max_steps", max_steps), ("num_train_tasks", num_train_tasks), ("num_test_tasks", num_test_tasks)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"env.{key} must be an int >= 1, got {value!r}")
        if timeout_s <= 0 or connect_timeout_s <= 0:
            raise ValueError("env.timeout_s and env.connect_timeout_s must be > 0")
        self.action_format = check_action_format(action_format)
        self.name, self.max_steps, self.test_seed_offset = name, max_steps, test_seed_offset
        self._num_tasks = {"train": num_train_tasks, "test": num_test_tasks}
        self.text_field, self.observation_field, self.admissible_field = text_field, observation_field, admissible_field
        self.success_field, self.success_reward = success_field, float(success_reward)
        self.timeout_s, self.connect_timeout_s = float(timeout_s), float(connect_timeout_s)
        self._server = None if url else local_server(app, factory, python, startup_timeout_s)
        self._url = url
        if url:
            check_reachable(url, connect_timeout_s)
        schema = get_json(f"{self.url}/schema", connect_timeout_s)["action"]
        self._tool = action_tool(schema, tool_name)
        fields = list(self._tool["function"]["parameters"]["properties"])
        if text_field is not None and text_field not in fields:
            raise ValueError(f"env.text_field={text_field!r} is not a field of the action {schema.get('title')}: {fields}")
        self._field = text_field or (fields[0] if len(fields) == 1 else None)
        self._client = None
        self._reward, self._success, self._last_admissible = 0.0, False, None

    @property
    def url(self) -> str:
        return self._url or self._server.url

    @property
    def instructions(self) -> str:
        tool = self._tool["function"]
        if self.action_format == "native":
            return f"Act in the environment by calling the tool {tool['name']}: {tool['description']}"
        props = tool["parameters"]["properties"]
        what = (f"the {self._field} only ({props[self._field].get('description') or props[self._field].get('type', 'text')})"
                if self._field else f"a JSON object with the fields {list(props)} only")
        return f"{tool['description']} Each turn, answer with {what}"

    @property
    def tools(self) -> list[dict] | None:
        return [self._tool] if self.action_format == "native" else None

    # -- the session ----------------------------------------------------------------------------------------------
    def _session(self):
        if self._client is None:
            from cope.extras import require

            require("openenv", "openenv", "env=openenv")
            from openenv.core.generic_client import GenericEnvClient

            url = self._server.ensure() if self._server is not None else self._url
            client = GenericEnvClient(base_url=url, connect_timeout_s=self.connect_timeout_s,
                                      message_timeout_s=self.timeout_s).sync()
            client.connect()
            self._client = client
        return self._client

    def _drop(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            try:
                client.close()
            except Exception:  # noqa: BLE001 - a broken session closes as well as it can
                pass

    def _call(self, method: str, *args, **kwargs):
        try:
            return getattr(self._session(), method)(*args, **kwargs)
        except RuntimeError as e:
            if "VALIDATION_ERROR" in str(e):
                raise
            self._drop()
            if method == "step":
                self._no_episode()
            raise
        except BaseException:
            self._drop()  # timed out or disconnected: the next reset opens a new session
            if method == "step":
                self._no_episode()  # its episode is gone with the session: a further step is refused
            raise

    # -- the protocol -------------------------------------------------------------------------------------------
    def _text(self, obs: dict) -> str:
        key = self.observation_field
        if key is None:
            strings = [k for k, v in obs.items() if isinstance(v, str)]
            key = strings[0] if len(strings) == 1 else None
        if key is not None:
            return str(obs.get(key, ""))
        return json.dumps(obs, ensure_ascii=False, sort_keys=True)

    def _admissible(self, obs: dict) -> list[str] | None:
        value = obs.get(self.admissible_field) if self.admissible_field else None
        return [str(v) for v in value] if isinstance(value, list) else None

    def reset(self, task: Task) -> EnvReset:
        self._reset_started()
        index = self.check_index(task.split, task.index)
        seed = index if task.split == "train" else self.test_seed_offset + index
        try:
            result = self._call("reset", seed=seed, episode_id=task.id)
        except (ConnectionError, OSError, RuntimeError) as e:  # a session broken between episodes: no episode lost,
            if "VALIDATION_ERROR" in str(e):  # so one more try on a new session (a restarted local server)
                raise
            result = self._call("reset", seed=seed, episode_id=task.id)
        self._reward, self._success = 0.0, False
        self._episode_started()
        obs = result.observation or {}
        self._last_admissible = self._admissible(obs)
        return EnvReset(observation=self._text(obs), admissible_actions=self._last_admissible,
                        info={"seed": seed, **({"tools": self.tools} if self.tools else {})})

    def _action(self, action: str) -> tuple[dict | None, str]:
        """The action payload, or None and the harness text of a refusal."""
        if self.action_format == "native":
            a = read_action(action)
            if a.kind == "call" and a.name == self._tool["function"]["name"]:
                return a.arguments, ""
            return None, refusal_notice(a.text if a.kind == "refused" else "answer with a call of the tool "
                                        f"{self._tool['function']['name']}")
        text = action.strip()
        if self._field is not None:
            kind = self._tool["function"]["parameters"]["properties"][self._field].get("type", "string")
            try:
                value = text if kind == "string" else json.loads(text)
            except json.JSONDecodeError:
                return None, f"[Invalid action: {self._field} must be of type {kind}, got {text[:40]!r}.]"
            args = {self._field: value}
        else:
            try:
                args = json.loads(text)
            except json.JSONDecodeError as e:
                return None, f"[Invalid action: not a JSON object ({e.msg}).]"
        problem = check_call(self._tool["function"]["name"], args, [self._tool]) if isinstance(args, dict) else "not an object"
        return (None, f"[Invalid action: {problem}.]") if problem else (args, "")

    def step(self, action: str) -> EnvStep:
        self._step_started()
        refused = unencodable(action)
        payload, harness = (None, refused) if refused else self._action(action)
        obs, reward, done, valid = "", 0.0, False, payload is not None
        admissible = self._last_admissible
        if payload is not None:
            try:
                result = self._call("step", payload)
            except RuntimeError as e:
                if "VALIDATION_ERROR" not in str(e):
                    raise
                valid, harness = False, "[Invalid action: the server refused it (validation error).]"
            else:
                data = result.observation or {}
                obs, reward, done = self._text(data), float(result.reward or 0.0), bool(result.done)
                admissible = self._last_admissible = self._admissible(data)
                if self.success_field is not None:
                    self._success = bool(data.get(self.success_field))
        self._reward += reward
        success = done and (self._success if self.success_field is not None else reward >= self.success_reward)
        timeout = self._step_ended(done)
        return EnvStep(observation=obs, reward=reward, done=done or timeout, valid=valid, success=success,
                       score=self._reward, harness=harness, admissible_actions=admissible, info={"timeout": timeout})

    def example_actions(self) -> list[str]:
        """Admissible actions where the observation lists them (the tiny model's warm start)."""
        return list(self._last_admissible or [])

    def close(self) -> None:
        self._drop()
        self._no_episode()
