"""What a new user runs, run the way README shows it: `raypo train` and `raypo serve` as
subprocesses, each on a local Ray it starts itself, sized from this machine, with the tiny
model built in this test run's own fresh cache (tests/conftest.py)."""

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import psutil
import pytest

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parent.parent
RAYPO = [sys.executable, "-m", "pipelines.cli"]  # the `raypo` console script's entry point
# Measured on 2 cores (bench/reproducibility.py; README), after the sampling fixes: build seeds 0-2
# under AVX2 and AVX-512 kernels gained +29.8 to +48.8 points; seed 0, the one built here, +37.4 and
# +48.8 (before them: +30.0 to +47.0 under AVX2 and default kernels). +30 is the claim.
MIN_GAIN = 0.30


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_raypo_train_prints_a_summary_with_the_accuracy_gain(main_job):
    run_dir, summary, _ = main_job
    assert summary == json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 60 and summary["eval_problems"] == 500
    gain = summary["eval_accuracy_end"] - summary["eval_accuracy_start"]
    assert gain >= MIN_GAIN, summary
    assert (run_dir / "final" / "model.safetensors").is_file()


def _get(url: str, timeout: float = 30):  # longer than /health's own bound, so it answers first
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        return resp.status, json.loads(resp.read())


class _Output:
    """A child's stdout and stderr read as they come, as a terminal does: a pipe nobody reads
    fills up and blocks the child's next write, which a user never sees."""

    def __init__(self, process: subprocess.Popen):
        self.text = {"stdout": [], "stderr": []}
        streams = {"stdout": process.stdout, "stderr": process.stderr}
        self.readers = [threading.Thread(target=self.text[name].extend, args=(f,), daemon=True) for name, f in streams.items()]
        for reader in self.readers:
            reader.start()

    def __getitem__(self, name: str) -> str:
        return "".join(self.text[name])


@contextlib.contextmanager
def _raypo_serve(main_job, *extra: str, env: dict | None = None):
    """`raypo serve` of the main job's policy as a user starts it, in a session of its own (so
    Ctrl-C can go to the whole process group, as a terminal sends it), once `/health` answers 200
    within the issue's 3 minutes: (process, its output, base URL, the health answer). Killed by
    its process group on the way out, whatever the test did."""
    port = _free_port()
    server = subprocess.Popen(
        [*RAYPO, "serve", "--checkpoint", str(main_job[0] / "final"), "--port", str(port), *extra],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        env={**os.environ, **(env or {})},
    )
    output = _Output(server)
    try:
        deadline = time.monotonic() + 180  # the bound for a 2-core machine
        health = None
        while time.monotonic() < deadline and server.poll() is None:
            try:
                health = _get(f"http://127.0.0.1:{port}/health")
                break
            except OSError:
                time.sleep(2)
        assert server.poll() is None, output["stderr"][-4000:]
        assert health is not None and health[0] == 200, "raypo serve did not become healthy within 3 minutes"
        yield server, output, f"http://127.0.0.1:{port}", health[1]
    finally:
        with contextlib.suppress(ProcessLookupError):  # also Ray processes left by a raypo serve that died
            os.killpg(server.pid, signal.SIGKILL)


