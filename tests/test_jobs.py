"""`raypo train` as a Ray Job: the same command connects to the cluster it is submitted to."""

import json
import sys
import time
from pathlib import Path

import pytest
import ray

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parent.parent


def test_train_runs_under_ray_job_submission(tiny_model, tmp_path):
    from ray.job_submission import JobStatus, JobSubmissionClient

    # Ray's default token auth stays on: the job client and the job's driver must pass it.
    context = ray.init(include_dashboard=True, dashboard_host="127.0.0.1", log_to_driver=False)  # sized from this machine
    try:
        client = JobSubmissionClient(f"http://{context.dashboard_url}")
        entrypoint = (
            f"{sys.executable} -m pipelines.cli train --set name=job --set training.steps=2 "
            f"--set task.eval_problems=20 --set output_dir={tmp_path}"
        )
        job = _submit_when_the_job_agent_is_up(client, entrypoint)
        deadline = time.monotonic() + 400
        while client.get_job_status(job) not in {JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.STOPPED}:
            assert time.monotonic() < deadline, "job did not finish in time"
            time.sleep(2)
        logs = client.get_job_logs(job)
        assert client.get_job_status(job) == JobStatus.SUCCEEDED, logs[-3000:]
        summary = json.loads((tmp_path / "job" / "summary.json").read_text())
        assert summary["steps"] == 2
        assert "Started a local Ray instance" not in logs  # it joined this cluster instead
    finally:
        ray.shutdown()


def _submit_when_the_job_agent_is_up(client, entrypoint: str, wait_s: float = 180) -> str:
    """Ray's job agent registers a while after the head starts (longer on a busy 2-core machine);
    until then a submission is refused with "No available agent to submit job, please try again
    later", so try again, as the message asks, for up to `wait_s` (90 s was too short once, with a
    second test run beside it)."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            return client.submit_job(entrypoint=entrypoint)
        except RuntimeError as err:
            if "No available agent" not in str(err) or time.monotonic() > deadline:
                raise
            time.sleep(3)
