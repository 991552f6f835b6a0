"""What every raypo actor shares: restarts, thread limits, fetching refs, and whether roles fit."""

from __future__ import annotations

import contextlib
import ctypes
import os
import sys
import time
from collections.abc import Callable, Iterable, Iterator

import ray

from pipelines.data.storage import StorageError, newest_whole


class Restartable:
    """A role whose process may die: Ray restarts it (`max_restarts`), and the driver tells a restart by its pid."""

    def pid(self) -> int:
        return os.getpid()


def checkpoint_to_restore(root: str | None) -> str | None:
    """In an actor that Ray has just restarted: the run's newest whole checkpoint under `root`, to
    restore the state the dead process held; None on a first start or when there is none yet."""
    if not root or not ray.get_runtime_context().was_current_actor_reconstructed:
        return None
    return newest_whole(root)[0]


def limit_threads(cpus: float) -> None:
    """Let torch use the cores this actor may use (at least one), not every core on the node:
    roles take turns within a step, so each may use the whole (small) machine."""
    import torch  # here, not at the top: serve/ imports cpu_shortfall from this module without torch

    torch.set_num_threads(threads_for(cpus))


# glibc's mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
HEAP_ALLOCATION_LIMIT = 1 << 30  # bytes: smaller arrays come from the heap, not each from a fresh mmap
KEPT_FREE_HEAP = (1 << 31) - 1  # bytes of free heap top kept for the next allocations (mallopt takes an int)


def reuse_freed_memory() -> bool:
    """Let this process's malloc hand a freed tensor's memory to the next allocation instead of
    giving it back to the system. By default glibc maps each array over a threshold (128 KB,
    rising to at most 32 MB as such arrays are freed) with its own mmap and unmaps it when freed,
    and returns the heap's free top beyond twice that: an update, which allocates and frees the
    same large activations and gradients at every minibatch, then faults every page of them in
    again, zeroed by the kernel. In-process, a 32-row SmolLM2 update (2 threads, this checkout)
    took 1.91-1.93 s this way against 2.15-2.21 s by default, two runs each.

    For a learner's own process only (a Ray actor's, whose tasks run on its main thread, so on
    glibc's main heap): it changes every allocation of the process. The process then holds on to
    its largest update's memory: the free top of the heap is returned only beyond
    `KEPT_FREE_HEAP`, and free blocks below a live one stay, so a spike (a batch of long
    responses) stays in its resident memory. Over 30 SmolLM2 updates of varied lengths the peak
    was 3.99 GiB against 3.93 by default. Returns whether it applied (glibc only; an older glibc
    that refuses a threshold this high keeps its defaults)."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc (musl, macOS): their allocators have neither setting
        return False
    return bool(libc.mallopt(_M_MMAP_THRESHOLD, HEAP_ALLOCATION_LIMIT)) and bool(libc.mallopt(_M_TRIM_THRESHOLD, KEPT_FREE_HEAP))


def threads_for(cpus: float) -> int:
    """The torch threads of an actor with `cpus` CPUs: RAYPO_THREADS_PER_ACTOR if set, else the
    CPUs rounded, at least one."""
    return max(1, int(os.environ.get("RAYPO_THREADS_PER_ACTOR", "0")) or int(round(cpus)) or 1)


class Fetched:
    """Each ref's value (or each list of refs' values), fetched when the loop reaches it, so one
    minibatch is in memory at a time, counting what the fetches moved: `bytes` of arrays (an
    object fetched again, a later epoch's, counts once: it is already on this node) and
    `seconds` spent in them."""

    def __init__(self, refs: Iterable[ray.ObjectRef | list[ray.ObjectRef]]):
        self.refs, self.bytes, self.seconds = list(refs), 0, 0.0

    def __iter__(self) -> Iterator:
        seen = set()
        for ref in self.refs:
            start = time.perf_counter()
            value = ray.get(ref)
            self.seconds += time.perf_counter() - start
            key = tuple(ref) if isinstance(ref, list) else ref
            if key not in seen:
                seen.add(key)
                self.bytes += nbytes(value)
            yield value

    def metrics(self) -> dict[str, float]:
        return {"fetch_bytes": float(self.bytes), "time_fetch": self.seconds}


def nbytes(value) -> int:
    """The bytes of the arrays in `value`: an array, a `Shard`, or a dict or list of them.

    >>> import numpy as np
    >>> nbytes([{"a": np.zeros(4, np.float32)}, np.zeros(2, np.int64)])
    32
    """
    if hasattr(value, "nbytes"):
        return int(value.nbytes)
    parts = value.values() if isinstance(value, dict) else value if isinstance(value, list | tuple) else []
    return sum(nbytes(v) for v in parts)


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
