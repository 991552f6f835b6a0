"""Per-phase time per step and tokens/s of the tiny GRPO and PPO configs, side by side.

    .venv/bin/python bench/phases.py [--steps 8]

Runs both configs on one local Ray (real vLLM rollouts, DeepSpeed learner), and GRPO once
more with the weights broadcast from learner rank 0 (gloo here, NCCL on GPUs) instead of
passed through the object store; skips the first step (engine warm-up), and prints a table of
the mean seconds per step of each phase, its share of the step, and the generation
throughput. Compare ratios, not absolute times: the machine is shared and noisy.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

PHASES = ("generate", "reward", "reference", "value", "learn", "sync")
ROOT = Path(__file__).resolve().parent.parent


RUNS = {  # column -> (preset, extra overrides)
    "grpo": ("grpo_tiny.yaml", []),
    "ppo": ("ppo_tiny.yaml", []),
    "grpo/broadcast": ("grpo_tiny.yaml", ["resource.weight_sync=broadcast", "name=grpo_broadcast"]),
}


def run(preset: str | Path, steps: int, out_dir: str, overrides: list[str]) -> list[dict]:
    """Steps 1.. of a `preset` run (a file name in configs/, or a path)."""
    from pipelines.config import load_config
    from pipelines.rl.trainer import train

    cfg = load_config(
        ROOT / "configs" / preset if isinstance(preset, str) else preset,
        [f"training.steps={steps}", "training.save_every=0", "task.eval_problems=50", f"output_dir={out_dir}", *overrides],
    )
    train(cfg)
    lines = (Path(out_dir) / cfg.name / "metrics.jsonl").read_text().splitlines()
    return [json.loads(x) for x in lines][1:]  # step 0 includes engine warm-up


def mean(rows: list[dict], key: str) -> float:
    return sum(r.get(key, 0.0) for r in rows) / max(1, len(rows))


def main() -> None:
    import ray

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    args = parser.parse_args()
    ray.init(include_dashboard=False, log_to_driver=False)  # sized from this machine
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for column, (preset, overrides) in RUNS.items():
            results[column] = run(preset, args.steps, tmp, overrides)
    ray.shutdown()

    print(f"\nper-phase seconds per step (mean of steps 1..{args.steps - 1}), share of the step in brackets")
    print("(reward, reference and value run at once, each timed to its own end: their shares overlap)")
    print(f"{'phase':<12}" + "".join(f"{name:>22}" for name in results))
    for phase in PHASES:
        cells = []
        for rows in results.values():
            t, total = mean(rows, f"time_{phase}"), mean(rows, "step_time")
            cells.append(f"{t:10.3f} s ({t / total:5.1%})" if t else f"{'-':>18}")
        print(f"{phase:<12}" + "".join(f"{c:>22}" for c in cells))
    print(f"{'step':<12}" + "".join(f"{mean(r, 'step_time'):>20.3f} s" for r in results.values()))
    print(f"{'tokens/s':<12}" + "".join(f"{mean(r, 'tokens_per_s'):>22.0f}" for r in results.values()))
    g, p = mean(results["grpo"], "step_time"), mean(results["ppo"], "step_time")
    print(f"\nPPO step / GRPO step = {p / g:.2f}x (PPO adds the critic's forward and update)")
    store, cast = mean(results["grpo"], "time_sync"), mean(results["grpo/broadcast"], "time_sync")
    print(f"weight sync, broadcast / object store = {cast / store:.2f}x")


if __name__ == "__main__":
    main()
