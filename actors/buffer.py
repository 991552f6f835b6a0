"""ExperienceBuffer: holds each step's experience (rollout batch + targets) as Arrow, spills it to
Parquet, and cuts a step's minibatches for the learners.

The minibatches are the return values of the buffer's call, so the caller (the driver) owns
them: they stay in the object store if the buffer's process dies, and Ray re-runs a lost call
on the restarted buffer from the refs the driver holds (it needs nothing the buffer kept)."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import ray

from actors.common import Restartable
from actors.core.buffer import Buffer, CorruptSpill, enforce_limits, spill_files
from actors.core.minibatch import minibatch_count, minibatches, shards


@ray.remote
class ExperienceBuffer(Restartable):
    def __init__(self, max_steps: int = 1, spill_dir: str | None = None, max_gb: float = 0.0, max_age_hours: float = 0.0):
        """`spill_dir`: where each step is spilled to Parquet, kept within `max_gb` and
        `max_age_hours`. Restarted after its process died, the buffer takes its newest steps back
        from there, checked: a corrupt or truncated file is quarantined, never trained on."""
        self.buffer = Buffer(max_steps)
        self.spill_dir = Path(spill_dir) if spill_dir else None
        self.limits = (int(max_gb * 1e9), max_age_hours * 3600)
        self.quarantined = 0
        if self.spill_dir and ray.get_runtime_context().was_current_actor_reconstructed:
            self._reload(max_steps)

    def _reload(self, max_steps: int) -> None:
        for path in spill_files(self.spill_dir)[-max_steps:]:
            try:
                self.buffer.add(Buffer.read(path), key=int(path.stem.split("_")[1]))
            except CorruptSpill as err:
                self.quarantined += 1
                print(f"warning: {err}", file=sys.stderr, flush=True)

    def add(self, step: int, batch: dict[str, np.ndarray], targets: dict[str, np.ndarray]) -> dict:
        """Store a step's experience (its rollout batch and the targets learned from it; a retried
        call replaces the step's rows); spill it to Parquet when a spill directory is set. Returns the size."""
        self.buffer.add({**batch, **targets}, key=step)
        if self.spill_dir:
            self.buffer.spill(self.spill_dir / f"step_{step:06d}.parquet")
            enforce_limits(self.spill_dir, *self.limits)
        return self.size()

    def minibatches(self, batch: dict, targets: dict, size: int, seed: int, ranks: int = 1):
        """The learner ranks' shards of a step's minibatches (see `minibatch_refs`), one return
        value each, minibatch by minibatch."""
        parts = [s for mb in minibatches({**batch, **targets}, size, seed) for s in shards(mb, ranks)]
        return parts[0] if len(parts) == 1 else tuple(parts)

    def size(self) -> dict:
        return {**self.buffer.size(), "quarantined": self.quarantined}


def minibatch_refs(
    buffer, batch, targets, rows: int, size: int, seed: int, epochs: int = 1, ranks: int = 1
) -> list[list[ray.ObjectRef]]:
    """Refs to each learner rank's shards of a step's minibatches in training order
    (`[rank][minibatch]`, `actors.core.minibatch.Shard`), owned by the caller: the step's `rows`
    rows of `batch` and `targets` (refs) shuffled with `seed`, cut into equal minibatches of at
    most `size` rows (`actors.core.minibatch.minibatch_rows`), the same again for each of
    `epochs` passes (the same objects: a pass more copies nothing). Each rank fetches only its own
    shards, one at a time."""
    count = minibatch_count(rows, size)
    refs = buffer.minibatches.options(num_returns=count * ranks).remote(batch, targets, size, seed, ranks)
    refs = [refs] if count * ranks == 1 else list(refs)
    return [refs[rank::ranks] * epochs for rank in range(ranks)]
