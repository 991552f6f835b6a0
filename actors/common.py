"""What every raypo actor shares: thread limits and the Ray options of a role."""

from __future__ import annotations

import os


def limit_threads(cpus: float) -> None:
    """Let torch use the cores this actor may use (at least one), not every core on the node:
    roles take turns within a step, so each may use the whole (small) machine."""
    import torch

    threads = max(1, int(os.environ.get("RAYPO_THREADS_PER_ACTOR", "0")) or int(round(cpus)) or 1)
    torch.set_num_threads(threads)
