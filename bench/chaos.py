"""A tiny GRPO run that survives its own faults: kill, by pid, the process of each role in turn
(rollout engine, reward, reference, buffer, one learner rank), corrupt the spill file the
restarted buffer reads back, inject a NaN update; beside undisturbed runs of the same preset.

    .venv/bin/python bench/chaos.py [--steps 30] [--seeds 0 1 2] [--chaos-seeds 0 1 2] [--json out.json]

Every run is `train()` on one local Ray sized from this machine, with two learner ranks (so a
dead rank's peer is left waiting in a collective) and the preset's own settings otherwise. An
undisturbed run of every `--seeds` seed gives the spread; a chaos run of every `--chaos-seeds`
seed (the first `--seeds` one by default) is held to it. The kills change no number (the steps
before the NaN equal the undisturbed run's); the skipped NaN update moves the rest of the run
onto another trajectory, which is why several chaos seeds are held to the spread, not one run.
Prints, per fault of the first chaos run: the step it was injected after, whether every chaos
run survived it, the steps trained again, and the seconds it cost (the wall time from the fault
to the next step's metrics, less the undisturbed run's median step time); then final held-out
accuracy of each run.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

import ray

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from pipelines.config import load_config  # noqa: E402 (the repository's packages, run from a checkout)
from pipelines.rl.trainer import train  # noqa: E402

# step after which each fault is injected (with --steps 30); the learner's comes after a checkpoint
FAULTS = {3: "rollout-0", 6: "reward", 9: "reference", 12: "buffer", 16: "learner-1", 19: "nan update"}


def config(out: Path, name: str, seed: int, steps: int, nan_step: int | None):
    overrides = [
        f"name={name}", f"seed={seed}", f"output_dir={out}", f"training.steps={steps}", "training.save_every=5",
        "training.spill_experience=true", "resource.num_learners=2", "resource.cpus_per_learner=0.5",
    ]  # fmt: skip
    if nan_step is not None:
        overrides.append(f"chaos.nan_loss_steps=[{nan_step}]")
    return load_config(ROOT / "configs" / "grpo_tiny.yaml", overrides)


def process_of(run: str, role: str) -> int:
    return ray.get(ray.get_actor(f"raypo:{run}:{os.getpid()}:{role}").pid.remote())


class Chaos:
    """The on_metrics callback that injects the faults and times what each costs."""

    def __init__(self, run: str, out: Path, faults: dict[int, str]):
        self.run, self.out, self.faults = run, out, faults
        self.seen: list[tuple[float, int]] = []  # (wall time, step) of each step's metrics
        self.injected: list[dict] = []

    def __call__(self, metrics: dict) -> None:
        now, step = time.monotonic(), metrics["step"]
        self.seen.append((now, step))
        if self.injected and "next_step_at" not in self.injected[-1]:
            self.injected[-1] |= {"next_step_at": now, "next_step": step}
        fault = self.faults.get(step)
        if fault is None or any(f["after_step"] == step for f in self.injected):
            return  # a step trained again after the learners' rebuild: its fault was injected already
        if fault == "buffer":  # the restarted buffer reads this step back from its spill file: corrupt it
            spilled = self.out / self.run / "experience" / f"step_{step:06d}.parquet"
            spilled.write_bytes(spilled.read_bytes()[:-64])
        if fault != "nan update":  # the NaN comes from the config (chaos.nan_loss_steps) at step + 1
            os.kill(process_of(self.run, fault), signal.SIGKILL)
        self.injected.append({"fault": fault, "after_step": step, "at": time.monotonic()})


def one_run(out: Path, name: str, seed: int, steps: int, chaos: Chaos | None = None) -> dict:
    nan_step = next((s + 1 for s, f in FAULTS.items() if f == "nan update"), None) if chaos else None
    started = time.monotonic()
    summary = train(config(out, name, seed, steps, nan_step), on_metrics=chaos)
    lines = [json.loads(x) for x in (out / name / "metrics.jsonl").read_text().splitlines()]
    return {
        "name": name,
        "seed": seed,
        "steps": summary["steps"],
        "accuracy": summary["eval_accuracy_end"],
        "wall_s": time.monotonic() - started,
        "step_times": [m["step_time"] for m in lines],
        "metrics": lines,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--chaos-seeds", type=int, nargs="+", help="seeds of chaos runs (default: the first --seeds)")
    parser.add_argument("--json", help="write the table's rows here")
    args = parser.parse_args()
    chaos_seeds = args.chaos_seeds or args.seeds[:1]
    faults = {s: f for s, f in FAULTS.items() if s + 1 < args.steps}
    out = Path(tempfile.mkdtemp(prefix="raypo-chaos-"))
    ray.init(include_dashboard=False, log_to_driver=False)  # sized from this machine
    try:
        calm = {seed: one_run(out, f"calm_{seed}", seed, args.steps) for seed in sorted({*args.seeds, *chaos_seeds})}
        chaoses = [Chaos(f"chaos_{seed}", out, faults) for seed in chaos_seeds]
        disturbed = [one_run(out, c.run, seed, args.steps, c) for c, seed in zip(chaoses, chaos_seeds, strict=True)]
    finally:
        ray.shutdown()
    step_time = statistics.median(calm[chaos_seeds[0]]["step_times"])
    rows = []
    for i, f in enumerate(chaoses[0].injected):
        survived = all(len(c.injected) > i and "next_step_at" in c.injected[i] for c in chaoses)
        survived = survived and all(d["steps"] == args.steps for d in disturbed)
        rows.append(
            {
                "fault": f["fault"],
                "after step": f["after_step"],
                "survived": survived,
                "steps trained again": max(0, f["after_step"] + 1 - f["next_step"]) if "next_step" in f else None,
                "recovery s": round(max(0.0, f["next_step_at"] - f["at"] - step_time), 2) if "next_step_at" in f else None,
            }
        )
    print(f"\nfaults injected per run: {len(rows)}, survived in all {len(disturbed)} chaos runs: "
          f"{sum(r['survived'] for r in rows)}; steps completed {[d['steps'] for d in disturbed]} of {args.steps}; "
          f"undisturbed median step {step_time:.2f} s")  # fmt: skip
    print(f"| fault | after step | survived | steps trained again (seed {chaos_seeds[0]}) | recovery s (seed {chaos_seeds[0]}) |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['fault']} | {r['after step']} | {r['survived']} | {r['steps trained again']} | {r['recovery s']} |")
    nan_step = next(s + 1 for s, f in faults.items() if f == "nan update") if "nan update" in faults.values() else args.steps
    print()
    for d in disturbed:
        last, undisturbed = d["metrics"][-1], calm[d["seed"]]["metrics"]
        same = sum(
            all(c[k] == m[k] for k in ("loss", "reward_mean", "grad_norm"))
            for c, m in zip(undisturbed[:nan_step], d["metrics"][:nan_step], strict=True)
        )
        print(f"{d['name']}: actor restarts {last['actor_restarts']}, quarantined spill files {last['buffer_quarantined']}, "
              f"update success rate {last['update_success_rate']:.3f}; steps before the NaN update whose loss, reward "
              f"and grad norm equal the undisturbed run's: {same} of {nan_step}")  # fmt: skip
    accuracies = [r["accuracy"] for r in calm.values()]
    print("| run | seed | steps | held-out accuracy | wall s |")
    print("|---|---|---|---|---|")
    for r in [*calm.values(), *disturbed]:
        print(f"| {r['name']} | {r['seed']} | {r['steps']} | {r['accuracy']:.3f} | {r['wall_s']:.0f} |")
    low, high = min(accuracies), max(accuracies)
    within = [low - 1e-9 <= d["accuracy"] <= high + 1e-9 for d in disturbed]
    chaos_accuracies = [d["accuracy"] for d in disturbed]
    print(f"undisturbed spread {low:.3f}-{high:.3f} (median {statistics.median(accuracies):.3f}); chaos "
          f"{', '.join(f'{a:.3f}' for a in chaos_accuracies)} (median {statistics.median(chaos_accuracies):.3f}): "
          f"{sum(within)} of {len(within)} within the spread")  # fmt: skip
    if args.json:
        runs = [{k: v for k, v in r.items() if k != "metrics"} for r in [*calm.values(), *disturbed]]
        Path(args.json).write_text(json.dumps({"faults": rows, "runs": runs}, indent=2))
    return 0 if rows and all(r["survived"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
