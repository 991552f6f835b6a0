"""A tiny GRPO run that survives its own faults: kill, by pid, the process of each role in turn
(rollout engine, reward, reference, buffer, one learner rank), corrupt the spill file the
restarted buffer reads back, inject a NaN update; beside undisturbed runs of the same preset.

    .venv/bin/python bench/chaos.py [--steps 30] [--seeds 0 1] [--json out.json]

Every run is `train()` on one local Ray sized from this machine, with two learner ranks (so a
dead rank's peer is left waiting in a collective) and the preset's own settings otherwise. The
chaos run uses the first seed; the undisturbed runs of every seed give the spread it is held to.
Prints, per fault: the step it was injected after, whether the run survived it, the steps
trained again, and the seconds it cost (the wall time from the fault to the next step's metrics,
less the undisturbed run's median step time); then final held-out accuracy of each run.
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
    parser.add_argument("--json", help="write the table's rows here")
    args = parser.parse_args()
    faults = {s: f for s, f in FAULTS.items() if s + 1 < args.steps}
    out = Path(tempfile.mkdtemp(prefix="raypo-chaos-"))
    ray.init(include_dashboard=False, log_to_driver=False)  # sized from this machine
    try:
        calm = [one_run(out, f"calm_{seed}", seed, args.steps) for seed in args.seeds]
        chaos = Chaos("chaos", out, faults)
        disturbed = one_run(out, "chaos", args.seeds[0], args.steps, chaos)
    finally:
        ray.shutdown()
    step_time = statistics.median(calm[0]["step_times"])
    rows = []
    for f in chaos.injected:
        survived = "next_step_at" in f
        rows.append(
            {
                "fault": f["fault"],
                "after step": f["after_step"],
                "survived": survived and disturbed["steps"] == args.steps,
                "steps trained again": max(0, f["after_step"] + 1 - f["next_step"]) if survived else None,
                "recovery s": round(max(0.0, f["next_step_at"] - f["at"] - step_time), 2) if survived else None,
            }
        )
    print(f"\nfaults injected: {len(rows)}, survived: {sum(r['survived'] for r in rows)}; "
          f"steps completed {disturbed['steps']} of {args.steps}; undisturbed median step {step_time:.2f} s")  # fmt: skip
    print("| fault | after step | survived | steps trained again | recovery s |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['fault']} | {r['after step']} | {r['survived']} | {r['steps trained again']} | {r['recovery s']} |")
    last = disturbed["metrics"][-1]
    print(f"\nchaos run (seed {args.seeds[0]}): actor restarts {last['actor_restarts']}, quarantined spill files "
          f"{last['buffer_quarantined']}, update success rate {last['update_success_rate']:.3f}")  # fmt: skip
    nan_step = next(s + 1 for s, f in faults.items() if f == "nan update") if "nan update" in faults.values() else args.steps
    same = sum(
        all(c[k] == d[k] for k in ("loss", "reward_mean", "grad_norm"))
        for c, d in zip(calm[0]["metrics"][:nan_step], disturbed["metrics"][:nan_step], strict=True)
    )
    print(f"steps before the NaN update whose loss, reward and grad norm equal the undisturbed run's: {same} of {nan_step}")
    accuracies = [r["accuracy"] for r in calm]
    print("| run | seed | steps | held-out accuracy | wall s |")
    print("|---|---|---|---|---|")
    for r in [*calm, disturbed]:
        print(f"| {r['name']} | {r['seed']} | {r['steps']} | {r['accuracy']:.3f} | {r['wall_s']:.0f} |")
    within = min(accuracies) - 1e-9 <= disturbed["accuracy"] <= max(accuracies) + 1e-9
    print(f"undisturbed spread {min(accuracies):.3f}-{max(accuracies):.3f}; chaos {disturbed['accuracy']:.3f} "
          f"({'within' if within else 'outside'} it)")  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps({"faults": rows, "runs": [{k: v for k, v in r.items() if k != "metrics"}
                                                                        for r in [*calm, disturbed]]}, indent=2))  # fmt: skip
    return 0 if all(r["survived"] for r in rows) and disturbed["steps"] == args.steps else 1


if __name__ == "__main__":
    sys.exit(main())
