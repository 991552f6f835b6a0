"""Policy versions behind one endpoint: blue-green promotion, health checks, rollback.

The `Versions` deployment (one replica, in the front application) knows every version of the
policy: the one that takes traffic (`live`), the one before it (`previous`, kept for
rollback), and those that failed. Each version is one LLMServer deployment: the first lives in
the front application, each promoted one in an application of its own (`raypo-v2`, ...).

A health check asks a version's engine for its health and for a one-token completion, with a
timeout. `promote` switches traffic only after a candidate passes `gate_checks` checks in a
row; afterwards a watch loop checks the live version every `check_interval_s` and, after
`failures_to_rollback` failed checks in a row, sends traffic back to the previous version by
itself. The ingress reads which version is live from here (cached for a second).
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections import deque
from typing import Literal, NamedTuple

from pydantic import BaseModel, Field

State = Literal["live", "previous", "standby", "failed", "rolled_back", "retired"]
PROBE_PROMPT = "1+1="


class VersionRecord(BaseModel):
    name: str
    checkpoint: str
    app: str = Field(description="the Serve application holding this version's LLMServer")
    deployment: str = Field(description="the LLMServer deployment's name in that application")
    state: State = "standby"
    created: float = Field(default_factory=time.time)
    reason: str = ""
    failed_checks_in_a_row: int = 0


class WatchConfig(BaseModel):
    check_interval_s: float = Field(5.0, gt=0, description="seconds between health checks of the live version")
    check_timeout_s: float = Field(10.0, gt=0, description="a check that takes longer fails")
    failures_to_rollback: int = Field(5, ge=1, description="failed checks in a row that roll a promoted version back")
    gate_checks: int = Field(3, ge=1, description="checks in a row a candidate must pass before it takes traffic")


class VersionHandles(NamedTuple):
    plain: object  # DeploymentHandle, for unary calls (check_health)
    stream: object  # the same deployment with stream=True, as OpenAI requests are sent


@functools.cache
def version_handles(deployment: str, app: str) -> VersionHandles:
    """Handles to one version's LLMServer, made once per process: each `.options()` call makes a
    new handle with its own metrics pusher and long poll, so none is made per request or check."""
    from ray import serve

    handle = serve.get_deployment_handle(deployment, app_name=app)
    return VersionHandles(handle, handle.options(stream=True))


async def probe(handles: VersionHandles, model_id: str, timeout_s: float) -> str | None:
    """None when the LLMServer behind `handles` is healthy and completes a prompt, else why not."""
    return await probe_calls(
        handles.plain.check_health.remote, lambda request: handles.stream.completions.remote(request, None), model_id, timeout_s
    )


async def probe_calls(check_health, completions, model_id: str, timeout_s: float) -> str | None:
    """`probe` through two calls: `check_health()` (awaitable) and `completions(request)` (an
    async iterator of an LLMServer's chunks), made on a handle or on the LLMServer itself."""
    from ray.llm._internal.serve.core.configs.openai_api_models import CompletionRequest, ErrorResponse

    async def check():
        await check_health()
        request = CompletionRequest(model=model_id, prompt=PROBE_PROMPT, max_tokens=1, temperature=0.0)
        async for chunk in completions(request):
            first = chunk[0] if isinstance(chunk, list) else chunk
            if isinstance(first, ErrorResponse):
                raise RuntimeError(first.error.message)
            return

    try:
        await asyncio.wait_for(check(), timeout=timeout_s)
    except TimeoutError:
        return f"no answer within {timeout_s:g}s"
    except Exception as err:  # any failure to answer counts as a failed check
        return f"{type(err).__name__}: {err}"[:300]
    return None


class Versions:
    """The version table and its watch loop (a Serve deployment; see the module docstring)."""

    def __init__(self, args: dict, first_deployment: str):
        from ray import serve
        from ray.util.metrics import Counter, Gauge

        self.args = args  # the ServeArgs the first version runs with; candidates reuse them
        self.model_id = args["model_id"]
        self.watch = WatchConfig.model_validate(args.get("watch") or {})
        self.app_name = serve.get_replica_context().app_name
        first = VersionRecord(
            name="v1", checkpoint=args["checkpoint"], app=self.app_name, deployment=first_deployment, state="live"
        )
        self.records: dict[str, VersionRecord] = {first.name: first}
        self.events: deque[str] = deque(maxlen=50)
        self.rollbacks = Counter("raypo_serve_rollbacks", description="automatic and manual rollbacks of the policy version")
        self.failed_checks = Counter("raypo_serve_failed_checks", description="failed health checks of the live version")
        self.live_gauge = Gauge("raypo_serve_live_version", description="number of the live policy version (v<N>)")
        self.live_gauge.set(1)
        self._watcher = asyncio.get_event_loop().create_task(self._watch_forever())

    # -------------------------------------------------------------- queries
    def _named(self, state: State) -> VersionRecord | None:
        return next((r for r in self.records.values() if r.state == state), None)

    async def live(self) -> dict:
        """The live version's name, application and deployment (what the ingress routes to)."""
        return self._named("live").model_dump(include={"name", "app", "deployment"})

    async def status(self) -> dict:
        return {
            "live": self._named("live").name,
            "versions": [r.model_dump() for r in self.records.values()],
            "events": list(self.events),
            "watch": self.watch.model_dump(),
        }

    async def candidate(self) -> dict:
        """The next version's name and the serve arguments it should run with (less the checkpoint)."""
        return {"name": f"v{len(self.records) + 1}", "args": self.args}

    # -------------------------------------------------------------- changes
    def _log(self, message: str) -> None:
        self.events.append(f"{time.strftime('%Y-%m-%d %H:%M:%S')} {message}")

    async def check(self, name: str) -> str | None:
        record = self.records[name]
        return await probe(version_handles(record.deployment, record.app), self.model_id, self.watch.check_timeout_s)

    async def record_failed(self, name: str, checkpoint: str, reason: str) -> dict:
        """Note a candidate that never came up (its deployment failed); traffic is untouched."""
        self.records[name] = VersionRecord(name=name, checkpoint=checkpoint, app="", deployment="", state="failed", reason=reason)
        self._log(f"{name} failed to deploy: {reason}")
        return await self.status()

    async def promote(self, name: str, checkpoint: str, app: str, deployment: str) -> dict:
        """Gate candidate `name` with health checks; on success it takes traffic and the live
        version becomes `previous`. On failure it is marked failed and traffic is untouched."""
        record = VersionRecord(name=name, checkpoint=checkpoint, app=app, deployment=deployment)
        self.records[name] = record
        for i in range(self.watch.gate_checks):
            problem = await self.check(name)
            if problem:
                record.state, record.reason = "failed", f"health check {i + 1}/{self.watch.gate_checks} failed: {problem}"
                self._log(f"{name} not promoted: {record.reason}")
                return await self.status()
        old_previous, old_live = self._named("previous"), self._named("live")
        if old_previous:
            old_previous.state = "retired"
        old_live.state, old_live.failed_checks_in_a_row = "previous", 0
        record.state = "live"
        self.live_gauge.set(int(name.lstrip("v")))
        self._log(f"{name} promoted after {self.watch.gate_checks} passing checks; {old_live.name} kept for rollback")
        return await self.status()

    async def rollback(self, reason: str = "requested") -> dict:
        """Send traffic back to the previous version; the live one becomes `rolled_back`."""
        previous, live = self._named("previous"), self._named("live")
        if previous is None:
            raise ValueError(f"no previous version to roll back to (live is {live.name})")
        live.state, live.reason = "rolled_back", reason
        previous.state, previous.failed_checks_in_a_row = "live", 0
        self.live_gauge.set(int(previous.name.lstrip("v")))
        self.rollbacks.inc()
        self._log(f"rolled back from {live.name} to {previous.name}: {reason}")
        return await self.status()

    async def _watch_once(self) -> None:
        live = self._named("live")
        problem = await self.check(live.name)
        if problem is None:
            live.failed_checks_in_a_row = 0
            return
        live.failed_checks_in_a_row += 1
        self.failed_checks.inc()
        self._log(f"{live.name} failed check {live.failed_checks_in_a_row}/{self.watch.failures_to_rollback}: {problem}")
        if live.failed_checks_in_a_row >= self.watch.failures_to_rollback and self._named("previous"):
            await self.rollback(f"{live.failed_checks_in_a_row} failed health checks in a row; last: {problem}")

    async def _watch_forever(self) -> None:
        while True:
            await asyncio.sleep(self.watch.check_interval_s)
            try:
                await self._watch_once()
            except Exception as err:  # the watch must outlive any one bad check
                self._log(f"watch error: {type(err).__name__}: {err}")

    async def check_health(self) -> None:
        if self._watcher.done():
            raise RuntimeError(f"the version watch loop stopped: {self._watcher.exception()!r}")
