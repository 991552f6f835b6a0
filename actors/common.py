"""What every raypo actor shares: joining or starting Ray, thread limits, fetching refs, and
whether roles fit."""

from __future__ import annotations

import contextlib
import os
import socket
import sys
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import ray
from ray._common.utils import get_ray_address_file

from pipelines.data.storage import StorageError


def connect_ray(address: str | None = None, join_only: bool = False, **init_kwargs) -> bool:
    """Join the Ray cluster at `address` (or RAY_ADDRESS); without one, the cluster a `ray start`
    on this machine left its address for, if it answers; else start a local Ray sized from this
    machine (`join_only`: raise instead). Returns whether it started a local Ray.

    A GCS address where nothing answers is refused at once (ConnectionError naming it), where
    `ray.init` would retry it for minutes; a `ray start` head that died without `ray stop` leaves
    its address file behind, and a run then starts its own Ray, saying so.
    """
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
        ray.init(address="local", **init_kwargs)
        return True
    init_kwargs.pop("include_dashboard", None)  # a joined cluster has its own
    ray.init(address=address, **init_kwargs)
    return False


def read_ray_address() -> str | None:
    """The GCS address the last `ray start` on this machine left in Ray's address file, if any."""
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


def limit_threads(cpus: float) -> None:
    """Let torch use the cores this actor may use (at least one), not every core on the node:
    roles take turns within a step, so each may use the whole (small) machine."""
    import torch  # here, not at the top: serve/ imports cpu_shortfall from this module without torch

    threads = max(1, int(os.environ.get("RAYPO_THREADS_PER_ACTOR", "0")) or int(round(cpus)) or 1)
    torch.set_num_threads(threads)


def fetch_each(refs: Iterable[ray.ObjectRef]) -> Iterator:
    """Each ref's value, fetched when the loop reaches it, so one minibatch is in memory at a time."""
    for ref in refs:
        yield ray.get(ref)


def cpu_shortfall(plan: dict[str, float], cluster: dict[str, float]) -> str | None:
    """None when the CPUs of `plan` (by part) fit a cluster with `cluster` resources
    (`ray.cluster_resources()`), else what is short, naming every part.

    >>> cpu_shortfall({"learners": 1.0, "rollout": 0.2}, {"CPU": 2.0}) is None
    True
    >>> cpu_shortfall({"learners": 2.0, "rollout": 0.2}, {"CPU": 2.0})
    'needs 2.2 CPUs (learners 2, rollout 0.2) but the Ray cluster has 2'
    """
    need, have = sum(plan.values()), cluster.get("CPU", 0.0)
    if need <= have + 1e-9:
        return None
    parts = ", ".join(f"{part} {cpus:g}" for part, cpus in plan.items())
    return f"needs {need:g} CPUs ({parts}) but the Ray cluster has {have:g}"


class ResourceFitError(RuntimeError):
    """The actors of a run or an app cannot all be placed on the Ray cluster; the message names
    the resource."""


def check_fit(check: Callable[[], None], local_ray: bool) -> None:
    """Run `check`, which raises ResourceFitError when the parts do not fit. On a local Ray,
    which nothing will grow, the error stands; on a joined cluster it is printed as a warning
    and the caller goes on, since the cluster's autoscaler may add nodes."""
    try:
        check()
    except ResourceFitError as err:
        if local_ray:
            raise
        print(f"warning: {err} (now; waiting in case the cluster's autoscaler adds nodes)", file=sys.stderr)


@contextlib.contextmanager
def on_this_node(role: str, action: str, location: str) -> Iterator[None]:
    """Name the role, the node and the location in an I/O error raised inside (a path that exists
    on the driver's node may not exist on this one)."""
    try:
        yield
    except OSError as err:
        node = ray.util.get_node_ip_address() if ray.is_initialized() else "this node"
        raise StorageError(f"{role} on node {node} could not {action} {location!r}: {err}") from err
