"""`raypo tune`: a 4-trial sweep of the tiny model as a user runs it (a subprocess on a local Ray sized
from this machine), interrupted with Ctrl-C after two trials and finished with --resume; ASHA stops
at least one trial early; the table, the compute saved and the best preset are written."""

import csv
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from pipelines.config import ConfigError, load_config
from pipelines.rl.tune import concurrent_trials, load_sweep, trial_bundles, trial_config

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parent.parent
RAYPO = [sys.executable, "-m", "pipelines.cli"]


def _sweep_file(tmp_path: Path) -> Path:
    sweep = {
        "name": "ci_sweep",
        "base": "configs/grpo_tiny.yaml",  # relative to the working directory, as a user writes it
        "overrides": {"training.steps": 6, "training.batch_size": 32, "task.eval_problems": 20, "training.warmup_steps": 0},
        # one learning rate that trains, one that wrecks the model: ASHA has a loser to stop
        "space": {"training.lr": {"choice": [1.0e-4, 5.0e-2]}},
        "metric": "accuracy",
        "num_samples": 4,
        "report_every": 2,
        "asha": {"grace_steps": 2, "reduction_factor": 2},
        "storage_path": str(tmp_path / "sweeps"),
        "seed": 0,  # TPE (random for its first trials) then samples 5e-2, 1e-4, 5e-2, 5e-2
    }
    path = tmp_path / "sweep.yaml"
    path.write_text(yaml.safe_dump(sweep))
    return path


def test_sweep_file_keys_are_checked_before_any_trial(tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    path = _sweep_file(tmp_path)
    sweep, base = load_sweep(path)
    assert base == ROOT / "configs" / "grpo_tiny.yaml"  # absolute: each trial runs in its own directory
    cfg = trial_config(sweep, base, {"training.lr": 0.05}, name="t", output_dir=str(tmp_path))
    assert (cfg.training.lr, cfg.training.steps, cfg.eval.every, cfg.output_dir) == (0.05, 6, 2, str(tmp_path))
    with pytest.raises(ConfigError, match=r"training\.lrr: unknown key"):
        load_sweep(path, ["space={training.lrr: {uniform: [0.1, 0.2]}}"])
    with pytest.raises(ConfigError, match=r"space\.training\.lr: uniform takes \[low, high\] with low < high"):
        load_sweep(path, ["space.training.lr={uniform: [0.2, 0.1]}"])
    with pytest.raises(ConfigError, match=r"metric"):
        load_sweep(path, ["metric=acuracy"])
    assert load_sweep(path, ["asha.grace_steps=3"])[0].asha.grace_steps == 3


def test_trials_side_by_side_are_computed_from_the_plan():
    cfg = load_config(ROOT / "configs" / "grpo_tiny.yaml")
    bundles = trial_bundles(cfg, by_node_type=False)
    assert bundles[0] == {} and sum(b.get("CPU", 0) for b in bundles) == pytest.approx(1.6)
    assert concurrent_trials(bundles, {"CPU": 2.0}, None) == 1
    assert concurrent_trials(bundles, {"CPU": 8.0}, None) == 5
    assert concurrent_trials(bundles, {"CPU": 8.0}, 2) == 2
    with pytest.raises(RuntimeError, match="one trial needs 1.6 CPUs"):
        concurrent_trials(bundles, {"CPU": 1.0}, None)


def _ended_trials(log: Path) -> list[str]:
    """Ids of the trials Tune reported ended (run to the end or stopped by ASHA) in a sweep's output."""
    return re.findall(r"Trial run_trial_([0-9a-f]+) completed after", log.read_text(errors="replace"))


def test_sweep_interrupted_and_resumed_stops_losers_early_and_writes_the_best_preset(tiny_model, tmp_path):
    path = _sweep_file(tmp_path)
    sweep_dir = tmp_path / "sweeps" / "ci_sweep"
    log = tmp_path / "first.log"
    first = subprocess.Popen(
        [*RAYPO, "tune", "-c", str(path)], cwd=ROOT, stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True
    )
    try:
        deadline = time.monotonic() + 900
        # ASHA's rung records live in the sweep's process (Tune's restore brings back the trials and
        # the searcher, not the scheduler's records), so the loser it stops is among the first three
        while len(_ended_trials(log)) < 3 and first.poll() is None:
            assert time.monotonic() < deadline, "three trials did not end in time"
            time.sleep(2)
        assert first.poll() is None, log.read_text()[-4000:]
        first.send_signal(signal.SIGINT)  # Ctrl-C: Tune saves the sweep's state and stops
        first.wait(timeout=180)
    finally:
        if first.poll() is None:
            os.killpg(first.pid, signal.SIGKILL)
    ended = _ended_trials(log)
    done_before = {p: p.stat().st_mtime_ns for t in ended for p in sweep_dir.glob(f"run_trial_{t}_*/result.json")}
    assert len(done_before) == len(ended) >= 3

    resumed = subprocess.run(
        [*RAYPO, "tune", "-c", str(path), "--resume"], cwd=ROOT, capture_output=True, text=True, timeout=1200
    )
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    for results, mtime in done_before.items():  # trials that had ended were not run again
        assert results.stat().st_mtime_ns == mtime, f"{results} was written again"

    rows = list(csv.DictReader((sweep_dir / "results.csv").open()))
    assert len(rows) == 4, rows
    statuses = [r["status"] for r in rows]
    assert "stopped early" in statuses, rows
    stopped = [r for r in rows if r["status"] == "stopped early"]
    assert all(int(r["steps"]) < 6 for r in stopped)
    assert f"steps run: {sum(int(r['steps']) for r in rows)} of 24" in resumed.stdout

    best = load_config(sweep_dir / "best.yaml")  # the preset `raypo train -c` takes
    finished = [r for r in rows if r["status"] == "done"]
    top = max(finished, key=lambda r: float(r["accuracy"]))
    assert best.training.lr == pytest.approx(float(top["training.lr"])) and best.training.steps == 6
    assert "best: trial" in resumed.stdout and "raypo train -c" in resumed.stdout
