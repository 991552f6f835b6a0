"""LearnerActor group: N actors forming one torch.distributed world running DeepSpeed, each
in its `learner-i` bundle of the run's placement group."""

from __future__ import annotations

import socket
import time

import numpy as np
import ray
import torch

from actors.common import Fetched, Restartable, limit_threads, on_this_node, reuse_freed_memory
from actors.core.learner import Learner, LearnerSpec
from actors.group import ActorGroup
from actors.placement import Bundle, Placement
from pipelines.algos.losses import DPOSpec, LossSpec
from pipelines.data.storage import reading, writing


@ray.remote(max_restarts=0)  # a rank that dies takes its world with it: the driver rebuilds the group (LearnerLost)
class LearnerActor(Restartable):
    def __init__(self, threads: int = 1, idle_threads: int = 0):
        """`threads`: torch's threads; `idle_threads` (if more): those of an update once the
        engines beside it are idle (`train_step`'s `beside`)."""
        limit_threads(threads)
        reuse_freed_memory()  # this process is the learner's: its updates reuse freed arrays (actors/common.py)
        self.threads = torch.get_num_threads()
        self.idle_threads = max(self.threads, idle_threads)
        self.learner: Learner | None = None

    def address(self) -> tuple[str, int]:
        """This node's IP and a free port, for rank 0 to host the process group."""
        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        return ray.util.get_node_ip_address(), port

    def init(self, spec: LearnerSpec, rank: int, world_size: int, master_addr: str, master_port: int) -> None:
        self.learner = Learner(spec, rank, world_size, master_addr, master_port)

    # The updates take refs to this rank's shard of each of the step's minibatches, which the
    # experience buffer put in the object store (`minibatch_refs`), fetched one at a time; their
    # metrics add what the fetches moved (`Fetched.metrics`).
    def train_step(self, minibatches: list[ray.ObjectRef], loss: LossSpec, beside: list[ray.ObjectRef] = ()) -> dict[str, float]:
        """One policy update on the step's minibatches. `beside`: calls queued behind the work of
        the engines on this node that runs during the update (a batch sampled ahead); once all are
        done the update takes `idle_threads`, between two of the model's layers. Its metrics add
        `time_update`, the seconds this call took in the actor (its fetches included): the learn
        phase less the driver's and Ray's share."""
        fetched, threads = Fetched(minibatches), Widening(beside, self.threads, self.idle_threads)
        self.learner.between_layers = threads.check
        started = time.perf_counter()
        try:
            metrics = self.learner.train_step(fetched, loss)
        finally:
            self.learner.between_layers = lambda: None
            threads.stop()
        return metrics | side_metrics(fetched) | {"learner_threads": threads.mean(), "time_update": time.perf_counter() - started}

    def dpo_step(self, minibatches: list[ray.ObjectRef], spec: DPOSpec) -> dict[str, float]:
        """One DPO update on the step's preference pairs."""
        fetched = Fetched(minibatches)
        return self.learner.dpo_step(fetched, spec) | side_metrics(fetched)

    def rm_step(self, minibatches: list[ray.ObjectRef]) -> dict[str, float]:
        """One reward-model update on the step's preference pairs."""
        fetched = Fetched(minibatches)
        return self.learner.rm_step(fetched) | side_metrics(fetched)

    def pair_scores(self, pairs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return self.learner.pair_scores(pairs)

    def logprobs(self, batch: dict[str, np.ndarray]) -> np.ndarray:
        return self.learner.logprobs(batch)

    def pair_logprobs(self, pairs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return self.learner.pair_logprobs(pairs)

    def set_lr_scale(self, scale: float) -> None:
        self.learner.set_lr_scale(scale)

    def state_dict(self) -> dict[str, np.ndarray]:
        # Views, not copies: Ray copies the return value into the object store before this actor
        # runs its next call (it runs one at a time; with max_concurrency > 1 this would race an update).
        return self.learner.state_dict(copy=False)

    def weights_nbytes(self, as_float32: bool) -> int:
        return self.learner.weights_nbytes(as_float32)

    def open_weight_sync(self, host: str, port: int, world_size: int, backend: str):
        return self.learner.open_weight_sync(host, port, world_size, backend)

    def broadcast_weights(self) -> None:
        self.learner.broadcast_weights()

    # Each rank writes its own files where the run's storage is (a path every node reaches, or a
    # URI it uploads to), so checkpoints of learners on several nodes end up in one place.
    def save_pretrained(self, location: str) -> None:
        with on_this_node(f"learner rank {self.learner.rank}", "write", location), writing(location) as path:
            self.learner.save_pretrained(path)

    def save_checkpoint(self, location: str) -> None:
        with on_this_node(f"learner rank {self.learner.rank}", "write", location), writing(location) as path:
            self.learner.save_checkpoint(path)

    def load_checkpoint(self, location: str) -> None:
        with on_this_node(f"learner rank {self.learner.rank}", "read", location), reading(location) as path:
            self.learner.load_checkpoint(path)


def side_metrics(fetched: Fetched) -> dict[str, float]:
    """An update's metrics besides the loss's: what its fetches moved, and the rank's torch threads."""
    return fetched.metrics() | {"learner_threads": float(torch.get_num_threads())}


class Widening:
    """An update's torch threads: `threads` while any of `beside` is pending, `idle_threads` once
    all are done (looked at by `check`, in the update's own thread: OpenMP's count is per thread);
    `stop` goes back to `threads`. `mean` is the update's threads averaged over its wall time."""

    def __init__(self, beside: list[ray.ObjectRef], threads: int, idle_threads: int):
        # Futures, whose `done` is a flag read (`check` runs between every two layers); a
        # `ray.wait` there cost ~0.1 ms a call, several percent of a tiny model's update.
        self.pending, self.threads, self.idle_threads = [ref.future() for ref in beside], threads, idle_threads
        self.now, self.since, self.thread_seconds, self.seconds = threads, time.perf_counter(), 0.0, 0.0
        self.check()

    def check(self) -> None:
        if self.now == self.idle_threads:
            return
        self.pending = [future for future in self.pending if not future.done()]
        if not self.pending:
            self._set(self.idle_threads)

    def stop(self) -> None:
        self._set(self.threads)

    def mean(self) -> float:
        # rounded: a mean of one count over unequal spans comes out a float's ulp off it (3.0000000000000004)
        return round(self.thread_seconds / self.seconds, 3) if self.seconds else float(self.now)

    def _set(self, threads: int) -> None:
        elapsed, self.since = time.perf_counter() - self.since, time.perf_counter()
        self.thread_seconds, self.seconds = self.thread_seconds + elapsed * self.now, self.seconds + elapsed
        self.now = threads
        torch.set_num_threads(threads)


class LearnerLost(RuntimeError):
    """A learner rank's process died; the rest of its group, which would wait for it in their
    collectives, were stopped at once. The message names the rank and the cause."""


LIVENESS_EVERY_S = 1.0  # while a call runs, how often the group checks that no rank's process is gone


class LearnerGroup(ActorGroup):
    """The learners, one per `learner-i` bundle of the run's placement, wired into one world.
    Drive them with `run` / `run_async` (every rank must take part in each call)."""

    def __init__(
        self,
        spec: LearnerSpec,
        placement: Placement,
        num_learners: int,
        names: list[str] | None = None,
        threads: tuple[int, int] = (0, 0),
    ):
        """`names`: the ranks' actor names (for tools and dashboards), if any; `threads`: each
        rank's torch threads while the engines beside it sample, and once they are idle (0: its
        bundle's CPUs; see `LearnerActor.train_step`)."""
        roles = [f"learner-{rank}" for rank in range(num_learners)]
        self.threads = threads
        super().__init__(
            LearnerActor.options(**placement.options(role, **({"name": names[rank]} if names else {}))).remote(
                threads[0] or max(1, int(placement.options(role)["num_cpus"])), threads[1]
            )
            for rank, role in enumerate(roles)
        )
        addr, port = self.address()
        ray.get([a.init.remote(spec, rank, num_learners, addr, port) for rank, a in enumerate(self.actors)])
        self.own_placement: Placement | None = None

    @classmethod
    def on_own_placement(
        cls, spec: LearnerSpec, num_learners: int, cpus_per_learner: float, wait_s: float = 120, threads: tuple[int, int] = (0, 0)
    ) -> LearnerGroup:
        """A group in a placement group of its own (tests, tools), which `shutdown` frees too."""
        resources = {"CPU": cpus_per_learner, **({"GPU": 1.0} if spec.use_gpu else {})}
        placement = Placement([Bundle(f"learner-{i}", resources) for i in range(num_learners)], "raypo:learners", wait_s)
        try:
            group = cls(spec, placement, num_learners, threads=threads)
        except BaseException:
            placement.remove()
            raise
        group.own_placement = placement
        return group

    def run(self, method: str, *args, **kwargs) -> list:
        """Call `method` on every rank and return the results in rank order (see `wait`)."""
        refs = self.run_async(method, *args, **kwargs)
        self.wait(refs)
        try:
            return ray.get(refs)
        except ray.exceptions.RayError:
            for rank, ref in enumerate(refs):  # a dead rank, whose peers' collectives failed too ("closed by peer")?
                try:
                    ray.get(ref)
                except ray.exceptions.RayActorError as err:
                    self._lost(rank, err)
                except ray.exceptions.RayError:
                    pass
            raise

    def wait(self, refs: list[ray.ObjectRef]) -> None:
        """Wait (without fetching) until every rank's call `refs` is done. The moment a rank's
        process is gone, stop the group and raise LearnerLost, where the other ranks would wait
        for it inside a collective until its timeout (10 minutes and more)."""
        pending, probes = list(refs), {}
        while pending:
            _, pending = ray.wait(pending, num_returns=len(pending), timeout=LIVENESS_EVERY_S, fetch_local=False)
            if not pending:
                return
            for rank, actor in enumerate(self.actors):  # one probe per rank at a time, queued behind a busy rank's call
                if rank not in probes:
                    probes[rank] = actor.__ray_ready__.remote()
            ready, _ = ray.wait(list(probes.values()), num_returns=len(probes), timeout=0.2)  # a dead rank's fails at once
            for rank, probe in list(probes.items()):
                if probe in ready:
                    del probes[rank]
                    try:
                        ray.get(probe)
                    except ray.exceptions.RayActorError as err:
                        self._lost(rank, err)

    def _lost(self, rank: int, err: Exception):
        self.kill()
        cause = str(err).splitlines()[0][:300]
        raise LearnerLost(f"learner rank {rank} of {len(self.actors)} died ({cause})") from err

    def update(self, method: str, minibatches: list[list[ray.ObjectRef]], *args) -> dict[str, float]:
        """An update `method` (`train_step`, `dpo_step`, `rm_step`) on every rank, each with refs to
        its own shards (`minibatches[rank]`, from `minibatch_refs`). Returns rank 0's metrics (the
        loss's are the same on every rank; its threads and `time_update` are rank 0's own) but for
        what the fetches moved: `fetch_bytes` summed over the ranks, `time_fetch` the slowest rank's."""
        results = self.run(method, *args, each=minibatches)
        fetches = {"fetch_bytes": sum(r["fetch_bytes"] for r in results), "time_fetch": max(r["time_fetch"] for r in results)}
        return results[0] | fetches

    def address(self) -> tuple[str, int]:
        """An address on rank 0's node with a free port, to host a process group there."""
        return ray.get(self.actors[0].address.remote())

    def state_dict_ref(self) -> ray.ObjectRef:
        """A ref to the full weights; every rank takes part (ZeRO-3 gathers), rank 0's is used."""
        refs = self.run_async("state_dict")
        self.wait(refs)
        return refs[0]

    def shutdown(self) -> None:
        self.kill()
        if self.own_placement is not None:
            self.own_placement.remove()
