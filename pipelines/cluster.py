"""`raypo cluster up|down|status`: a multi-node Ray cluster on this machine with cluster.yaml's
node types, from Ray's fake multi-node provider, started and stopped by process id.

Ray 2.60's `ray up` fails with that provider; `RAY_FAKE_CLUSTER=1 ray start --head
--autoscaling-config=FILE` works when FILE holds every launcher key (Ray's monitor reads them)
and the head keeps GCS port 6379 (the fake nodes join there). Every process of the cluster runs
with its temp dir under the state directory, which is how `down` finds them all: no `ray stop`,
which would end every Ray of the user.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import yaml

from pipelines.config import node_kind

GCS_PORT = 6379  # the fake provider's worker nodes join the GCS on this port
DASHBOARD_PORT = 8265
FAKE_HEAD_TYPE = "ray.head.default"
# Ray's token auth (the token in ~/.ray/auth_token, made by Ray on first use): every client of
# the cluster, `ray job submit` included, runs with RAY_AUTH_MODE=token to send it.
AUTH_MODE = "token"  # the type Ray's fake provider tags its head node with
LAUNCHER_DEFAULTS = {
    "upscaling_speed": 1.0,
    "idle_timeout_minutes": 60,
    "provider": {
        "type": "fake_multinode",
        "use_node_id_as_ip": True,
        "disable_node_updaters": True,
        "disable_launch_config_check": True,
    },
    "auth": {"ssh_user": "ubuntu"},
    "docker": {},
    "file_mounts": {},
    "cluster_synced_files": [],
    "file_mounts_sync_continuously": False,
    "rsync_exclude": [],
    "rsync_filter": [],
    "initialization_commands": [],
    "setup_commands": [],
    "head_setup_commands": [],
    "worker_setup_commands": [],
    "head_start_ray_commands": [],
    "worker_start_ray_commands": [],
}


class ClusterError(RuntimeError):
    """The local cluster cannot be started, found or stopped; the message says why and what to do."""


def state_dir() -> Path:
    """Where the cluster keeps its launcher config, pids and Ray temp dir (short: Ray's socket paths live under it)."""
    return Path(os.environ.get("RAYPO_CLUSTER_DIR", "/tmp/raypo-cluster"))


def launcher_config(user: dict) -> tuple[dict, dict]:
    """The autoscaling config Ray's monitor takes, from a short cluster file like
    configs/fake_cluster.yaml; and the head node type's resources (for `ray start --head`).

    >>> cfg, head = launcher_config({"available_node_types": {"head": {"resources": {"CPU": 0}},
    ...     "rollout": {"resources": {"CPU": 1}, "min_workers": 1, "max_workers": 1}}, "head_node_type": "head"})
    >>> sorted(cfg["available_node_types"]), cfg["head_node_type"], head, cfg["provider"]["type"]
    (['ray.head.default', 'rollout'], 'ray.head.default', {'CPU': 0}, 'fake_multinode')
    """
    types = dict(user.get("available_node_types") or {})
    head_type = user.get("head_node_type", "head")
    if head_type not in types:
        raise ClusterError(f"head_node_type {head_type!r} is not one of available_node_types {sorted(types)}")
    head = dict(types.pop(head_type).get("resources") or {})
    workers = {}
    for name, spec in types.items():
        workers[name] = {
            "resources": dict(spec.get("resources") or {}),
            "node_config": {},
            "min_workers": int(spec.get("min_workers", 0)),
            "max_workers": int(spec.get("max_workers", spec.get("min_workers", 0))),
        }
    node_types = {FAKE_HEAD_TYPE: {"resources": head, "node_config": {}, "max_workers": 0}, **workers}
    config = {
        **LAUNCHER_DEFAULTS,
        "cluster_name": user.get("cluster_name", "raypo-fake"),
        "max_workers": int(user.get("max_workers", sum(w["max_workers"] for w in workers.values()))),
        "available_node_types": node_types,
        "head_node_type": FAKE_HEAD_TYPE,
    }
    return config, head


def _cmdline(proc: psutil.Process) -> str:
    with contextlib.suppress(psutil.Error):  # a process that ended meanwhile
        return " ".join(proc.cmdline())
    return ""


def cluster_processes(root: Path) -> list[psutil.Process]:
    """Every process of the cluster under `root`: those whose command line names its temp dir, and their children."""
    marker = str(root / "ray")
    found: dict[int, psutil.Process] = {}
    for proc in psutil.process_iter(["cmdline"]):
        with contextlib.suppress(psutil.Error):
            if any(marker in part for part in proc.info["cmdline"] or []):
                found[proc.pid] = proc
                found.update((child.pid, child) for child in proc.children(recursive=True))
    found.pop(os.getpid(), None)
    return list(found.values())


def _as_client() -> None:
    """Make this process a client of the cluster's token auth; Ray reads the mode when it is
    first imported, so this runs before any Ray import here."""
    if "ray" in sys.modules and os.environ.get("RAY_AUTH_MODE") != AUTH_MODE:
        raise ClusterError("Ray was imported before RAY_AUTH_MODE=token was set: run this in a fresh process")
    os.environ["RAY_AUTH_MODE"] = AUTH_MODE


def up(config_path: str | Path, wait_s: float = 180) -> dict:
    """Start the head and wait until every node type's min_workers have joined. Returns the state."""
    _as_client()
    root = state_dir()
    if cluster_processes(root):
        raise ClusterError(f"a cluster is already running from {root}: `raypo cluster down` first")
    path = Path(config_path)
    if not path.is_file():
        raise ClusterError(f"cluster file {str(path)!r} does not exist")
    config, head = launcher_config(yaml.safe_load(path.read_text()) or {})
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    launcher = root / "autoscaling.yaml"
    launcher.write_text(yaml.safe_dump(config, sort_keys=False))
    ray_bin = Path(sys.executable).with_name("ray")
    head_cpus = head.pop("CPU", 0)
    command = [
        str(ray_bin), "start", "--head", f"--port={GCS_PORT}", f"--num-cpus={int(head_cpus)}",
        f"--resources={json.dumps(head)}", f"--autoscaling-config={launcher}", f"--temp-dir={root / 'ray'}",
        "--dashboard-host=127.0.0.1", f"--dashboard-port={DASHBOARD_PORT}", "--include-dashboard=true",
        "--disable-usage-stats",
    ]  # fmt: skip
    # The nodes run this Python environment: a job's `raypo ...` entrypoint is found on their PATH.
    search_path = f"{ray_bin.parent}{os.pathsep}{os.environ.get('PATH', '')}"
    env = {**os.environ, "RAY_FAKE_CLUSTER": "1", "RAY_AUTH_MODE": AUTH_MODE, "PATH": search_path}
    started = subprocess.run(command, env=env, capture_output=True, text=True)
    if started.returncode != 0:
        down()
        raise ClusterError(f"`ray start --head` failed: {(started.stderr or started.stdout).strip()[-1500:]}")
    expected = {name: spec["min_workers"] for name, spec in config["available_node_types"].items() if spec.get("min_workers")}
    try:
        nodes = _wait_for_nodes(expected, wait_s)
    except BaseException:
        down()
        raise
    state = {
        "config": str(path.resolve()),
        "gcs_address": f"{_node_ip()}:{GCS_PORT}",
        "dashboard": f"http://127.0.0.1:{DASHBOARD_PORT}",
        "temp_dir": str(root / "ray"),
        "nodes": nodes,
    }
    (root / "state.json").write_text(json.dumps(state, indent=2))
    return state


def _node_ip() -> str:
    from ray._private.services import get_node_ip_address  # the address `ray start` picked for the head

    return get_node_ip_address()


def _wait_for_nodes(expected: dict[str, int], wait_s: float) -> list[dict]:
    """Poll the cluster until it has `expected` alive nodes of each type; the nodes then."""
    deadline = time.monotonic() + wait_s
    while True:
        nodes = describe_nodes()
        have = {kind: sum(n["type"] == kind for n in nodes) for kind in expected}
        if all(have[k] >= n for k, n in expected.items()):
            return nodes
        if time.monotonic() > deadline:
            raise ClusterError(
                f"worker nodes did not join within {wait_s:g} s: have {have}, want {expected}; "
                f"see {state_dir() / 'ray'}/session_latest/logs/monitor.*"
            )
        time.sleep(3)


def describe_nodes() -> list[dict]:
    """The alive nodes of the cluster at this machine's GCS port: id, type, resources."""
    import ray  # here: `raypo cluster down` and `--help` need no Ray client

    ray.init(address=f"{_node_ip()}:{GCS_PORT}", log_to_driver=False, logging_level="ERROR")
    try:
        out = []
        for node in ray.nodes():
            if not node["Alive"]:
                continue
            resources = node["Resources"]
            out.append(
                {
                    "node_id": node["NodeID"][-12:],
                    "type": node_kind(resources) or "?",
                    "resources": {k: v for k, v in resources.items() if not k.startswith("node:") and "memory" not in k},
                }
            )
        return out
    finally:
        ray.shutdown()


def down(wait_s: float = 30) -> int:
    """Stop every process of the cluster by pid, the GCS last (SIGTERM, then SIGKILL after
    `wait_s`); how many. Sent SIGTERM together with the rest, the GCS outlived a 20 s wait;
    once they are gone it exits in about 2 s."""
    procs = cluster_processes(state_dir())
    gcs = [proc for proc in procs if "gcs_server" in _cmdline(proc)]
    for group in ([proc for proc in procs if proc not in gcs], gcs):
        for proc in group:
            with contextlib.suppress(psutil.Error):
                proc.terminate()
        _, alive = psutil.wait_procs(group, timeout=wait_s)
        for proc in alive:
            with contextlib.suppress(psutil.Error):
                proc.kill()
        psutil.wait_procs(alive, timeout=10)
    with contextlib.suppress(FileNotFoundError):
        (state_dir() / "state.json").unlink()
    return len(procs)


def status() -> dict | None:
    """The running cluster's state with its nodes now, or None when none runs from state_dir()."""
    state_file = state_dir() / "state.json"
    if not state_file.is_file() or not cluster_processes(state_dir()):
        return None
    _as_client()
    return {**json.loads(state_file.read_text()), "nodes": describe_nodes()}


def format_nodes(nodes: list[dict]) -> str:
    """One line per node: id, type, resources.

    >>> print(format_nodes([{"node_id": "ab12cd34ef56", "type": "learner", "resources": {"CPU": 1.0}}]))
    ab12cd34ef56  learner   CPU=1
    """
    return "\n".join(
        f"{n['node_id']:<12}  {n['type']:<8}  " + " ".join(f"{k}={v:g}" for k, v in sorted(n["resources"].items())) for n in nodes
    )


def connect_ray(
    address: str | None = None, join_only: bool = False, local_env: dict[str, str] | None = None, **init_kwargs
) -> bool:
    """Join the Ray cluster at `address` (or RAY_ADDRESS); without one, the cluster a `ray start`
    on this machine left its address for, if it answers; else start a local Ray sized from this
    machine (`join_only`: raise instead). Returns whether it started a local Ray.

    A GCS address where nothing answers is refused at once (ConnectionError naming it), where
    `ray.init` would retry it for minutes; a `ray start` head that died without `ray stop` leaves
    its address file behind, and a run then starts its own Ray, saying so. `local_env` is set in
    this process's environment just before a local Ray starts, so every Ray process inherits it.
    """
    import ray  # here: `raypo cluster` runs its commands through the ray CLI and needs no Ray in this process
    from ray._common.utils import get_ray_address_file

    address = address or os.environ.get("RAY_ADDRESS") or None
    if address in (None, "auto"):
        left = read_ray_address()
        if left and not gcs_answers(left):
            where = get_ray_address_file(None)
            if join_only or address == "auto":
                raise ConnectionError(
                    f"no Ray cluster answers at {left}, the address {where} names (its head stopped without `ray stop`); "
                    "start one (`ray start --head`, `raypo cluster up`) or pass --address"
                )
            print(
                f"note: {where} names {left}, where no Ray cluster answers (a head that stopped without `ray stop`); "
                "starting a local Ray for this run",
                file=sys.stderr,
            )
            address = "local"
        elif left:
            address = left
    elif "://" not in address and address != "local" and not gcs_answers(address):
        raise ConnectionError(
            f"no Ray cluster answers at {address} (--address or RAY_ADDRESS): start it (`ray start --head`, `raypo cluster up`), "
            "or leave both unset to run on a local Ray"
        )
    if address in (None, "local"):
        if join_only:
            raise ConnectionError("no running Ray cluster: start one (`ray start --head`, `raypo cluster up`) or pass --address")
        os.environ.update(local_env or {})
        ray.init(address="local", **init_kwargs)
        return True
    init_kwargs.pop("include_dashboard", None)  # a joined cluster has its own
    ray.init(address=address, **init_kwargs)
    return False


def read_ray_address() -> str | None:
    """The GCS address the last `ray start` on this machine left in Ray's address file, if any."""
    from ray._common.utils import get_ray_address_file  # here: see connect_ray

    path = get_ray_address_file(None)
    try:
        return Path(path).read_text().strip() or None
    except OSError:
        return None


def gcs_answers(address: str, timeout_s: float = 2.0) -> bool:
    """Whether anything listens at a Ray GCS `host:port`."""
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host or "127.0.0.1", int(port)), timeout=timeout_s):
            return True
    except (OSError, ValueError):
        return False
