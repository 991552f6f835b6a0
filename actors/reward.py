"""RewardActor: scores completions with the configured (weighted) reward terms, and refreshes its
reward model (a `model:` term) on recent samples when told to (`reward.refresh_every`)."""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

import numpy as np
import ray

from actors.core.reward import RefreshSpec, RewardScorer
from pipelines.data.preferences import PreferencePair, pairs_from_samples
from pipelines.data.rewards import load_reward, score
from pipelines.data.tasks import in_heldout


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
        uses it). Returns its Kendall tau before and after on the recent pairs of a fifth of their
        prompts, chosen by hash and not trained on (`rm_tau_recent_*`: the policy's current
        samples), and on the fixed `heldout` pairs (`rm_tau_heldout_*`); how far its scores of
        those moved (`rm_heldout_score_shift`, mean absolute change); and how many pairs it trained on."""
        model, spec = self.scorer.model_term(), self.refresh_spec
        pairs = [p for step in self.recent for p in step]
        # a salted hash: the training prompts are all outside the task's own held-out hash bucket
        checked = [in_heldout(f"rm refresh check:{p.prompt}") for p in pairs]
        checks = {"recent": [p for p, c in zip(pairs, checked, strict=True) if c], "heldout": heldout}
        train = [p for p, c in zip(pairs, checked, strict=True) if not c]
        before = {name: _check(model, ps) for name, ps in checks.items()}
        if train:
            model.fit(train, spec, seed=spec.seed * 100_003 + self.refreshes)
        after = {name: _check(model, ps) for name, ps in checks.items()}
        shift = np.abs(after["heldout"][1] - before["heldout"][1]).mean() if heldout else float("nan")
        self.refreshes += 1
        self.recent.clear()
        return (
            {"rm_refresh_pairs": len(train), "rm_heldout_score_shift": float(shift)}
            | {f"rm_tau_{name}_before": tau for name, (tau, _) in before.items()}
            | {f"rm_tau_{name}_after": tau for name, (tau, _) in after.items()}
        )

    def scores_by_term(self, prompts: Sequence[str], completions: Sequence[str], fields: dict[str, list]) -> dict:
        """Each term's scores and the combined raw reward (`combined`) per completion, for evaluation."""
        return self.scorer.scores_by_term(prompts, completions, **fields)


def _check(model, pairs: list[PreferencePair]) -> tuple[float, np.ndarray]:
    """A reward model's Kendall tau on `pairs` (nan when there are none) and its scores of their
    chosen completions: each pair is scored once."""
    if not pairs:
        return float("nan"), np.array([])
    from pipelines.data.evaluate import pairwise_tau  # imports torch: only a refresh needs it

    chosen, rejected = model.pair_scores(pairs)
    return pairwise_tau(chosen, rejected), np.array(chosen)
