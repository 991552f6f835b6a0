"""Bounded HTTP load against `raypo serve` and a plain `vllm serve`, side by side, interleaved.

    .venv/bin/python bench/serve_load.py --checkpoint runs/grpo_tiny/final [--cycles 3 --rounds 2]
        [--servers raypo engine-ingress proxy vllm]

Each server serves the same checkpoint on loopback, started as a user starts it (`raypo serve`,
`raypo serve --engine-ingress`, `raypo serve --proxy`, `python -m vllm.entrypoints.openai.api_server`)
and stopped by its process group. The servers take turns: in each of `--cycles` cycles every
server is started, warmed up, given `--rounds` loads of the same fixed number of completion
requests (short arithmetic prompts, greedy, 4 tokens) from `--concurrency` clients, and stopped,
in an order that reverses from one cycle to the next (A B C, C B A, ...). The ratio to vLLM is
taken within each cycle, and their geometric mean over an even number of cycles cancels a
steady drift of the machine's speed (this shared one moved 2.7x in an evening), which would
favour whichever server ran first in a one-after-the-other run. The table shows each server's
median-round QPS and the p50/p99 latency over every measured request; below it, each server's
QPS and p99 against `vllm serve` in each cycle, and their geometric mean. The seeds' targets (p99 < 500 ms, >= 200 QPS per
GPU) are for GPUs; on a CPU machine read the ratio. Loops are bounded by request count and a
deadline, and only 127.0.0.1 is ever contacted.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent

PROMPTS = [f"{a}+{b}=" for a in range(10, 30) for b in range(10, 30)]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def wait_ready(base: str, model: str, deadline_s: float) -> None:
    """Poll until a completion succeeds (the engine is up), or fail at the deadline."""
    started = time.monotonic()
    async with httpx.AsyncClient(timeout=10) as client:
        while time.monotonic() - started < deadline_s:
            try:
                r = await client.post(f"{base}/v1/completions", json={"model": model, "prompt": "1+1=", "max_tokens": 2})
                if r.status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            await asyncio.sleep(1)
    raise TimeoutError(f"{base} did not answer within {deadline_s:.0f}s")


async def load(base: str, model: str, requests: int, concurrency: int, deadline_s: float) -> dict:
    latencies: list[float] = []
    errors = 0
    queue: asyncio.Queue[str] = asyncio.Queue()
    for i in range(requests):
        queue.put_nowait(PROMPTS[i % len(PROMPTS)])
    started = time.monotonic()

    async def worker(client: httpx.AsyncClient) -> None:
        nonlocal errors
        while not queue.empty() and time.monotonic() - started < deadline_s:
            prompt = queue.get_nowait()
            t0 = time.monotonic()
            try:
                r = await client.post(
                    f"{base}/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": 4, "temperature": 0}
                )
                ok = r.status_code == 200
            except httpx.HTTPError:
                ok = False
            if ok:
                latencies.append(time.monotonic() - t0)
            else:
                errors += 1

    limits = httpx.Limits(max_connections=concurrency)
    async with httpx.AsyncClient(timeout=60, limits=limits) as client:
        await asyncio.gather(*(worker(client) for _ in range(concurrency)))
    wall = time.monotonic() - started
    return {"ok": len(latencies), "errors": errors, "qps": len(latencies) / wall, "latencies": latencies}


def percentile_ms(latencies: list[float], q: float) -> float:
    """The `q` quantile of sorted `latencies` (seconds), in milliseconds."""
    return latencies[min(len(latencies) - 1, int(q * len(latencies)))] * 1000 if latencies else float("nan")


def group(own_session: bool) -> dict:
    """Popen arguments that give a server its own process group (stopped by `killpg`), in this
    process's session or in a new one. Linux's autogroup scheduler shares the CPUs between
    sessions before it shares them between processes, so a server in a session of its own gets
    half the CPUs against the load generator. On this 2-CPU machine both servers were 2-4x
    slower that way (raypo 69 against 141-157 QPS, vLLM 77 against 220-352); the default keeps
    them in this session."""
    return {"start_new_session": True} if own_session else {"process_group": 0}


def start_vllm(checkpoint: str, port: int, own_session: bool) -> subprocess.Popen:
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1")}
    # `vllm serve` is this module; the `vllm` script itself fails under the vllm-cpu
    # distribution (it looks up package metadata named "vllm").
    cmd = [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        checkpoint,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--served-model-name",
        "raypo-policy",
        "--dtype",
        "float32",
        "--max-model-len",
        "128",
        "--enforce-eager",
    ]
    log = open(Path(os.environ.get("TMPDIR", "/tmp")) / f"raypo-bench-vllm-{port}.log", "w")  # read it if vLLM fails
    return subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, **group(own_session))


def start_raypo_proxy(checkpoint: str, port: int, own_session: bool) -> subprocess.Popen:
    return start_raypo(checkpoint, port, own_session, "--proxy")


def start_raypo_engine_ingress(checkpoint: str, port: int, own_session: bool) -> subprocess.Popen:
    return start_raypo(checkpoint, port, own_session, "--engine-ingress")


def start_raypo(checkpoint: str, port: int, own_session: bool, *extra: str) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}  # its own Ray, as on a fresh machine
    cmd = [sys.executable, "-m", "pipelines.cli", "serve", "--checkpoint", checkpoint, "--host", "127.0.0.1", "--port", str(port)]
    cmd += ["--max-model-len", "128", *extra]
    log = open(Path(os.environ.get("TMPDIR", "/tmp")) / f"raypo-bench-serve-{port}.log", "w")  # read it if it fails
    return subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, **group(own_session))


def stop(proc: subprocess.Popen) -> None:
    """SIGTERM (`raypo serve` then takes Serve and its Ray down), then the whole process group."""
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=90)
    except subprocess.TimeoutExpired:
        pass
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)


def visit(start, checkpoint: str, args) -> dict:
    """Start a server, warm it up, run `args.rounds` loads, stop it: each round's QPS, and every
    measured request's latency."""
    port = free_port()
    proc = start(checkpoint, port, args.own_session)
    try:
        base = f"http://127.0.0.1:{port}"
        asyncio.run(wait_ready(base, "raypo-policy", 300))
        asyncio.run(load(base, "raypo-policy", args.warmup, args.concurrency, args.deadline))
        rounds = [
            asyncio.run(load(base, "raypo-policy", args.requests, args.concurrency, args.deadline)) for _ in range(args.rounds)
        ]
    finally:
        stop(proc)
    return {
        "ok": sum(r["ok"] for r in rounds),
        "errors": sum(r["errors"] for r in rounds),
        "qps_rounds": [r["qps"] for r in rounds],
        "latencies": sorted(x for r in rounds for x in r["latencies"]),
    }


