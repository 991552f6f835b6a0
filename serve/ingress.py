"""raypo's ingress: Ray's OpenAI router (ray.serve.llm) plus `/health` and an optional API key.

Ray's `build_openai_app` takes no extra routes or middleware, so `build_ingress` wires the
same pieces it does (an LLMServer deployment behind `OpenAiIngress`) around a subclass with
`/health` and `/versions` routes, a FastAPI app that checks `Authorization: Bearer <key>`,
and a `Versions` deployment (serve/versions.py) that says which policy version is live.
The key is read inside the ingress replica, from RAYPO_API_KEY or from a file, so it never
travels in a command line or a deployment config.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import os
import time
from pathlib import Path

from ray.llm._internal.serve.core.ingress.ingress import DEFAULT_ENDPOINTS, OpenAiIngress, init, make_fastapi_ingress

API_KEY_ENV = "RAYPO_API_KEY"
HEALTH_TIMEOUT_S = 5.0  # /health answers within this, well inside a client's usual timeout
LIVE_CACHE_S = 1.0  # how stale the ingress's idea of the live version may be


def read_api_key(key_file: str | None) -> str | None:
    """The API key from RAYPO_API_KEY, else from `key_file`; None means no key is required."""
    key = os.environ.get(API_KEY_ENV)
    if not key and key_file:
        key = Path(key_file).expanduser().read_text().strip()
    return key or None


def openai_error(status: int, message: str, kind: str):
    from fastapi.responses import JSONResponse

    return JSONResponse({"error": {"message": message, "type": kind, "code": status}}, status_code=status)


CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")
NEEDS_CONTENT = ("system", "developer", "user", "tool")  # an assistant turn may carry tool calls instead


def chat_messages_problem(body) -> str | None:
    """What is wrong with a chat request's `messages` under the OpenAI schema (each a {role,
    content} object, content a string or a list of typed parts), naming the field; None if nothing.

    >>> chat_messages_problem({"messages": [{"role": "user", "content": "hi"}]}) is None
    True
    >>> chat_messages_problem({"messages": [{"role": "wizard"}]})
    "messages[0].role: 'wizard' is not one of system, developer, user, assistant, tool"
    >>> chat_messages_problem({"messages": [{"role": "system", "content": "be brief"}, {"role": "user"}]})
    "messages[1].content: required for role 'user'"
    """
    messages = body.get("messages") if isinstance(body, dict) else None
    if not isinstance(messages, list) or not messages:
        return "messages: must be a non-empty list of {role, content} objects"
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            return f"{where}: must be an object with role and content, got {type(message).__name__}"
        role, content = message.get("role"), message.get("content")
        if role not in CHAT_ROLES:
            return f"{where}.role: {role!r} is not one of {', '.join(CHAT_ROLES)}"
        if content is None and (role in NEEDS_CONTENT or not message.get("tool_calls")):
            return f"{where}.content: required for role {role!r}"
        if content is not None and not isinstance(content, str | list):
            return f"{where}.content: must be a string or a list of content parts, got {type(content).__name__}"
        if isinstance(content, list) and not all(isinstance(part, dict) and "type" in part for part in content):
            return f"{where}.content: each part must be an object with a type (e.g. {{type: text, text: ...}})"
    return None


OPEN_PATHS = ("/health", "/-/healthz", "/-/routes")  # answered without the key


class RequestChecks:
    """The API key check and the chat schema check, as a plain ASGI middleware: Starlette's
    `@app.middleware("http")` would run every request through a task group and memory streams.

    A chat request's body is read here and handed on unchanged (the router reads it again)."""

    def __init__(self, app, key_file: str | None):
        self.app = app
        self.key_file = key_file

    async def __call__(self, scope, receive, send):
        if scope["type"] not in ("http", "websocket"):
            return await self.app(scope, receive, send)
        expected = read_api_key(self.key_file)
        if expected and scope["path"] not in OPEN_PATHS:
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, f"Bearer {expected}".encode()):
                if scope["type"] == "websocket":  # closed before it is accepted: the client sees 403
                    return await send({"type": "websocket.close", "code": 1008, "reason": "missing or wrong API key"})
                error = openai_error(401, "missing or wrong API key (Authorization: Bearer ...)", "invalid_request_error")
                return await error(scope, receive, send)
        if scope.get("method") == "POST" and scope["path"] == "/v1/chat/completions":
            # Checked here, before the engine: it would otherwise answer a message with no content.
            body, more = b"", True
            while more:
                message = await receive()
                if message["type"] == "http.disconnect":
                    return  # the client left: nothing to answer
                body, more = body + message.get("body", b""), message.get("more_body", False)
            try:
                problem = chat_messages_problem(json.loads(body))
            except ValueError:
                problem = None  # not JSON: the router's own 400 names that
            if problem:
                return await openai_error(400, problem, "invalid_request_error")(scope, receive, send)
            receive = _replay(body, receive)
        return await self.app(scope, receive, send)


