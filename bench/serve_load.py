"""Bounded HTTP load against `raypo serve` and a plain `vllm serve`, side by side.

    .venv/bin/python bench/serve_load.py --checkpoint runs/grpo_tiny/final [--requests 400 --concurrency 16 --rounds 3]

Both serve the same checkpoint on loopback, each started as a user starts it (`raypo serve`,
`python -m vllm.entrypoints.openai.api_server`) and stopped by its process group. Each gets a
warm-up load, then `--rounds` loads of the same fixed number of completion requests (short
arithmetic prompts, greedy, 4 tokens) from `--concurrency` clients; the table shows each
server's median-round QPS and the p50/p99 latency over every measured request, and the ratio
raypo / vLLM. The seeds' targets (p99 < 500 ms, >= 200 QPS per GPU) are for GPUs; on a CPU
machine read the ratio. Loops are bounded by request count and a deadline, and only 127.0.0.1
is ever contacted.
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


def measure(start, checkpoint: str, args) -> dict:
    """Start a server, warm it up, run `args.rounds` loads; the median round's QPS and the
    latency percentiles over every measured request."""
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
    latencies = sorted(x for r in rounds for x in r["latencies"])
    return {
        "ok": sum(r["ok"] for r in rounds),
        "errors": sum(r["errors"] for r in rounds),
        "qps": statistics.median(r["qps"] for r in rounds),
        "qps_rounds": [r["qps"] for r in rounds],
        "p50_ms": percentile_ms(latencies, 0.50),
        "p99_ms": percentile_ms(latencies, 0.99),
    }


def main() -> None:
    import logging

    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request would drown the table
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", required=True)
    parser.add_argument("--requests", type=int, default=400)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3, help="measured loads per server (the table shows the median QPS)")
    parser.add_argument("--warmup", type=int, default=64, help="requests sent before the measured rounds")
    parser.add_argument("--with-proxy", action="store_true", help="also measure `raypo serve --proxy` (Serve's proxy actor)")
    parser.add_argument("--own-session", action="store_true", help="start each server in a session of its own (see `group`)")
    parser.add_argument("--deadline", type=float, default=120.0, help="seconds each load may run at most")
    args = parser.parse_args()
    checkpoint = str(Path(args.checkpoint).resolve())
    results = {"raypo serve": measure(start_raypo, checkpoint, args)}
    results["raypo --engine-ingress"] = measure(start_raypo_engine_ingress, checkpoint, args)
    if args.with_proxy:
        results["raypo --proxy"] = measure(start_raypo_proxy, checkpoint, args)
    results["vllm serve"] = measure(start_vllm, checkpoint, args)
    print(
        f"\n{args.rounds} rounds of {args.requests} completions after {args.warmup} to warm up, "
        f"{args.concurrency} concurrent clients, loopback, servers in {'their own' if args.own_session else 'this'} session"
    )
    print(f"\n{'server':<24}{'ok':>6}{'errors':>8}{'QPS':>8}{'QPS by round':>22}{'p50 ms':>9}{'p99 ms':>9}")
    for name, r in results.items():
        rounds = " ".join(f"{q:.0f}" for q in r["qps_rounds"])
        print(f"{name:<24}{r['ok']:>6}{r['errors']:>8}{r['qps']:>8.1f}{rounds:>22}{r['p50_ms']:>9.1f}{r['p99_ms']:>9.1f}")
    vllm = results["vllm serve"]
    for name, r in results.items():
        if name != "vllm serve":
            print(
                f"{name} / vllm serve: QPS {r['qps'] / vllm['qps']:.2f}x, p50 {r['p50_ms'] / vllm['p50_ms']:.2f}x, "
                f"p99 {r['p99_ms'] / vllm['p99_ms']:.2f}x"
            )


if __name__ == "__main__":
    main()
