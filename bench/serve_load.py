"""Bounded HTTP load against the raypo Serve app and a plain `vllm serve`, side by side.

    .venv/bin/python bench/serve_load.py --checkpoint runs/grpo_tiny/final [--requests 400 --concurrency 16]

Both serve the same checkpoint on loopback. Each gets the same fixed number of completion
requests (short arithmetic prompts, greedy, 4 tokens) from `--concurrency` clients; the
table shows QPS and p50/p99 latency, and the ratio raypo / vLLM. The seeds' targets (p99 <
500 ms, >= 200 QPS per GPU) are for GPUs; on a CPU machine read the ratio. Loops are
bounded by request count and a deadline, and only 127.0.0.1 is ever contacted.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

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
    latencies.sort()
    p = lambda q: latencies[min(len(latencies) - 1, int(q * len(latencies)))] * 1000 if latencies else float("nan")  # noqa: E731
    return {
        "ok": len(latencies),
        "errors": errors,
        "qps": len(latencies) / wall,
        "p50_ms": p(0.50),
        "p99_ms": p(0.99),
        "mean_ms": statistics.fmean(latencies) * 1000 if latencies else float("nan"),
    }


def start_vllm(checkpoint: str, port: int) -> subprocess.Popen:
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
    return subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def run_raypo(checkpoint: str, port: int, args) -> dict:
    import ray
    from ray import serve

    from serve.app import build_app

    ray.init(include_dashboard=False, log_to_driver=False)  # sized from this machine
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(build_app({"checkpoint": checkpoint, "max_model_len": 128}), name="raypo", route_prefix="/")
        base = f"http://127.0.0.1:{port}"
        asyncio.run(wait_ready(base, "raypo-policy", 300))
        return asyncio.run(load(base, "raypo-policy", args.requests, args.concurrency, args.deadline))
    finally:
        serve.shutdown()
        ray.shutdown()


def run_vllm(checkpoint: str, port: int, args) -> dict:
    proc = start_vllm(checkpoint, port)
    try:
        base = f"http://127.0.0.1:{port}"
        asyncio.run(wait_ready(base, "raypo-policy", 300))
        return asyncio.run(load(base, "raypo-policy", args.requests, args.concurrency, args.deadline))
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=60)


def main() -> None:
    import logging

    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request would drown the table
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", required=True)
    parser.add_argument("--requests", type=int, default=400)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--deadline", type=float, default=120.0, help="seconds each load may run at most")
    args = parser.parse_args()
    checkpoint = str(Path(args.checkpoint).resolve())
    results = {
        "raypo (Ray Serve)": run_raypo(checkpoint, free_port(), args),
        "vllm serve": run_vllm(checkpoint, free_port(), args),
    }
    print(f"\n{args.requests} completions, {args.concurrency} concurrent clients, loopback")
    print(f"{'server':<20}{'ok':>6}{'errors':>8}{'QPS':>9}{'p50 ms':>10}{'p99 ms':>10}")
    for name, r in results.items():
        print(f"{name:<20}{r['ok']:>6}{r['errors']:>8}{r['qps']:>9.1f}{r['p50_ms']:>10.1f}{r['p99_ms']:>10.1f}")
    raypo, vllm = results.values()
    print(
        f"\nraypo / vllm: QPS {raypo['qps'] / vllm['qps']:.2f}x, p50 {raypo['p50_ms'] / vllm['p50_ms']:.2f}x, "
        f"p99 {raypo['p99_ms'] / vllm['p99_ms']:.2f}x"
    )


if __name__ == "__main__":
    main()