def _replay(body: bytes, receive):
    """An ASGI `receive` that gives `body` once, then what `receive` gives (a disconnect)."""
    sent = False

    async def replayed():
        nonlocal sent
        if sent:
            return await receive()
        sent = True
        return {"type": "http.request", "body": body, "more_body": False}

    return replayed


def make_fastapi_app(key_file: str | None):
    """Ray's router app (its middleware: errors, CORS, metrics, request ids) plus the key check."""
    from starlette.exceptions import HTTPException

    app = init()

    @app.exception_handler(HTTPException)
    async def openai_style_http_error(request, exc):  # e.g. an unknown model: OpenAI's body, not FastAPI's
        return openai_error(exc.status_code, str(exc.detail), "invalid_request_error")

    app.add_middleware(RequestChecks, key_file=key_file)
    return app


class RaypoIngress(OpenAiIngress):
    """Ray's OpenAI router that sends the public model id to the live policy version."""

    def __init__(self, *args, versions, **kwargs):
        super().__init__(*args, **kwargs)
        self._versions = versions  # handle to the Versions deployment (serve/versions.py)
        self._live: dict | None = None
        self._live_read_at = 0.0

    async def _refresh_live(self) -> None:
        if time.monotonic() - self._live_read_at > LIVE_CACHE_S:
            self._live = await self._versions.live.remote()
            self._live_read_at = time.monotonic()

    def _live_handles(self):
        from serve.versions import version_handles

        return version_handles(self._live["deployment"], self._live["app"])

    async def _get_model_id(self, model):
        model_id = await super()._get_model_id(model)
        await self._refresh_live()  # every request asks for its model id before its handle
        return model_id

    def _get_configured_serve_handle(self, model_id: str):
        if model_id in self._default_serve_handles:
            return self._live_handles().stream
        return super()._get_configured_serve_handle(model_id)

    async def health(self):
        """200 when the live version's engine answers a health check and a prompt in time, else 503."""
        from serve.versions import probe

        started = time.monotonic()
        try:
            await asyncio.wait_for(self._refresh_live(), timeout=HEALTH_TIMEOUT_S)
        except TimeoutError:
            return openai_error(503, f"version table not answering within {HEALTH_TIMEOUT_S:g}s", "service_unavailable")
        left = max(HEALTH_TIMEOUT_S - (time.monotonic() - started), 0.5)
        problem = await probe(self._live_handles(), next(iter(self._model_cards)), left)
        return health_answer(problem, sorted(self._model_cards), self._live["name"])

    async def versions(self):
        """The version table: live, previous, failed and rolled-back versions, recent events."""
        return await self._versions.status.remote()


def health_answer(problem: str | None, models: list[str], version: str):
    """`/health`'s answer in both serving modes: 503 naming what the probe found, else the
    models and the live version."""
    from fastapi.responses import JSONResponse

    if problem:
        return openai_error(503, f"model not answering: {problem}", "service_unavailable")
    return JSONResponse({"status": "ok", "models": models, "version": version})


def ingress_deployment(key_file: str | None):
    """The ingress class as a Serve deployment (routes, key check), options still to set."""
    from ray import serve

    endpoints = {
        **DEFAULT_ENDPOINTS,
        "health": lambda app: app.get("/health"),
        "versions": lambda app: app.get("/versions"),
    }
    ingress_cls = make_fastapi_ingress(RaypoIngress, endpoint_map=endpoints, app=make_fastapi_app(key_file))
    return serve.deployment(ingress_cls, name="RaypoIngress")
