"""RewardActor: scores completions with the configured (weighted) reward terms, and refreshes its
reward model (a `model:` term) on recent samples when told to (`reward.refresh_every`)."""

from __future__ import annotations

import random
from collections import deque
from collections.abc import Sequence

import numpy as np
import ray

from actors.core.reward import RefreshSpec, RewardScorer
from pipelines.data.preferences import PreferencePair, pairs_from_samples
from pipelines.data.rewards import load_reward, score


@ray.remote(max_restarts=0)
class RewardActor:
    def __init__(
        self,
        terms: Sequence[tuple[str, float]],
        normalize: bool,
        value_range: tuple[float, float],
        refresh: RefreshSpec | None = None,
    ):
        self.scorer = RewardScorer(terms, normalize=normalize, value_range=value_range)
        self.refresh_spec = refresh
        self.labeler = load_reward(refresh.labels) if refresh else None
        self.recent: deque[list[PreferencePair]] = deque(maxlen=refresh.window if refresh else 1)
        self.refreshes = 0

    def score(self, batch: dict[str, np.ndarray], fields: dict[str, list]) -> np.ndarray:
        """One reward per row of a rollout batch. `fields` are per prompt (column -> one value per
        prompt); each row gets its prompt's, so the reward functions see one value per sample.
        With a refresh set, the samples are also labelled and kept as pairs for the next one."""
        per_row = {k: [values[i] for i in batch["prompt_index"]] for k, values in fields.items()}
        prompts, completions = list(batch["prompt_text"]), list(batch["response_text"])
        if self.labeler is not None:
            labels = score(self.labeler, prompts, completions, name=self.refresh_spec.labels, **per_row)
            self.recent.append(pairs_from_samples(prompts, completions, labels, batch["prompt_index"]))
        return self.scorer.score(prompts, completions, **per_row)

    def refresh(self, heldout: list[PreferencePair]) -> dict[str, float]:
        """Retrain the `model:` term in place on the pairs of the recent steps (the next `score`
        uses it). Returns its Kendall tau before and after on a held-out fifth of those recent
        pairs (`rm_tau_recent_*`: the policy's current samples, not trained on) and on the fixed
        `heldout` pairs (`rm_tau_heldout_*`), and how many pairs it trained on."""
        model, spec = self.scorer.model_term(), self.refresh_spec
        pairs = [p for step in self.recent for p in step]
        random.Random(self.refreshes).shuffle(pairs)
        recent_heldout, train = pairs[: len(pairs) // 5], pairs[len(pairs) // 5 :]
        checks = {"recent": recent_heldout, "heldout": heldout}
        before = {name: model.tau(ps) if ps else float("nan") for name, ps in checks.items()}
        if train:
            model.fit(train, spec, seed=self.refreshes)
        after = {name: model.tau(ps) if ps else float("nan") for name, ps in checks.items()}
        self.refreshes += 1
        self.recent.clear()
        return (
            {"rm_refresh_pairs": len(train)}
            | {f"rm_tau_{name}_before": v for name, v in before.items()}
            | {f"rm_tau_{name}_after": v for name, v in after.items()}
        )

    def scores_by_term(self, prompts: Sequence[str], completions: Sequence[str], fields: dict[str, list]) -> dict:
        """Each term's scores and the combined raw reward (`combined`) per completion, for evaluation."""
        return self.scorer.scores_by_term(prompts, completions, **fields)
