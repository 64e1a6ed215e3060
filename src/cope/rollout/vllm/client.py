"""Token-id completions against a vLLM OpenAI-compatible server, every request of a turn in flight at once.

Token-in/token-out: a prompt goes to ``/v1/completions`` as its list of ids; the server answers with the
sampled ids (``return_token_ids``) and their log-probs (``logprobs=1``: the sampled token's own log-prob
under the distribution it was drawn from when the server runs with ``--logprobs-mode processed_logprobs``,
as a managed one does: temperature and top-p applied); nothing is decoded and re-encoded here. One
request per live episode, all sent together on an asyncio loop, so the server's continuous batching
sees the whole turn at once (and its prefix cache the shared multi-turn prefixes).

Stdlib only (asyncio streams and HTTP/1.1 with ``Connection: close``): no client dependency, and
nothing from vLLM, which lives in its own venv. Two error kinds, because recovery differs:
:class:`ServerError` (no answer, a reset connection, a timeout, a 5xx: the server may be dead) and
:class:`RequestError` (a 4xx: this request is wrong, the server is fine).
"""
from __future__ import annotations

import asyncio
import json
import ssl
import threading
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit


class ServerError(RuntimeError):
    """The server did not answer properly (connection refused or reset, timeout, HTTP 5xx)."""


class RequestError(RuntimeError):
    """The server refused this request (HTTP 4xx); the message carries its reason."""


@dataclass
class Completion:
    """One sampled continuation: its ids exactly as the server returned them and their log-probs."""

    ids: list[int]
    logprobs: list[float]
    finish_reason: str  # "stop" (an end-of-turn id was sampled) or "length" (the token cap)


