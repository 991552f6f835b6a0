"""The 135M-parameter SmolLM2 example beside the embedded tiny model: generation tokens/s,
learner step time and weight-sync time per RL step, side by side in one run.

    .venv/bin/python bench/models.py [--steps 4]

Runs configs/grpo_tiny.yaml and examples/smollm2/grpo.yaml (SmolLM2-135M-Instruct, imported
from its PyPI wheel into the raypo cache on first use) for a few steps each on one local Ray,
skips step 0 (engine warm-up) and prints means per step and the 135M / tiny ratios. Compare
ratios, not absolute times: the machine is shared and noisy.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from phases import ROOT, mean, run  # noqa: E402  (a sibling script, not a package)

ROWS = [  # label, metric key, format
    ("generate (s)", "time_generate", "{:.2f}"),
    ("tokens/s", "tokens_per_s", "{:.0f}"),
    ("learner step (s)", "time_learn", "{:.2f}"),
    ("weight sync (s)", "time_sync", "{:.2f}"),
    ("step (s)", "step_time", "{:.2f}"),
]


def smollm2_dir() -> Path:
    from pipelines.models.gguf import SMOLLM2, import_gguf
    from pipelines.models.tiny import cache_root

    out = cache_root() / "smollm2-135m-instruct"
    return out if (out / "config.json").is_file() else import_gguf(SMOLLM2, out)


def main() -> None:
    import ray

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args()
    os.chdir(ROOT)
    smollm2 = smollm2_dir()
    ray.init(include_dashboard=False, log_to_driver=False)  # sized from this machine
    with tempfile.TemporaryDirectory() as tmp:
        tiny = run("grpo_tiny.yaml", args.steps, tmp, [])
        example = ROOT / "examples" / "smollm2" / "grpo.yaml"  # its data and reward paths are relative to ROOT
        big = run(example, args.steps, tmp, [f"model.path={smollm2}", "task.eval_problems=10"])
    ray.shutdown()
    print(f"\nmeans of steps 1..{args.steps - 1}; tiny: 128 samples x 8 tokens, SmolLM2-135M: 32 samples x 24 tokens")
    print(f"{'':<18}{'tiny':>12}{'SmolLM2-135M':>14}{'135M / tiny':>13}")
    for label, key, fmt in ROWS:
        a, b = mean(tiny, key), mean(big, key)
        print(f"{label:<18}{fmt.format(a):>12}{fmt.format(b):>14}{b / a if a else float('nan'):>12.2f}x")


if __name__ == "__main__":
    main()
