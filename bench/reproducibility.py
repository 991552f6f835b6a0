"""The main job's claim across machines: `raypo train` from an empty cache, over build seeds and
CPU kernel sets, with warm-start and final held-out accuracy per cell and their spread.

    .venv/bin/python bench/reproducibility.py [--seeds 0 1 2] [--capabilities avx2 avx512]
                                              [--build-only default] [--ppo-seed 0] [--algos grpo]
                                              [--variants inference.top_p=0.9 ...]

Each cell runs `raypo train` as a user does (a subprocess, its own local Ray sized from this
machine) in a fresh RAYPO_CACHE, so its time includes the tiny model's build, under
`ATEN_CPU_CAPABILITY=<capability>`: torch then uses that kernel set, whose float rounding
differs as other machines' CPUs do. A capability this CPU lacks is reported, not run (torch
would die of an illegal instruction). `--build-only` capabilities build the model under that
kernel set (`raypo make-tiny`) and train under the native one: `default` breaks
torch.compile inside vLLM, but the build has no vLLM. `--algos` are the presets each cell runs
(`configs/<algo>_tiny.yaml`; the first one's time includes the build, the others train on its
model); PPO runs for one seed per capability on the cell's model (`--ppo-seed -1`: none);
each `--variants` entry (`KEY=VALUE[,KEY=VALUE...]`) runs the first preset again with those
overrides on the cell's model, so a setting is compared with the preset seed by seed. DPO
rows also give the held-out preference accuracy. Prints one row per cell, then min/median/max;
`--json` writes the rows.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RAYPO = [sys.executable, "-m", "pipelines.cli"]
CPU_FLAGS = {"avx2": "avx2", "avx512": "avx512f"}  # capability -> the /proc/cpuinfo flag it needs


def cpu_supports(capability: str) -> bool:
    flag = CPU_FLAGS.get(capability)
    if flag is None:  # default: plain code, runs anywhere
        return True
    try:
        flags = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")).split()
    except (OSError, StopIteration):
        return False
    return flag in flags


def _run(cmd: list[str], env: dict, log: Path) -> None:
    with log.open("w") as out:
        done = subprocess.run(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, text=True)
    if done.returncode:
        tail = log.read_text()[-2000:]
        raise RuntimeError(f"{' '.join(cmd[2:])} failed ({done.returncode}); log {log}:\n{tail}")


def cell(
    algo: str, seed: int, build_cap: str, train_cap: str | None, cache: Path, work: Path, build: bool = True, variant: str = ""
) -> dict:
    """One `raypo train` (after `raypo make-tiny` when the build has a kernel set of its own);
    `build=False`: the model is in `cache` already; `variant`: comma-separated overrides."""
    env = {**os.environ, "RAYPO_CACHE": str(cache)}
    run = f"{algo}_{seed}" + ("_" + re.sub(r"[^A-Za-z0-9]+", "_", variant) if variant else "")
    overrides = ["--set", f"model.tiny.seed={seed}", "--set", f"output_dir={work / 'runs'}", "--set", f"name={run}"]
    for item in filter(None, variant.split(",")):
        overrides += ["--set", item]
    started = time.monotonic()
    if build and build_cap != train_cap:
        _run(
            [*RAYPO, "make-tiny", "--set", f"model.tiny.seed={seed}"],
            {**env, "ATEN_CPU_CAPABILITY": build_cap},
            work / "build.log",
        )
    train_env = {**env, **({"ATEN_CPU_CAPABILITY": train_cap} if train_cap else {})}
    _run([*RAYPO, "train", "-c", f"configs/{algo}_tiny.yaml", *overrides], train_env, work / f"{run}.log")
    minutes = (time.monotonic() - started) / 60
    summary = json.loads((work / "runs" / run / "summary.json").read_text())
    manifest = json.loads(next(cache.glob("tiny-*/raypo_tiny.json")).read_text())
    return {
        "algo": f"{algo} {variant}" if variant else algo,
        "seed": seed,
        "build": build_cap,
        "train": train_cap or "native",
        "warm_start": manifest["heldout_accuracy"],
        "sampled": manifest["check_sampled_accuracy"],
        "sft_rounds": len(manifest["warm_start_history"]),
        "start": summary["eval_accuracy_start"],
        "end": summary["eval_accuracy_end"],
        "gain": summary["eval_accuracy_end"] - summary["eval_accuracy_start"],
        "minutes": minutes,
        "preference_accuracy": summary["eval_end"].get("reward_accuracy"),  # DPO's held-out pairs
    }


def spread(rows: list[dict], key: str) -> str:
    values = [r[key] for r in rows]
    return f"{min(values):.3f} / {statistics.median(values):.3f} / {max(values):.3f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="model.tiny.seed values")
    parser.add_argument("--capabilities", nargs="+", default=["avx2", "avx512"], help="kernel sets for build and RL")
    parser.add_argument("--build-only", nargs="*", default=["default"], help="kernel sets for the build alone")
    parser.add_argument("--ppo-seed", type=int, default=0, help="the seed PPO runs for, per capability (-1: none)")
    parser.add_argument("--algos", nargs="+", default=["grpo"], help="presets every cell runs (configs/<algo>_tiny.yaml)")
    parser.add_argument(
        "--variants", nargs="*", default=[], help="KEY=VALUE[,KEY=VALUE...]: the first preset again with these overrides"
    )
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args()

    plan = [(cap, cap) for cap in args.capabilities] + [(cap, None) for cap in args.build_only]
    rows, skipped = [], []
    with tempfile.TemporaryDirectory(prefix="raypo-repro-") as tmp:
        for build_cap, train_cap in plan:
            if not cpu_supports(build_cap):
                skipped.append(f"{build_cap}: this CPU lacks {CPU_FLAGS[build_cap]}; not run")
                continue
            for seed in args.seeds:
                work = Path(tmp) / f"{build_cap}-{train_cap}-{seed}"
                work.mkdir()
                cache = work / "cache"
                algos = [*args.algos, *(["ppo"] if seed == args.ppo_seed else [])]
                runs = [(algo, "") for algo in algos] + [(args.algos[0], v) for v in args.variants]
                for i, (algo, variant) in enumerate(runs):  # after the first, on the model it built: times exclude the build
                    rows.append(cell(algo, seed, build_cap, train_cap, cache, work, build=i == 0, variant=variant))
                    print(json.dumps(rows[-1]), flush=True)

    import torch

    print(f"\nmachine: {os.cpu_count()} CPUs, native torch kernels {torch.backends.cpu.get_cpu_capability()}")
    print("| algo | seed | build kernels | RL kernels | SFT rounds | warm start | sampled | RL start | RL end | gain | minutes |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['algo']} | {r['seed']} | {r['build']} | {r['train']} | {r['sft_rounds']} | {r['warm_start']:.3f} | "
            f"{r['sampled']:.3f} | {r['start']:.3f} | {r['end']:.3f} | {r['gain']:+.3f} | {r['minutes']:.1f} |"
        )
    for algo in dict.fromkeys(r["algo"] for r in rows):
        part = [r for r in rows if r["algo"] == algo]
        preference = f", preference accuracy {spread(part, 'preference_accuracy')}" if algo == "dpo" else ""
        print(
            f"{algo}: {len(part)} cells; min / median / max: warm start {spread(part, 'warm_start')}, "
            f"end {spread(part, 'end')}, gain {spread(part, 'gain')}{preference}, minutes {spread(part, 'minutes')}"
        )
    for line in skipped:
        print(f"skipped {line}")
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "skipped": skipped}, indent=2))


if __name__ == "__main__":
    main()
