"""ExperienceBuffer: holds each step's experience (rollout batch + advantages) as Arrow."""

from __future__ import annotations

import numpy as np
import ray

from actors.core.buffer import Buffer


@ray.remote(max_restarts=0)
class ExperienceBuffer:
    def __init__(self, max_steps: int = 1, spill_dir: str | None = None):
        self.buffer = Buffer(max_steps)
        self.spill_dir = spill_dir

    def add(self, step: int, batch: dict[str, np.ndarray], targets: dict[str, np.ndarray]) -> dict:
        """Store a step's experience (its rollout batch and the targets learned from it); spill it
        to Parquet when a spill directory is set. Returns the size."""
        size = self.buffer.add({**batch, **targets})
        if self.spill_dir:
            self.buffer.spill(f"{self.spill_dir}/step_{step:06d}.parquet")
        return size

    def minibatches(self, size: int, seed: int) -> list[dict[str, np.ndarray]]:
        return self.buffer.minibatches(size, seed)

    def size(self) -> dict:
        return self.buffer.size()
