"""ReferenceActor: log-probs of rollout responses under the frozen initial policy (for the KL term)."""

from __future__ import annotations

import numpy as np
import ray

from actors.common import limit_threads
from actors.core.reference import ReferenceScorer


@ray.remote(max_restarts=0)
class ReferenceActor:
    def __init__(self, model_dir: str, temperature: float = 1.0, threads: int = 2):
        limit_threads(threads)
        self.scorer = ReferenceScorer(model_dir, temperature=temperature)

    def logprobs(self, batch: dict[str, np.ndarray]) -> np.ndarray:
        """`[N, T]` reference log-probs of the batch's response tokens."""
        return self.scorer.logprobs(batch)
