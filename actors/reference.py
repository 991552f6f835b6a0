"""ReferenceActor: log-probs under the frozen initial policy, of rollout responses (the KL term)
and of preference pairs' completions (DPO)."""

from __future__ import annotations

import numpy as np
import ray

from actors.common import Restartable, limit_threads
from actors.core.reference import ReferenceScorer


@ray.remote
class ReferenceActor(Restartable):
    def __init__(self, model_dir: str, temperature: float = 1.0, threads: int = 2, dtype: str = "float32"):
        limit_threads(threads)
        self.scorer = ReferenceScorer(model_dir, temperature=temperature, dtype=dtype)

    def logprobs(self, batch: dict[str, np.ndarray]) -> np.ndarray:
        """`[N, T]` reference log-probs of the batch's response tokens."""
        return self.scorer.logprobs(batch)

    def pair_logprobs(self, pairs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """`reference_chosen`, `reference_rejected`: `[N]` summed log-probs of each pair's completions."""
        return self.scorer.pair_logprobs(pairs)
