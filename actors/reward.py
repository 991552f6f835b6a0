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

    def score(self, batch: dict[str, np.ndarray], fields: dict[str, list]) -> np.ndarray:
        """One reward per row of a rollout batch. `fields` are per prompt (column -> one value per
        prompt); each row gets its prompt's, so the reward functions see one value per sample."""
        per_row = {k: [values[i] for i in batch["prompt_index"]] for k, values in fields.items()}
        return self.scorer.score(list(batch["prompt_text"]), list(batch["response_text"]), **per_row)

    def scores_by_term(self, prompts: Sequence[str], completions: Sequence[str], fields: dict[str, list]) -> dict:
        """Each term's scores and the combined raw reward (`combined`) per completion, for evaluation."""
        return self.scorer.scores_by_term(prompts, completions, **fields)
