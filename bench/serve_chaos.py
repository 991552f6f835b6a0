"""The Serve app under steady load through its operations and a fault: promote a new version,
roll it back, kill the live replica's process; requests sent, failed and p99 for each.

    .venv/bin/python bench/serve_chaos.py --checkpoint runs/grpo_tiny/final [--concurrency 4]

One local Ray sized from this machine serves `--checkpoint` (the app `raypo serve` runs) on
loopback. A steady load of short greedy completions runs throughout from `--concurrency`
clients. Then, each after a quiet window: `promote` of a copy of the checkpoint as the next
version (a second engine comes up, passes the health gate and takes the traffic), `rollback`
to the first, and SIGKILL to the process of the live version's engine replica. A request
counts against the event whose window (from the event's start to `--settle` seconds after it
returned) it started in or was in flight at the start of; failed = a non-2xx answer or a broken
connection. After the kill the bench waits for the first request sent after it to succeed (Serve
starts a replacement replica) and reports that wait as the recovery time; with
`--min-replicas 2` the surviving replica takes the traffic meanwhile.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import NamedTuple

import httpx
import psutil

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from serve_load import PROMPTS, free_port, wait_ready  # noqa: E402 (the bench's own helpers, run from a checkout)


class Record(NamedTuple):
    """One request: when it was sent and answered, whether it succeeded, what the client saw if not."""

    start: float
    end: float
    ok: bool
    why: str


class Load:
    """Steady completions from `concurrency` clients in a thread of its own, every request kept."""

    def __init__(self, base: str, concurrency: int):
        self.base, self.concurrency = base, concurrency
        self.records: list[Record] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=lambda: asyncio.run(self._run()), daemon=True)

    async def _run(self) -> None:
        async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=self.concurrency)) as client:
            await asyncio.gather(*(self._worker(client, i) for i in range(self.concurrency)))

    async def _worker(self, client: httpx.AsyncClient, i: int) -> None:
        n = i
        while not self.stop.is_set():
            body = {"model": "raypo-policy", "prompt": PROMPTS[n % len(PROMPTS)], "max_tokens": 4, "temperature": 0}
            t0 = time.monotonic()
            try:
                response = await client.post(f"{self.base}/v1/completions", json=body)
                ok, why = response.status_code == 200, f"HTTP {response.status_code}"
            except httpx.HTTPError as e:
                ok, why = False, type(e).__name__
            self.records.append(Record(t0, time.monotonic(), ok, "" if ok else why))
            n += self.concurrency

    def first_ok_after(self, start: float, deadline_s: float) -> float | None:
        """Seconds from `start` until a request sent after it succeeded (None past the deadline)."""
        while time.monotonic() - start < deadline_s:
            done = [r.end for r in list(self.records) if r.start >= start and r.ok]
            if done:
                return min(done) - start
            time.sleep(0.5)
        return None

    def window(self, start: float, end: float, event: bool) -> dict:
        """An event's requests: sent in [start, end) or in flight at `start`; a steady window's:
        sent and answered inside it."""
        if event:
            inside = [r for r in self.records if start <= r.start < end or r.start < start < r.end]
        else:
            inside = [r for r in self.records if start <= r.start and r.end <= end]
        latencies = sorted(r.end - r.start for r in inside if r.ok)
        p99 = latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))] * 1000 if latencies else float("nan")
        worst = latencies[-1] * 1000 if latencies else float("nan")
        failed = [r for r in inside if not r.ok]
        return {"sent": len(inside), "failed": failed, "p99_ms": p99, "max_ms": worst}


def live_replica_pid(app: str) -> int:
    """The process of the engine replica (LLMServer) of Serve application `app`."""
    for proc in psutil.process_iter(["pid", "cmdline"]):
        line = " ".join(proc.info["cmdline"] or [])
        if "ServeReplica" in line and f"{app}:" in line and "LLM" in line:
            return proc.info["pid"]
    raise LookupError(f"no engine replica process of application {app!r}")


def main() -> int:
    import logging

    import ray
    from ray import serve

    from serve import ops
    from serve.app import build_app

    logging.getLogger("httpx").setLevel(logging.WARNING)
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", required=True)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--cpus-per-replica", type=float, default=0.5)
    parser.add_argument("--quiet", type=float, default=15.0, help="seconds of steady load before each event")
    parser.add_argument("--settle", type=float, default=15.0, help="seconds after an event still counted against it")
    parser.add_argument("--min-replicas", type=int, default=1, help="engine replicas per version")
    parser.add_argument("--recovery-timeout", type=float, default=300.0, help="most seconds to wait for a replacement")
    args = parser.parse_args()
    checkpoint = str(Path(args.checkpoint).resolve())
    second = Path(tempfile.mkdtemp(prefix="raypo-serve-chaos-")) / "v2"
    shutil.copytree(checkpoint, second)  # the "new version": the same weights under another path
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    ray.init(include_dashboard=False, log_to_driver=False)  # sized from this machine
    spans: dict[str, tuple[float, float, str]] = {}  # window -> (start, end, detail)
    marks: dict[str, float] = {}  # event -> the moment its fault struck
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        # half a CPU per engine: the promoted version's engine comes up beside the live one on 2 cores
        app_args = {
            "checkpoint": checkpoint, "max_model_len": 128, "cpus_per_replica": args.cpus_per_replica,
            "min_replicas": args.min_replicas, "max_replicas": args.min_replicas,
        }  # fmt: skip
        serve.run(build_app(app_args), name=ops.FRONT_APP, route_prefix="/")
        asyncio.run(wait_ready(base, "raypo-policy", 300))
        load = Load(base, args.concurrency)
        load.thread.start()

        def event(name: str, action, recovery: bool = False) -> None:
            time.sleep(args.quiet)
            spans[f"steady (before {name})"] = (time.monotonic() - args.quiet, time.monotonic(), "")
            started = time.monotonic()
            detail = action()
            if recovery:  # Serve replaces the dead replica; requests sent meanwhile wait for it or another one
                waited = load.first_ok_after(marks[name], args.recovery_timeout)
                detail += f"; first request sent after it answered in {waited:.1f} s" if waited is not None else "; none answered"
            time.sleep(args.settle)
            spans[name] = (started, time.monotonic(), detail)

        event("promote", lambda: ops.promote(str(second), ready_timeout_s=300, log=lambda _: None)["live"])
        event("rollback", lambda: ops.rollback()["live"])
        live_app = next(v["app"] for v in ops.status()["versions"] if v["state"] == "live")

        def kill_live_replica() -> str:
            os.kill(live_replica_pid(live_app), signal.SIGKILL)
            marks["replica kill"] = time.monotonic()  # the recovery wait and "in flight" count from here
            return f"{live_app}'s replica killed"

        event("replica kill", kill_live_replica, recovery=True)
        time.sleep(args.quiet)
        spans["steady (after)"] = (time.monotonic() - args.quiet, time.monotonic(), "")
        load.stop.set()
        load.thread.join(timeout=150)
    finally:
        serve.shutdown()
        ray.shutdown()
        shutil.rmtree(second.parent, ignore_errors=True)
    rows = {
        name: load.window(start, end, not name.startswith("steady")) | {"detail": detail}
        for name, (start, end, detail) in spans.items()
    }
    print(f"\nsteady load: {args.concurrency} clients, 4-token greedy completions, loopback, "
          f"{args.min_replicas} engine replica(s) of {args.cpus_per_replica:g} CPU per version")  # fmt: skip
    print(f"{'window':<30}{'sent':>7}{'failed':>8}{'in flight at start':>20}{'p99 ms':>9}{'max ms':>9}  detail")
    for name, r in rows.items():
        start = spans[name][0]
        in_flight = sum(rec.start < start < rec.end for rec in load.records)
        why = sorted({rec.why for rec in r["failed"]})
        detail = "; ".join(filter(None, [r["detail"], f"failed: {', '.join(why)}" if why else ""]))
        print(f"{name:<30}{r['sent']:>7}{len(r['failed']):>8}{in_flight:>20}{r['p99_ms']:>9.0f}{r['max_ms']:>9.0f}  {detail}")
    killed_at = marks["replica kill"]
    lost = rows["replica kill"]["failed"]
    in_flight_at_kill = [rec for rec in load.records if rec.start < killed_at < rec.end]
    only_in_flight = all(rec.start < killed_at for rec in lost)  # each failure was sent before the kill
    verdict = "every failure was in flight at the kill" if only_in_flight else "requests sent after the kill failed too"
    print(f"\nreplica kill: {len(lost)} failed, of {len(in_flight_at_kill)} in flight at the kill; {verdict}")
    return 0 if not rows["promote"]["failed"] and not rows["rollback"]["failed"] and only_in_flight else 1


if __name__ == "__main__":
    sys.exit(main())