def summary(visits: list[dict]) -> dict:
    """One server's visits together: the median round's QPS, latency percentiles over every request."""
    latencies = sorted(x for v in visits for x in v["latencies"])
    return {
        "ok": sum(v["ok"] for v in visits),
        "errors": sum(v["errors"] for v in visits),
        "qps": statistics.median(q for v in visits for q in v["qps_rounds"]),
        "qps_rounds": [q for v in visits for q in v["qps_rounds"]],
        "p50_ms": percentile_ms(latencies, 0.50),
        "p99_ms": percentile_ms(latencies, 0.99),
    }


SERVERS = {
    "raypo": ("raypo serve", start_raypo),
    "engine-ingress": ("raypo --engine-ingress", start_raypo_engine_ingress),
    "proxy": ("raypo --proxy", start_raypo_proxy),
    "vllm": ("vllm serve", start_vllm),
}


def turns(names: list[str], cycles: int) -> list[tuple[int, str]]:
    """(cycle, server) in the order the bench visits them: forward, then backward, and so on.

    >>> turns(["a", "b"], 3)
    [(0, 'a'), (0, 'b'), (1, 'b'), (1, 'a'), (2, 'a'), (2, 'b')]
    """
    return [(c, name) for c in range(cycles) for name in (names if c % 2 == 0 else names[::-1])]


