"""ExperienceBuffer: holds each step's experience (rollout batch + targets) as Arrow, and
serves it to the learners as minibatches in Ray's object store."""

from __future__ import annotations

import numpy as np
import ray

from actors.core.buffer import Buffer


@ray.remote(max_restarts=0)
class ExperienceBuffer:
    def __init__(self, max_steps: int = 1, spill_dir: str | None = None):
        self.buffer = Buffer(max_steps)
        self.spill_dir = spill_dir
        self.latest_step: int | None = None

    def add(self, step: int, batch: dict[str, np.ndarray], targets: dict[str, np.ndarray]) -> dict:
        """Store a step's experience (its rollout batch and the targets learned from it); spill it
        to Parquet when a spill directory is set. Returns the size."""
        size = self.buffer.add({**batch, **targets})
        self.latest_step = step
        if self.spill_dir:
            self.buffer.spill(f"{self.spill_dir}/step_{step:06d}.parquet")
        return size

    def minibatches(self, step: int, size: int, seed: int, epochs: int = 1, added: dict | None = None) -> list[ray.ObjectRef]:
        """Refs to step `step`'s minibatches, in training order: its rows shuffled with `seed`, cut
        into equal minibatches of at most `size` rows (`actors.core.minibatch.minibatch_rows`), the
        same order again for each of `epochs` passes. Each
        minibatch is put in the object store once; learners fetch them one at a time.
        `added`: pass the ref `add` returned, so that when the step could not be stored (its reward
        failed, say) this call fails with that cause instead of not finding the step."""
        if step != self.latest_step:
            raise LookupError(f"the experience buffer holds step {self.latest_step}, not step {step}")
        refs = [ray.put(mb) for mb in self.buffer.minibatches(size, seed)]
        return refs * epochs

    def size(self) -> dict:
        return self.buffer.size()