def _stops_cleanly_on_ctrl_c(server: subprocess.Popen, output: _Output) -> None:
    """Ctrl-C to the whole process group, as a terminal sends it: raypo serve exits with 130 (0),
    says "stopped", prints no traceback, and leaves none of the processes it started behind."""
    family = psutil.Process(server.pid).children(recursive=True)
    assert family, "raypo serve started no Ray processes"
    os.killpg(server.pid, signal.SIGINT)
    try:
        server.wait(timeout=120)
    except subprocess.TimeoutExpired:
        os.kill(server.pid, signal.SIGUSR1)  # raypo serve's faulthandler prints where it is stuck
        time.sleep(3)
        pytest.fail(f"raypo serve still running 120 s after Ctrl-C; its stacks:\n{output['stderr'][-6000:]}")
    for reader in output.readers:
        reader.join(30)
    stderr = output["stderr"]
    assert server.returncode in (0, 130), stderr[-4000:]
    assert "stopped" in output["stdout"], output["stdout"][-2000:]
    assert "Aborted" not in stderr and "Traceback" not in stderr, stderr[-4000:]
    time.sleep(5)  # Ray's processes get a moment to go after their driver
    strays = [p for p in family if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert not strays, [" ".join(p.cmdline()[:3]) for p in strays]


def test_raypo_serve_answers_the_openai_client_and_stops_cleanly_on_ctrl_c(main_job):
    from openai import OpenAI

    with _raypo_serve(main_job) as (server, output, base, _):
        client = OpenAI(base_url=f"{base}/v1", api_key="none")
        answer = client.completions.create(model="raypo-policy", prompt="12+7=", max_tokens=5, temperature=0)
        assert answer.choices[0].text.strip() == "19"  # the trained policy adds
        family = [_cmdline(p) for p in psutil.Process(server.pid).children(recursive=True)]
        assert not [name for name in family if "VLLM::Worker" in name], "the engine runs its model in its own process"
        # The README's `raypo serve status` (promote and rollback find the Ray the same way) reaches
        # the Ray that raypo serve started, with no address given.
        status = subprocess.run([*RAYPO, "serve", "status"], cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert status.returncode == 0 and "live" in status.stdout and "v1" in status.stdout, status.stderr[-3000:]
        _stops_cleanly_on_ctrl_c(server, output)


def _post(url: str, body: bytes, key: str | None):
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    try:
        with urllib.request.urlopen(urllib.request.Request(url, data=body, headers=headers), timeout=60) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def test_raypo_serve_engine_ingress_answers_from_the_engine_replica_with_the_key_and_schema_checks(main_job):
    """`--engine-ingress`: the engine's own replica listens on the port (no second replica on the
    way), and it keeps what the default app promises: the key, the chat schema check, /health,
    OpenAI-style errors; promote refuses, naming why; status shows its one version."""
    from openai import OpenAI

    key = "test-key-not-secret"
    with _raypo_serve(main_job, "--engine-ingress", env={"RAYPO_API_KEY": key}) as (server, output, base, health):
        assert (health["status"], health["models"], health["version"]) == ("ok", ["raypo-policy"], "v1")
        port = int(base.rsplit(":", 1)[1])
        listeners = [
            c.pid for c in psutil.net_connections("tcp") if c.laddr and c.laddr.port == port and c.status == psutil.CONN_LISTEN
        ]
        assert listeners and None not in listeners, listeners
        assert all("EngineIngress" in " ".join(psutil.Process(pid).cmdline()) for pid in listeners), [
            psutil.Process(pid).cmdline()[:2] for pid in listeners
        ]
        family = [_cmdline(p) for p in psutil.Process(server.pid).children(recursive=True)]
        assert not [name for name in family if "VLLM::Worker" in name], "the engine runs its model in its own process"
        client = OpenAI(base_url=f"{base}/v1", api_key=key)
        assert [m.id for m in client.models.list().data] == ["raypo-policy"]
        answer = client.completions.create(model="raypo-policy", prompt="12+7=", max_tokens=5, temperature=0)
        assert answer.choices[0].text.strip() == "19"
        chat = [{"role": "user", "content": "12+7="}]
        stream = client.chat.completions.create(model="raypo-policy", messages=chat, max_tokens=5, temperature=0, stream=True)
        assert "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices).strip() == "19"
        plain = json.dumps({"model": "raypo-policy", "prompt": "1+1="}).encode()
        for wrong in (None, "wrong"):
            status, body = _post(f"{base}/v1/completions", plain, wrong)
            assert status == 401 and body["error"]["type"] == "invalid_request_error", body
        bad_chat = json.dumps({"model": "raypo-policy", "messages": [{"role": "user"}]}).encode()
        status, body = _post(f"{base}/v1/chat/completions", bad_chat, key)
        assert status == 400 and body["error"]["message"].startswith("messages[0].content: required for role 'user'"), body
        status, body = _post(f"{base}/v1/completions", b"{not json", key)
        assert status == 400 and body["error"]["message"], body
        status, body = _post(f"{base}/v1/completions", json.dumps({"model": "nope", "prompt": "1+1="}).encode(), key)
        assert status == 404 and "nope" in body["error"]["message"], body
        promote = [*RAYPO, "serve", "promote", str(main_job[0] / "final")]
        refused = subprocess.run(promote, cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert refused.returncode == 1 and "--engine-ingress" in refused.stderr, refused.stderr[-3000:]
        status = subprocess.run([*RAYPO, "serve", "status"], cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert status.returncode == 0 and "v1       live" in status.stdout and "--engine-ingress" in status.stdout, status
        assert client.completions.create(model="raypo-policy", prompt="12+7=", max_tokens=5, temperature=0).choices[0].text
        metrics = urllib.request.Request(f"{base}/metrics", headers={"Authorization": f"Bearer {key}"})
        with urllib.request.urlopen(metrics, timeout=30) as resp:  # the engine's metrics, from vLLM's own route
            assert "vllm:generation_tokens" in resp.read().decode()
        _stops_cleanly_on_ctrl_c(server, output)


def _cmdline(process: psutil.Process) -> str:
    with contextlib.suppress(psutil.Error):  # a process that ended meanwhile
        return " ".join(process.cmdline())
    return ""


def test_raypo_serve_says_at_once_when_the_app_cannot_fit_or_cannot_listen(main_job):
    run = subprocess.run(  # said at once: well before Serve's own scheduling waits would end
        [*RAYPO, "serve", "--checkpoint", str(main_job[0] / "final"), "--cpus-per-replica", "64"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=150,
    )
    assert run.returncode == 2, run.stderr[-3000:]
    assert "the app needs 64.1 CPUs" in run.stderr and "--cpus-per-replica" in run.stderr, run.stderr[-3000:]
    run = subprocess.run(  # the engine replica listens on the port itself: a second one could not
        [*RAYPO, "serve", "--checkpoint", str(main_job[0] / "final"), "--engine-ingress", "--max-replicas", "2"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=150,
    )
    assert run.returncode == 2 and "one replica only" in run.stderr and "--proxy" in run.stderr, run.stderr[-3000:]
