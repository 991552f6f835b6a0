"""ValueActor: the PPO critic, predicting values and fitting them to GAE returns."""

from __future__ import annotations

import numpy as np
import ray

from actors.common import Fetched, Restartable, checkpoint_to_restore, limit_threads, on_this_node, reuse_freed_memory
from actors.core.critic import Critic
from actors.core.minibatch import joined
from pipelines.data.storage import join, reading, writing


@ray.remote
class ValueActor(Restartable):
    def __init__(
        self, model_dir: str, lr: float, grad_clip: float, clip: float, seed: int = 0, threads: int = 2, restore_root=None
    ):
        """`restore_root`: the run's checkpoints; restarted after its process died, the critic
        comes back from the newest whole one (its updates since then are lost)."""
        limit_threads(threads)
        reuse_freed_memory()  # this process is the critic's: its updates reuse freed arrays (actors/common.py)
        self.critic = Critic(model_dir, lr=lr, grad_clip=grad_clip, clip=clip, seed=seed)
        if checkpoint := checkpoint_to_restore(restore_root):
            self.load(join(checkpoint, "critic"))

    def values(self, batch: dict[str, np.ndarray]) -> np.ndarray:
        """`[N, T]` value estimates for the batch's response positions."""
        return self.critic.values(batch)

    def train_step(self, minibatches: list[list[ray.ObjectRef]]) -> dict:
        """Clipped value-loss update towards each minibatch's `returns` around its `old_values`;
        `minibatches[rank]` are the experience buffer's refs to the learner ranks' shards
        (`minibatch_refs`), each minibatch's fetched and joined in turn."""
        fetched = Fetched(list(parts) for parts in zip(*minibatches, strict=True))
        metrics = self.critic.train_step(joined(parts) for parts in fetched)
        return metrics | {f"value_{k}": v for k, v in fetched.metrics().items()}

    def save(self, location: str) -> None:
        """Write the critic where the run's storage is (a path, or a URI it uploads to)."""
        with on_this_node("value", "write", location), writing(location) as path:
            self.critic.save(path)

    def load(self, location: str) -> None:
        with on_this_node("value", "read", location), reading(location) as path:
            self.critic.load(path)
