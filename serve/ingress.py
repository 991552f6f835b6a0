"""raypo's ingress: Ray's OpenAI router (ray.serve.llm) plus `/health` and an optional API key.

Ray's `build_openai_app` takes no extra routes or middleware, so `build_ingress` wires the
same pieces it does (one LLMServer deployment per model behind `OpenAiIngress`) around a
subclass with a health route and a FastAPI app that checks `Authorization: Bearer <key>`.
The key is read inside the ingress replica, from RAYPO_API_KEY or from a file, so it never
travels in a command line or a deployment config.
"""

from __future__ import annotations

import asyncio
import hmac
import os
from pathlib import Path

from ray.llm._internal.common.dict_utils import maybe_apply_llm_deployment_config_defaults
from ray.llm._internal.serve.core.configs.openai_api_models import to_model_metadata
from ray.llm._internal.serve.core.ingress.ingress import DEFAULT_ENDPOINTS, OpenAiIngress, init, make_fastapi_ingress
from ray.llm._internal.serve.core.server.builder import build_llm_deployment

API_KEY_ENV = "RAYPO_API_KEY"
HEALTH_TIMEOUT_S = 10.0


def read_api_key(key_file: str | None) -> str | None:
    """The API key from RAYPO_API_KEY, else from `key_file`; None means no key is required."""
    key = os.environ.get(API_KEY_ENV)
    if not key and key_file:
        key = Path(key_file).expanduser().read_text().strip()
    return key or None


def openai_error(status: int, message: str, kind: str):
    from fastapi.responses import JSONResponse

    return JSONResponse({"error": {"message": message, "type": kind, "code": status}}, status_code=status)


def make_fastapi_app(key_file: str | None):
    """Ray's router app (its middleware: errors, CORS, metrics, request ids) plus the key check."""
    from starlette.exceptions import HTTPException

    app = init()

    @app.exception_handler(HTTPException)
    async def openai_style_http_error(request, exc):  # e.g. an unknown model: OpenAI's body, not FastAPI's
        return openai_error(exc.status_code, str(exc.detail), "invalid_request_error")

    @app.middleware("http")
    async def require_api_key(request, call_next):
        expected = read_api_key(key_file)
        if expected and request.url.path not in ("/health", "/-/healthz", "/-/routes"):
            given = request.headers.get("authorization", "")
            if not hmac.compare_digest(given.encode(), f"Bearer {expected}".encode()):
                return openai_error(401, "missing or wrong API key (Authorization: Bearer ...)", "invalid_request_error")
        return await call_next(request)

    return app


class RaypoIngress(OpenAiIngress):
    async def health(self):
        """200 when every model's engine answers its health check in time, else 503."""
        from fastapi.responses import JSONResponse

        try:
            for handle in self._default_serve_handles.values():
                await asyncio.wait_for(handle.check_health.remote(), timeout=HEALTH_TIMEOUT_S)
        except Exception as err:  # any failure to answer is unhealthy
            return openai_error(503, f"model not answering: {type(err).__name__}: {err}", "service_unavailable")
        return JSONResponse({"status": "ok", "models": sorted(self._model_cards)})


def build_ingress(llm_configs: list, key_file: str | None = None):
    from ray import serve

    endpoints = {**DEFAULT_ENDPOINTS, "health": lambda app: app.get("/health")}
    ingress_cls = make_fastapi_ingress(RaypoIngress, endpoint_map=endpoints, app=make_fastapi_app(key_file))
    options = maybe_apply_llm_deployment_config_defaults(OpenAiIngress.get_deployment_options(llm_configs), None)
    return serve.deployment(ingress_cls, **options).bind(
        llm_deployments={c.model_id: build_llm_deployment(c) for c in llm_configs},
        model_cards={c.model_id: to_model_metadata(c.model_id, c) for c in llm_configs},
        lora_paths={},
    )
