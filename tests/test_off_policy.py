"""Sampling ahead of learning (algo.off_policy_steps): the engines sample step t+1's batch while
the learners train on step t's, the loss corrects for the one update the samples lag behind
(decoupled PPO, pipelines/algos/losses.py), and the run learns as the synchronous one does."""

import json
import os
import signal
import statistics
import time
from pathlib import Path

import pytest
import ray

from pipelines.config import load_config
from pipelines.rl.trainer import train

pytestmark = pytest.mark.slow
CONFIGS = Path(__file__).resolve().parent.parent / "configs"
# Measured on 2 cores, 30 steps of the main preset, 200 held-out problems, seeds 0-1: synchronous
# 0.95 / 0.965, one step ahead 0.955 / 0.965, from 0.52 / 0.42 at the start.
STEPS, MIN_GAIN, MAX_BEHIND = 30, 0.3, 0.03


@pytest.fixture(scope="module")
def local_ray():
    ray.init(include_dashboard=False, log_to_driver=False)  # sized from this machine
    yield
    ray.shutdown()


def _run(out: Path, name: str, *overrides, on_metrics=None) -> tuple[dict, list[dict]]:
    cfg = load_config(CONFIGS / "grpo_tiny.yaml", [f"output_dir={out}", f"name={name}", *overrides])
    summary = train(cfg, on_metrics=on_metrics)
    return summary, [json.loads(x) for x in (out / name / "metrics.jsonl").read_text().splitlines()]


def test_sampling_one_step_ahead_learns_as_the_synchronous_run(local_ray, tiny_model, tmp_path):
    common = [f"training.steps={STEPS}", "task.eval_problems=200"]
    sync, sync_lines = _run(tmp_path, "sync", *common)
    ahead, ahead_lines = _run(tmp_path, "ahead", *common, "algo.off_policy_steps=1")
    assert [m["staleness"] for m in sync_lines] == [0] * STEPS
    assert [m["staleness"] for m in ahead_lines] == [0] + [1] * (STEPS - 1)  # step 0's batch has no update before it
    # Synchronously the learner takes the node's threads (roles take turns); ahead it keeps its
    # bundle's one CPU while the engine samples and takes the node's once it is idle
    # (pipelines/rl/roles.py:learner_threads, actors/learner.py:Widening): the last step samples
    # nothing ahead, so its update has them from its start or its backward pass.
    node = min(os.cpu_count() or 1, 4)
    assert {m["learner_threads"] for m in sync_lines} == {node}
    assert all(1 <= m["learner_threads"] <= node for m in ahead_lines)
    assert node == 1 or ahead_lines[-1]["learner_threads"] > 1.2, ahead_lines[-1]
    # Sampling ahead hides most of the engine's time behind the step before (0.8 measured);
    # synchronously none of it is (the driver waits for the whole generation).
    assert statistics.median(m["rollout_overlap"] for m in ahead_lines[1:]) > 0.3
    assert max(m["rollout_overlap"] for m in sync_lines) < 0.1
    # the samples lag one update: importance weights near 1, all finite, few capped
    assert all(0.5 < m["behaviour_weight_mean"] < 2 and 0 <= m["behaviour_weight_capped"] < 0.5 for m in ahead_lines)
    assert "behaviour_weight_mean" not in sync_lines[0]  # the synchronous loss is untouched
    assert ahead["eval_accuracy_end"] - ahead["eval_accuracy_start"] >= MIN_GAIN, ahead
    assert ahead["eval_accuracy_end"] >= sync["eval_accuracy_end"] - MAX_BEHIND, (sync, ahead)


