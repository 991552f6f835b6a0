"""Faults a run must survive or name at once (issue: faults, resumes and bad data): a dead Ray
address left behind by a head that stopped without `ray stop`."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time

import pytest
from conftest import RAYPO, ROOT


@pytest.fixture
def dead_address_file():
    """A Ray temp dir (RAY_TMPDIR, short: Ray's socket paths must fit) whose address file names a
    GCS address where nothing listens, as a `ray start` head killed without `ray stop` leaves it."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"127.0.0.1:{s.getsockname()[1]}"  # closed again: nothing answers there
    tmp = tempfile.mkdtemp(prefix="rt", dir="/tmp")
    os.makedirs(os.path.join(tmp, "ray"))
    with open(os.path.join(tmp, "ray", "ray_current_cluster"), "w") as f:
        f.write(dead)
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"} | {"RAY_TMPDIR": tmp}
    yield dead, env
    shutil.rmtree(tmp, ignore_errors=True)


def _run(cmd, env, timeout=150):
    started = time.monotonic()
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    return done, time.monotonic() - started


def test_a_dead_address_file_is_named_and_a_run_starts_its_own_ray(dead_address_file):
    dead, env = dead_address_file
    # an operation that needs a running cluster says at once that none answers there
    done, took = _run([*RAYPO, "serve", "status"], env)
    assert done.returncode == 1 and took < 60, (took, done.stderr[-2000:])
    assert f"no Ray cluster answers at {dead}" in done.stderr and "without `ray stop`" in done.stderr
    assert "Failed to connect to GCS" not in done.stderr
    # a run (what train, train-rm and tune call) starts a local Ray instead, and says why
    code = "from pipelines.cluster import connect_ray; import ray; print('local', connect_ray()); ray.shutdown()"
    done, took = _run([sys.executable, "-c", code], env)
    assert done.returncode == 0 and "local True" in done.stdout, done.stderr[-2000:]
    assert f"names {dead}, where no Ray cluster answers" in done.stderr and took < 90


def test_an_address_where_no_cluster_answers_is_refused_at_once(dead_address_file, tiny_model):
    dead, env = dead_address_file
    done, took = _run([*RAYPO, "train", "--address", dead, "--set", "training.steps=1"], env)
    assert done.returncode != 0 and took < 60, (took, done.stderr[-2000:])
    assert f"no Ray cluster answers at {dead} (--address or RAY_ADDRESS)" in done.stderr + done.stdout
