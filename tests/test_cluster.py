"""A multi-node cluster on this machine (`raypo cluster up`, Ray's fake provider with cluster.yaml's
node types): `ray job submit ... raypo train` spreads the roles over the node types, writes the
checkpoint to training.storage_path, and `ray job stop` leaves no actor or placement group.

The cluster's processes are all this machine's; the job client and dashboard talk to 127.0.0.1.
Everything the module starts is stopped by pid at the end, even when a test fails."""

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from pipelines.cluster import cluster_processes

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parent.parent
RAYPO = [sys.executable, "-m", "pipelines.cli"]
DASHBOARD = "http://127.0.0.1:8265"


@pytest.fixture(scope="module")
def cluster(tiny_model):
    root = Path(tempfile.mkdtemp(prefix="rc-", dir="/tmp"))  # short: Ray's socket paths live under it
    # The job's driver runs on the head with the cluster's environment: this venv's `raypo` first on PATH.
    env = {**os.environ, "RAYPO_CLUSTER_DIR": str(root), "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    try:
        up = subprocess.run([*RAYPO, "cluster", "up"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
        assert up.returncode == 0, up.stdout[-2000:] + up.stderr[-3000:]
        yield env, up.stdout
    finally:
        subprocess.run([*RAYPO, "cluster", "down"], cwd=ROOT, env=env, capture_output=True, timeout=120)
        left = cluster_processes(root)
        for proc in left:  # `down` missed them: stop them here, still by pid
            proc.kill()
        shutil.rmtree(root, ignore_errors=True)
        assert not left, f"raypo cluster down left {len(left)} processes"


def _jobs(env, command, *args, timeout=60) -> subprocess.CompletedProcess:
    """`ray job <command> --address <dashboard> <args>` (args may end in `-- <entrypoint>`)."""
    job_env = {**env, "RAY_AUTH_MODE": "token"}  # the cluster's token auth: the client sends ~/.ray/auth_token
    return subprocess.run(
        [str(Path(sys.executable).with_name("ray")), "job", command, "--address", DASHBOARD, *args],
        cwd=ROOT, env=job_env, capture_output=True, text=True, timeout=timeout,
    )  # fmt: skip


def _wait_status(env, job_id: str, done: set[str], wait_s: float) -> str:
    deadline = time.monotonic() + wait_s
    while True:
        run = _jobs(env, "status", job_id)
        out = (run.stdout + run.stderr).upper()  # "Job 'x' succeeded", "... is currently RUNNING", on stderr
        status = next((s for s in ("SUCCEEDED", "FAILED", "STOPPED", "RUNNING", "PENDING") if s in out), "?")
        if status in done or time.monotonic() > deadline:
            return status
        time.sleep(3)


def test_cluster_up_has_a_head_and_worker_nodes_of_two_types(cluster):
    env, printed = cluster
    status = subprocess.run([*RAYPO, "cluster", "status"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert status.returncode == 0, status.stderr
    types = sorted(line.split()[1] for line in status.stdout.splitlines()[1:] if line.strip())
    assert types == ["head", "learner", "rollout"], status.stdout


def test_a_submitted_run_spreads_its_roles_over_the_node_types_and_stores_its_checkpoint(cluster, tmp_path):
    env, _ = cluster
    store = tmp_path / "store"
    submitted = _jobs(
        env, "submit", "--no-wait", "--working-dir", ".", "--",
        "raypo", "train", "-c", "configs/grpo_tiny.yaml", "--set", "training.steps=3",
        "--set", f"training.storage_path={store}", "--set", "task.eval_problems=20",
    )  # fmt: skip
    assert submitted.returncode == 0, submitted.stderr[-2000:]
    job_id = _job_id(submitted)
    status = _wait_status(env, job_id, {"SUCCEEDED", "FAILED", "STOPPED"}, wait_s=600)
    logs = _jobs(env, "logs", job_id).stdout
    assert status == "SUCCEEDED", logs[-4000:]

    summary = json.loads((store / "grpo_tiny" / "summary.json").read_text())
    where = {p["role"]: p for p in summary["placement"]}
    assert where["learner-0"]["node_type"] == "learner" and where["rollout-0"]["node_type"] == "rollout"
    assert where["reference"]["node_type"] == "rollout"
    assert where["learner-0"]["node_id"] != where["rollout-0"]["node_id"]
    assert "placed learner-0 on node" in logs
    checkpoint = store / "grpo_tiny" / "checkpoints" / "step_000003"
    assert (checkpoint / "policy" / "model.safetensors").is_file() and (checkpoint / "deepspeed").is_dir()
    assert summary["checkpoint"] == str(checkpoint) and (store / "grpo_tiny" / "final" / "config.json").is_file()


def test_ray_job_stop_leaves_no_actors_or_placement_groups(cluster, tmp_path):
    env, _ = cluster
    submitted = _jobs(
        env, "submit", "--no-wait", "--working-dir", ".", "--",
        "raypo", "train", "--set", "training.steps=200", "--set", f"output_dir={tmp_path}",
    )  # fmt: skip
    job_id = _job_id(submitted)
    deadline = time.monotonic() + 300
    while "placed learner-0" not in (logs := _jobs(env, "logs", job_id).stdout):  # its roles are up
        assert time.monotonic() < deadline, logs[-3000:]
        time.sleep(3)
    stopped = _jobs(env, "stop", job_id, timeout=120)
    assert stopped.returncode == 0, stopped.stderr[-2000:]
    assert _wait_status(env, job_id, {"STOPPED", "FAILED", "SUCCEEDED"}, wait_s=120) == "STOPPED"
    deadline = time.monotonic() + 60
    while (left := _alive_actors_and_groups(env)) != ([], []):
        assert time.monotonic() < deadline, f"left behind after ray job stop: {left}"
        time.sleep(3)


def _job_id(submitted: subprocess.CompletedProcess) -> str:
    words = [w.strip("'\"") for w in (submitted.stdout + submitted.stderr).split()]
    found = [w for w in words if w.startswith("raysubmit_")]
    assert found, submitted.stdout[-2000:] + submitted.stderr[-2000:]
    return found[0]


def _alive_actors_and_groups(env) -> tuple[list, list]:
    """Actors not DEAD and placement groups not REMOVED on the cluster, by Ray's state API (a subprocess)."""
    code = (
        "import json; from ray.util.state import list_actors, list_placement_groups\n"
        f"a = [x.class_name for x in list_actors(address={DASHBOARD!r}, limit=1000) if x.state != 'DEAD'"
        " and x.class_name != 'JobSupervisor']\n"
        f"g = [x.placement_group_id for x in list_placement_groups(address={DASHBOARD!r}, limit=1000) if x.state != 'REMOVED']\n"
        "print(json.dumps([a, g]))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], env={**env, "RAY_AUTH_MODE": "token"}, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr[-2000:]
    actors, groups = json.loads(out.stdout.strip().splitlines()[-1])
    return actors, groups