@pytest.mark.parametrize("when, transport", [("idle", "object_store"), ("busy", "object_store"), ("idle", "broadcast")])
def test_an_engine_killed_while_sampling_ahead_is_restarted_and_no_batch_is_drawn_with_lost_weights(
    local_ray, tiny_model, tmp_path, capsys, when, transport
):
    """SIGKILL to the engine after step 1. `idle`: once it has sampled step 2's batch and loaded
    step 1's weights (its pid asked first, a call queued behind both). Step 2 learns from that
    batch (whole, one step stale as any); the restarted engine, from the model's own weights, samples
    step 3 with weights older than those pushed before that launch: seen from the batch's weights
    version, it is given the current weights and samples step 3 again. `busy`: at once, with step
    2's batch or the weights load still to run (which one, the machine decides): whatever died
    is done again, and no step learns from samples more than one update stale. With the broadcast
    transport every push is waited for, so at step 2 each engine is asked whether it restarted: the
    restarted one joins the broadcast again and gets the weights before it samples step 3."""

    pid = {}

    def kill(metrics):
        if metrics["step"] == (1 if when == "idle" else 0):
            engine = ray.get_actor(f"raypo:chaos-{when}-{transport}:{os.getpid()}:rollout-0")
            pid["engine"] = ray.get(engine.pid.remote())  # waits for the engine's queued calls
        if metrics["step"] == 1:
            os.kill(pid["engine"], signal.SIGKILL)

    name = f"chaos-{when}-{transport}"
    overrides = ["training.steps=5", "task.eval_problems=20", "algo.off_policy_steps=1", f"resource.weight_sync={transport}"]
    _, lines = _run(tmp_path, name, *overrides, on_metrics=kill)
    assert "recovered: rollout-0 lost its process" in capsys.readouterr().err
    assert [m["step"] for m in lines] == [0, 1, 2, 3, 4] and all(m["update_success"] == 1.0 for m in lines)
    staleness = [m["staleness"] for m in lines]
    if when == "idle" and transport == "broadcast":
        assert staleness == [0, 1, 1, 1, 1]  # the weights given at step 2, before step 3 was launched
    elif when == "idle":
        assert staleness == [0, 1, 1, 0, 1]  # step 3 sampled again, with the newest weights
    else:
        assert staleness[:2] == [0, 1] and set(staleness) <= {0, 1}, staleness


def test_an_evaluation_beside_a_batch_sampled_ahead_waits_for_nothing_and_one_on_a_restarted_engine_is_lost(
    local_ray, tiny_model, tmp_path, capsys, recwarn
):
    """Sampling ahead, an evaluation begun beside a step is queued behind the batch sampled ahead
    without asking the engine anything first (that would wait for the batch): the steps that
    launch one take no longer than the others. SIGKILL to engine 0 once it is idle after step 1
    (it has sampled step 2's batch): the evaluation begun at step 2 reaches the restarted engine,
    which serves the model's own weights: it is reported lost, naming why, and the run goes on
    (step 3 is sampled again with the current weights, as in the test above)."""

    def kill(metrics):
        if metrics["step"] == 1:
            engine = ray.get_actor(f"raypo:eval-ahead:{os.getpid()}:rollout-0")
            pid = ray.get(engine.pid.remote())  # waits for the engine's queued calls
            os.kill(pid, signal.SIGKILL)
            # Back before step 2 goes on (a call that reaches it while it restarts fails: also a lost
            # evaluation, for that other reason): the evaluation's calls reach the restarted engine.
            deadline = time.monotonic() + 300
            while time.monotonic() < deadline:
                try:
                    if ray.get(engine.pid.remote(), timeout=30) != pid:
                        return
                except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):  # restarting
                    time.sleep(0.5)
            raise AssertionError("rollout-0 did not come back within 300 s")

    calm_overrides = ["training.steps=16", "task.eval_problems=20", "algo.off_policy_steps=1", "eval.every=2"]
    _, calm = _run(tmp_path, "eval-calm", *calm_overrides)
    # An evaluation is launched in the step after the one it follows (every second step, from step 2)
    launching = [m["step_time"] for m in calm[2:] if m["step"] % 2 == 0]
    others = [m["step_time"] for m in calm[2:] if m["step"] % 2 == 1]
    # measured: 0.128 s against 0.066 s when the driver asked the busy engine first; 0.072 / 0.072 s without
    assert statistics.median(launching) < 1.5 * statistics.median(others), (launching, others)
    assert all("eval/accuracy" in m for m in calm if m["step"] % 2 == 0 and m["step"] > 0)

    overrides = ["training.steps=5", "task.eval_problems=20", "algo.off_policy_steps=1", "eval.every=2"]
    _, lines = _run(tmp_path, "eval-ahead", *overrides, on_metrics=kill)
    err = capsys.readouterr().err
    assert "warning: the evaluation of step 2 is lost: ran on a restarted engine (rollout-0 served weights version 0" in err
    assert "recovered: rollout-0 lost its process" in err
    by_step = {m["step"]: m for m in lines}
    assert by_step[2]["eval/failed"] == 1.0 and by_step[2]["eval/step"] == 2
    assert "eval/accuracy" in by_step[4] and all(m["update_success"] == 1.0 for m in lines)
    assert [m["staleness"] for m in lines] == [0, 1, 1, 0, 1]
    # every metric, `eval/...` ones included, exported as a Ray metric (pipelines/rl/monitor.py:gauge_name)
    assert not [str(w.message) for w in recwarn if "Invalid metric name" in str(w.message)]