def main() -> None:
    import logging

    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request would drown the table
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", required=True)
    parser.add_argument("--requests", type=int, default=400)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--cycles", type=int, default=4, help="turns each server gets, in alternating order (even)")
    parser.add_argument("--rounds", type=int, default=2, help="measured loads per turn (the table shows the median QPS)")
    parser.add_argument("--warmup", type=int, default=64, help="requests sent at each turn before the measured rounds")
    parser.add_argument(
        "--servers", nargs="+", choices=list(SERVERS), default=["raypo", "engine-ingress", "vllm"], help="vllm is always measured"
    )
    parser.add_argument("--own-session", action="store_true", help="start each server in a session of its own (see `group`)")
    parser.add_argument("--deadline", type=float, default=120.0, help="seconds each load may run at most")
    args = parser.parse_args()
    checkpoint = str(Path(args.checkpoint).resolve())
    names = list(dict.fromkeys([*args.servers, "vllm"]))
    visits: dict[str, list[dict]] = {name: [] for name in names}
    for cycle, name in turns(names, args.cycles):
        label, start = SERVERS[name]
        visits[name].append(visit(start, checkpoint, args))
        print(f"cycle {cycle}: {label} {' '.join(f'{q:.0f}' for q in visits[name][-1]['qps_rounds'])} QPS", flush=True)
        time.sleep(3)  # the stopped server's last processes let go of the CPUs before the next one starts
    report(visits, args)


def report(visits: dict[str, list[dict]], args) -> None:
    print(
        f"\n{args.cycles} turns each of {args.rounds} rounds of {args.requests} completions after {args.warmup} to warm up, "
        f"{args.concurrency} concurrent clients, loopback, servers in {'their own' if args.own_session else 'this'} session"
    )
    print(f"\n{'server':<24}{'ok':>6}{'errors':>8}{'QPS':>8}{'p50 ms':>9}{'p99 ms':>9}  QPS by round")
    for name, server_visits in visits.items():
        r = summary(server_visits)
        rounds = " ".join(f"{q:.0f}" for q in r["qps_rounds"])
        print(
            f"{SERVERS[name][0]:<24}{r['ok']:>6}{r['errors']:>8}{r['qps']:>8.1f}{r['p50_ms']:>9.1f}{r['p99_ms']:>9.1f}  {rounds}"
        )
    print("\nagainst vllm serve in the same cycle (QPS of the turn's median round; p99 of the turn's requests), geometric mean:")
    ref = visits["vllm"]
    for name, server_visits in visits.items():
        if name == "vllm":
            continue
        pairs = list(zip(server_visits, ref, strict=True))
        qps = [ratio(statistics.median(v["qps_rounds"]), statistics.median(w["qps_rounds"])) for v, w in pairs]
        p99 = [ratio(percentile_ms(v["latencies"], 0.99), percentile_ms(w["latencies"], 0.99)) for v, w in pairs]
        print(
            f"{SERVERS[name][0]:<24} QPS {' '.join(f'{x:.2f}' for x in qps)} ({geomean(qps):.2f}x), "
            f"p99 {' '.join(f'{x:.2f}' for x in p99)} ({geomean(p99):.2f}x)"
        )


def ratio(a: float, b: float) -> float:
    """a / b, NaN where b is 0 or NaN (a turn in which a server answered nothing).

    >>> ratio(1.0, 2.0), ratio(1.0, 0.0)
    (0.5, nan)
    """
    return a / b if b and b == b else float("nan")


def geomean(xs: list[float]) -> float:
    """The geometric mean (NaN if any is NaN or not positive).

    >>> round(geomean([0.5, 2.0]), 6)
    1.0
    """
    return statistics.geometric_mean(xs) if all(x > 0 for x in xs) else float("nan")


if __name__ == "__main__":
    main()
