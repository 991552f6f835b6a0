"""ExperienceBuffer: holds each step's experience (rollout batch + targets) as Arrow, spills it to
Parquet, and cuts a step's minibatches for the learners.

The minibatches are the return values of the buffer's call, so the caller (the driver) owns
them: they stay in the object store if the buffer's process dies, and Ray re-runs a lost call
on the restarted buffer from the refs the driver holds (it needs nothing the buffer kept)."""

from __future__ import annotations

import numpy as np
import ray

from actors.common import Restartable
from actors.core.buffer import Buffer
from actors.core.minibatch import minibatch_count, minibatches


@ray.remote
class ExperienceBuffer(Restartable):
    def __init__(self, max_steps: int = 1, spill_dir: str | None = None):
        self.buffer = Buffer(max_steps)
        self.spill_dir = spill_dir

    def add(self, step: int, batch: dict[str, np.ndarray], targets: dict[str, np.ndarray]) -> dict:
        """Store a step's experience (its rollout batch and the targets learned from it; a retried
        call replaces the step's rows); spill it to Parquet when a spill directory is set. Returns the size."""
        size = self.buffer.add({**batch, **targets}, key=step)
        if self.spill_dir:
            self.buffer.spill(f"{self.spill_dir}/step_{step:06d}.parquet")
        return size

    def minibatches(self, batch: dict, targets: dict, size: int, seed: int, epochs: int = 1):
        """A step's minibatches (see `minibatch_refs`), one return value each."""
        parts = minibatches({**batch, **targets}, size, seed, epochs)
        return parts[0] if len(parts) == 1 else tuple(parts)

    def size(self) -> dict:
        return self.buffer.size()


def minibatch_refs(buffer, batch, targets, rows: int, size: int, seed: int, epochs: int = 1) -> list[ray.ObjectRef]:
    """Refs to a step's minibatches in training order, owned by the caller: the step's `rows` rows
    of `batch` and `targets` (refs) shuffled with `seed`, cut into equal minibatches of at most
    `size` rows (`actors.core.minibatch.minibatch_rows`), the same order again for each of
    `epochs` passes. Learners fetch them one at a time."""
    count = minibatch_count(rows, size, epochs)
    refs = buffer.minibatches.options(num_returns=count).remote(batch, targets, size, seed, epochs)
    return [refs] if count == 1 else list(refs)
