"""RewardActor: scores completions with the configured (weighted) reward terms."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import ray

from actors.core.reward import RewardScorer


@ray.remote(max_restarts=0)
class RewardActor:
    def __init__(self, terms: Sequence[tuple[str, float]], normalize: bool, value_range: tuple[float, float]):
        self.scorer = RewardScorer(terms, normalize=normalize, value_range=value_range)

    def score(self, batch: dict[str, np.ndarray], answers: Sequence[str | None]) -> np.ndarray:
        """One reward per row of a rollout batch; `answers` are per prompt (rows share them by group)."""
        per_row = [answers[i] for i in batch["prompt_index"]]
        return self.scorer.score(list(batch["prompt_text"]), list(batch["response_text"]), answer=per_row)
