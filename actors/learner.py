"""LearnerActor group: N actors forming one torch.distributed world running DeepSpeed,
placed on a Ray placement group whose bundles come from config."""

from __future__ import annotations

import socket

import numpy as np
import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from actors.common import fetch_each, limit_threads
from actors.core.learner import Learner, LearnerSpec
from actors.group import ActorGroup
from pipelines.algos.losses import DPOSpec, LossSpec


@ray.remote(max_restarts=0)
class LearnerActor:
    def __init__(self, threads: int = 1):
        limit_threads(threads)
        self.learner: Learner | None = None

    def address(self) -> tuple[str, int]:
        """This node's IP and a free port, for rank 0 to host the process group."""
        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        return ray.util.get_node_ip_address(), port

    def init(self, spec: LearnerSpec, rank: int, world_size: int, master_addr: str, master_port: int) -> None:
        self.learner = Learner(spec, rank, world_size, master_addr, master_port)

    def train_step(self, minibatches: list[ray.ObjectRef], loss: LossSpec) -> dict[str, float]:
        """One policy update on the step's minibatches, refs the experience buffer put in the
        object store (`ExperienceBuffer.minibatches`), fetched one at a time."""
        return self.learner.train_step(fetch_each(minibatches), loss)

    def dpo_step(self, minibatches: list[ray.ObjectRef], spec: DPOSpec) -> dict[str, float]:
        """One DPO update on the step's preference pairs, minibatch refs from the buffer."""
        return self.learner.dpo_step(fetch_each(minibatches), spec)

    def rm_step(self, minibatches: list[ray.ObjectRef]) -> dict[str, float]:
        """One reward-model update on the step's preference pairs, minibatch refs from the buffer."""
        return self.learner.rm_step(fetch_each(minibatches))

    def pair_scores(self, pairs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return self.learner.pair_scores(pairs)

    def logprobs(self, batch: dict[str, np.ndarray]) -> np.ndarray:
        return self.learner.logprobs(batch)

    def pair_logprobs(self, pairs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return self.learner.pair_logprobs(pairs)

    def state_dict(self) -> dict[str, np.ndarray]:
        return self.learner.state_dict()

    def open_weight_sync(self, host: str, port: int, world_size: int, backend: str):
        return self.learner.open_weight_sync(host, port, world_size, backend)

    def broadcast_weights(self) -> None:
        self.learner.broadcast_weights()

    def save_pretrained(self, out_dir: str) -> None:
        self.learner.save_pretrained(out_dir)

    def save_checkpoint(self, out_dir: str) -> None:
        self.learner.save_checkpoint(out_dir)

    def load_checkpoint(self, out_dir: str) -> None:
        self.learner.load_checkpoint(out_dir)


class LearnerGroup(ActorGroup):
    """Creates the placement group and the learners, and wires them into one world.
    Drive them with `run` / `run_async` (every rank must take part in each call)."""

    def __init__(self, spec: LearnerSpec, num_learners: int, cpus_per_learner: float, accelerator_type: str | None = None):
        bundle = {"CPU": cpus_per_learner}
        if spec.use_gpu:
            bundle["GPU"] = 1
        if accelerator_type:
            bundle[f"accelerator_type:{accelerator_type}"] = 0.001
        self.pg = placement_group([dict(bundle) for _ in range(num_learners)], strategy="PACK")
        ray.get(self.pg.ready(), timeout=300)
        super().__init__(
            LearnerActor.options(
                num_cpus=cpus_per_learner,
                num_gpus=1 if spec.use_gpu else 0,
                scheduling_strategy=PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=i),
            ).remote(threads=max(1, int(cpus_per_learner)))
            for i in range(num_learners)
        )
        addr, port = self.address()
        ray.get([a.init.remote(spec, rank, num_learners, addr, port) for rank, a in enumerate(self.actors)])

    def address(self) -> tuple[str, int]:
        """An address on rank 0's node with a free port, to host a process group there."""
        return ray.get(self.actors[0].address.remote())

    def state_dict_ref(self) -> ray.ObjectRef:
        """A ref to the full weights; every rank takes part (ZeRO-3 gathers), rank 0's is used."""
        return self.run_async("state_dict")[0]

    def shutdown(self) -> None:
        self.kill()
        remove_placement_group(self.pg)
