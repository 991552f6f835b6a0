"""HelperActor: the small pure steps between the roles (a step's targets, one batch from several
engines' batches, preference pairs encoded), in one long-lived process in the run's `helpers`
bundle, next to the data.

Not Ray tasks: Ray stops an idle task worker after a second when its node runs more processes
than it has CPUs (every small machine, with an engine, learners and the rest), so a task called
once a step paid a fresh worker and its imports each step (1.2-1.3 s of a SmolLM2 step)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import ray

from actors.common import Restartable
from pipelines.algos.experience import concat_batches, prepare_experience
from pipelines.data.preferences import PreferencePair, encode_pairs_for, encode_reward_pairs_for


@ray.remote(max_concurrency=2)  # a batch concatenated while the step before's targets are computed (sampling ahead)
class HelperActor(Restartable):
    @ray.method(num_returns=2)
    def prepare_experience(
        self, batch, scores, reference_logprobs, values, advantage: str, group_size: int, gamma: float, lam: float, floor: float
    ) -> tuple[dict[str, np.ndarray], dict]:
        """algos/experience.py's `prepare_experience`: the learners' targets and the step's stats."""
        return prepare_experience(batch, scores, reference_logprobs, values, advantage, group_size, gamma, lam, floor)

    def concat_batches(self, *batches: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return concat_batches(*batches)

    def encode_pairs(self, model_dir: str, pairs: Sequence[PreferencePair]) -> dict[str, np.ndarray]:
        """Policy (DPO) inputs of preference pairs, with the tokenizer in `model_dir`."""
        return encode_pairs_for(model_dir, pairs)

    def encode_reward_pairs(self, model_dir: str, pairs: Sequence[PreferencePair]) -> dict[str, np.ndarray]:
        """Reward-model inputs of preference pairs, with the tokenizer in `model_dir`."""
        return encode_reward_pairs_for(model_dir, pairs)
