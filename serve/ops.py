"""Operations on a running raypo Serve app, from a driver: promote, rollback, status.

`promote(checkpoint)` deploys the checkpoint as a new version beside the live one (its own
Serve application, no HTTP route of its own), waits for it to come up, then asks the
`Versions` deployment to gate it with health checks and switch traffic. A candidate that
fails to deploy or fails a gate check is recorded as failed, its application is deleted,
and the live version keeps all traffic.
"""

from __future__ import annotations

import time
from collections.abc import Callable

FRONT_APP = "raypo"


class ServeOpError(RuntimeError):
    """An operation on the Serve app failed; the message names the cause."""


def _engine_ingress_deployment(front_app: str):
    """(the engine deployment's name, the app's Serve status) when `front_app` was started with
    `--engine-ingress` (an app with no version table, serve/engine_ingress.py), else None."""
    from ray import serve

    app = serve.status().applications.get(front_app)
    if app is None or "Versions" in app.deployments:
        return None
    name = next((name for name in app.deployments if name.startswith("EngineIngress")), None)
    return (name, app) if name else None


def _versions(front_app: str):
    """The app's version table, to change it (an `--engine-ingress` app has none: refused)."""
    if _engine_ingress_deployment(front_app):
        raise ServeOpError(
            f"the Serve app {front_app!r} serves one version with no version table (started with --engine-ingress, "
            "the engine answering HTTP itself); restart it without --engine-ingress to promote and roll back"
        )
    return _version_table(front_app)


def _version_table(front_app: str):
    from ray import serve

    try:
        return serve.get_deployment_handle("Versions", app_name=front_app)
    except Exception as err:
        raise ServeOpError(
            f"no raypo Serve app {front_app!r} is running on this Ray cluster ({type(err).__name__}: {err})"
        ) from err


def _wait_running(app: str, timeout_s: float) -> str | None:
    """None once `app` is RUNNING, else why it is not (failed, or still deploying at the deadline)."""
    from ray import serve
    from ray.serve.schema import ApplicationStatus

    deadline = time.monotonic() + timeout_s
    while True:
        state = serve.status().applications.get(app)
        if state is not None and state.status == ApplicationStatus.RUNNING:
            return None
        if state is not None and state.status == ApplicationStatus.DEPLOY_FAILED:
            return f"deploy failed: {state.message}"[:2000]
        if time.monotonic() > deadline:
            return f"not running after {timeout_s:g}s (status {state.status if state else 'missing'})"
        time.sleep(1.0)


def promote(
    checkpoint: str, front_app: str = FRONT_APP, ready_timeout_s: float = 600, log: Callable[[str], None] = print
) -> dict:
    """Bring `checkpoint` up as the next version and switch traffic to it once it passes the
    health gate. Returns the version table; raises ServeOpError when it did not take traffic."""
    from ray import serve

    from serve.app import ServeArgs, version_app

    versions = _versions(front_app)
    candidate = versions.candidate.remote().result()
    name = candidate["name"]
    try:
        args = ServeArgs.model_validate({**candidate["args"], "checkpoint": checkpoint})
    except ValueError as err:
        versions.record_failed.remote(name, checkpoint, str(err)).result()
        raise ServeOpError(f"{name} not deployed: {err}") from err
    app = f"{front_app}-{name}"
    target = version_app(args)
    log(f"deploying {name} from {args.checkpoint} as application {app!r}")
    serve._run(target, name=app, route_prefix=None, _blocking=False)
    problem = _wait_running(app, ready_timeout_s)
    if problem is None:
        table = versions.promote.remote(name, args.checkpoint, app, target._bound_deployment.name).result()
        record = next(r for r in table["versions"] if r["name"] == name)
        problem = None if record["state"] == "live" else record["reason"]
    else:
        table = versions.record_failed.remote(name, args.checkpoint, problem).result()
    if problem is not None:
        serve.delete(app, _blocking=False)
        raise ServeOpError(f"{name} did not take traffic ({problem}); {table['live']} stays live")
    log(f"{name} is live; {table['live']} serves all traffic")
    return table


def rollback(front_app: str = FRONT_APP) -> dict:
    """Send traffic back to the previous version now."""
    try:
        return _versions(front_app).rollback.remote("requested by an operator").result()
    except ValueError as err:
        raise ServeOpError(str(err)) from err


def status(front_app: str = FRONT_APP) -> dict:
    """The version table (live, previous, failed, rolled back) and recent events; for an
    `--engine-ingress` app, its one version."""
    from ray import serve

    if found := _engine_ingress_deployment(front_app):
        engine, app = found
        try:  # the engine answers this beside its requests; a loading or stuck one must not hang `status`
            config = serve.get_deployment_handle(engine, app_name=front_app).llm_config.remote().result(timeout_s=10)
            checkpoint = config.model_loading_config.model_source
        except Exception as err:
            checkpoint = f"(the engine did not say: {type(err).__name__})"
        one = {"name": "v1", "state": "live", "failed_checks_in_a_row": 0, "created": app.last_deployed_time_s}
        one |= {"checkpoint": checkpoint, "reason": "" if app.status == "RUNNING" else f"app {app.status}"}
        return {"live": "v1", "versions": [one], "events": ["started with --engine-ingress: one version, no promote/rollback"]}
    return _version_table(front_app).status.remote().result()  # the Serve status read above found no engine ingress


def format_status(table: dict) -> str:
    """The version table as aligned text lines, for `raypo serve status`."""
    rows = [("VERSION", "STATE", "FAILED CHECKS", "CREATED", "CHECKPOINT", "REASON")]
    for r in table["versions"]:
        created = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(r["created"]))
        rows.append((r["name"], r["state"], str(r["failed_checks_in_a_row"]), created, r["checkpoint"], r["reason"][:80]))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]) - 1)]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row[:-1], widths, strict=False)) + "  " + row[-1] for row in rows]
    return "\n".join(lines + ["", "recent events:"] + [f"  {e}" for e in table["events"][-10:]])