def _run(coro):
    """Run a coroutine to completion from sync code, also when this thread already runs an event loop."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    box: dict[str, Any] = {}

    def target():
        try:
            box["out"] = asyncio.run(coro)
        except BaseException as e:  # noqa: B036 - handed back to the caller's thread
            box["err"] = e

    t = threading.Thread(target=target, daemon=True)
    t.start()
    t.join()
    if "err" in box:
        raise box["err"]
    return box["out"]


def _dechunk(body: bytes) -> bytes:
    out, i = bytearray(), 0
    while True:
        j = body.index(b"\r\n", i)
        size = int(body[i:j].split(b";")[0], 16)
        if size == 0:
            return bytes(out)
        out += body[j + 2: j + 2 + size]
        i = j + 2 + size + 2


class Client:
    """HTTP client of one server.

    Args:
        url: ``http://host:port`` (``https`` works too) of the server, optionally with a path prefix.
        timeout_s: deadline of one request, connection included.
        api_key: sent as a bearer token when the server was started with ``--api-key``.
    """

    def __init__(self, url: str, timeout_s: float = 300.0, api_key: str | None = None):
        u = urlsplit(url.rstrip("/"))
        if u.scheme not in ("http", "https") or not u.hostname:
            raise ValueError(f"vLLM server url must look like http://host:port, got {url!r}")
        self.url, self.timeout_s, self.api_key = url.rstrip("/"), timeout_s, api_key
        self.host, self.prefix = u.hostname, u.path
        self.port = u.port or (443 if u.scheme == "https" else 80)
        self.ssl = ssl.create_default_context() if u.scheme == "https" else None

    # -- one request ------------------------------------------------------------------------------
    async def _http(self, method: str, path: str, payload: Any = None) -> tuple[int, bytes]:
        body = None if payload is None else json.dumps(payload).encode()
        reader, writer = await asyncio.open_connection(self.host, self.port, ssl=self.ssl)
        try:
            head = [f"{method} {self.prefix}{path} HTTP/1.1", f"Host: {self.host}:{self.port}", "Connection: close",
                    "Accept: application/json"]
            if self.api_key:
                head.append(f"Authorization: Bearer {self.api_key}")
            if body is not None:
                head += ["Content-Type: application/json", f"Content-Length: {len(body)}"]
            writer.write(("\r\n".join(head) + "\r\n\r\n").encode() + (body or b""))
            await writer.drain()
            raw = await reader.read()  # Connection: close: the response ends at EOF
        finally:
            writer.close()
        if not raw:
            raise ConnectionResetError("empty response")
        header, _, rest = raw.partition(b"\r\n\r\n")
        lines = header.decode("latin-1").split("\r\n")
        status = int(lines[0].split()[1])
        headers = {k.strip().lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:])}
        if headers.get("transfer-encoding", "").lower() == "chunked":
            rest = _dechunk(rest)
        return status, rest

    async def _call(self, method: str, path: str, payload: Any = None, timeout_s: float | None = None) -> Any:
        try:
            status, body = await asyncio.wait_for(self._http(method, path, payload), timeout_s or self.timeout_s)
        except (OSError, asyncio.TimeoutError, ValueError, IndexError) as e:
            raise ServerError(f"{method} {self.url}{path}: {type(e).__name__}: {e}") from e
        text = body.decode("utf-8", "replace")
        if status >= 400:
            try:  # vLLM's error body: {"error": {"message": ...}} (older: {"message": ...})
                err = json.loads(text)
                msg = (err.get("error") or err).get("message", text) if isinstance(err, dict) else text
            except ValueError:
                msg = text
            kind = ServerError if status >= 500 else RequestError
            raise kind(f"{method} {self.url}{path}: HTTP {status}: {str(msg).strip()[:500]}")
        if not text.strip():
            return None
        try:
            return json.loads(text)
        except ValueError:  # e.g. /v1/load_lora_adapter answers in plain text
            return text

    def get(self, path: str, timeout_s: float | None = None) -> Any:
        return _run(self._call("GET", path, timeout_s=timeout_s))

    def post(self, path: str, payload: Any, timeout_s: float | None = None) -> Any:
        return _run(self._call("POST", path, payload, timeout_s=timeout_s))

    def healthy(self, timeout_s: float = 5.0) -> bool:
        """The server answers ``/health`` with 200."""
        try:
            self.get("/health", timeout_s=timeout_s)
            return True
        except (ServerError, RequestError):
            return False

    # -- completions ------------------------------------------------------------------------------
    def complete(self, requests: list[dict]) -> list[Completion | Exception]:
        """Send every ``/v1/completions`` body at once; per request a :class:`Completion` or the error it got."""

        async def all_at_once():
            return await asyncio.gather(*(self._call("POST", "/v1/completions", r) for r in requests), return_exceptions=True)

        out: list[Completion | Exception] = []
        for r in _run(all_at_once()):
            if isinstance(r, (ServerError, RequestError)):
                out.append(r)
            elif isinstance(r, BaseException):
                raise r
            else:
                try:
                    out.append(parse_completion(r))
                except (KeyError, IndexError, TypeError, ValueError) as e:
                    out.append(RequestError(f"unexpected /v1/completions answer ({type(e).__name__}: {e}): {str(r)[:300]}"))
        return out


def parse_completion(body: dict) -> Completion:
    """The first choice of a ``/v1/completions`` answer sent with ``return_token_ids`` and ``logprobs=1``."""
    choice = body["choices"][0]
    ids = [int(t) for t in choice["token_ids"]]
    lps = [float(x) for x in choice["logprobs"]["token_logprobs"]]
    if len(lps) != len(ids):
        raise ValueError(f"{len(ids)} token ids but {len(lps)} log-probs")
    return Completion(ids=ids, logprobs=lps, finish_reason=str(choice.get("finish_reason")))


def prompt_logprobs(body: dict, ids: list[int]) -> list[float]:
    """log p(ids[t] | ids[<t]) for t >= 1 from an answer sent with ``prompt_logprobs=0``."""
    entries = body["choices"][0]["prompt_logprobs"]
    return [float(entries[t][str(ids[t])]["logprob"]) for t in range(1, len(ids))]
