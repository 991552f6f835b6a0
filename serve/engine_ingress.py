"""`raypo serve --engine-ingress`: the engine's replica answers HTTP itself, as `vllm serve` does.

The default app passes every request through two Serve replicas: the ingress (HTTP, Ray's
OpenAI router, the version table) and then the version's LLMServer (tokenizing, vLLM's front
end), a process hop each way. Here the LLMServer is the application's ingress: its routes are
vLLM's own OpenAI server, built inside the replica once the engine is up (Ray Serve's late-bound
ASGI ingress, the app Ray's "direct streaming" mode uses), plus raypo's API-key and chat-schema
checks (serve/ingress.py) and raypo's `/health`. One policy version and no version table, so
`raypo serve promote` and `rollback` refuse (serve/ops.py); errors are vLLM's OpenAI-style ones.
"""

from __future__ import annotations

import os

from ray.llm._internal.serve.core.server.llm_server import _add_middleware_to_built_app

from serve.engine import OneProcessLLMServer
from serve.ingress import HEALTH_TIMEOUT_S, RequestChecks, health_answer
from serve.versions import probe_calls

KEY_FILE_ENV = "RAYPO_API_KEY_FILE"  # the replica's runtime env names the key file, never the key


class EngineIngress(OneProcessLLMServer):
    """An LLMServer whose HTTP app is vLLM's OpenAI server plus raypo's checks and `/health`."""

    async def __serve_build_asgi_app__(self):
        app = await super().__serve_build_asgi_app__()
        app.add_api_route("/health", self.health, methods=["GET"])
        app.router.routes.insert(0, app.router.routes.pop())  # ahead of vLLM's own /health, which stays unreachable
        # Outermost, so a request without the key is turned away before vLLM parses it.
        _add_middleware_to_built_app(app, RequestChecks, key_file=os.environ.get(KEY_FILE_ENV))
        return app

    async def health(self):
        """200 when the engine answers a health check and a one-token prompt in time, else 503
        (the default app's `/health`, for its one version)."""

        async def completions(request):  # LLMServer.completions is a coroutine that returns the chunks
            async for chunk in await self.completions(request, None):
                yield chunk

        model_id = self._llm_config.model_id
        problem = await probe_calls(self.check_health, completions, model_id, HEALTH_TIMEOUT_S)
        return health_answer(problem, [model_id], "v1")
