"""RewardActor: scores completions with the configured (weighted) reward terms, and refreshes its
reward model (a `model:` term) on recent samples when told to (`reward.refresh_every`)."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence

import numpy as np
import ray

from actors.common import Restartable, checkpoint_to_restore, on_this_node
from actors.core.reward import RefreshSpec, RewardScorer
from pipelines.data.preferences import PreferencePair, pairs_from_samples
from pipelines.data.rewards import load_reward, score
from pipelines.data.storage import join, reading, writing
from pipelines.data.tasks import in_heldout


@ray.remote
class RewardActor(Restartable):
    def __init__(
        self,
        terms: Sequence[tuple[str, float]],
        normalize: bool,
        value_range: tuple[float, float],
        refresh: RefreshSpec | None = None,
        restore_root: str | None = None,
    ):
        """`restore_root`: the run's checkpoints; restarted after its process died, a refreshed
        reward model comes back from the newest whole one."""
        self.scorer = RewardScorer(terms, normalize=normalize, value_range=value_range)
        self.refresh_spec = refresh
        self.labeler = load_reward(refresh.labels) if refresh else None
        self.recent: dict[int, list[PreferencePair]] = {}  # step -> its labelled pairs, for the next refresh
        self.refreshes = 0
        if checkpoint := checkpoint_to_restore(restore_root):
            self.load(join(checkpoint, "reward"))

    def score(self, batch: dict[str, np.ndarray], fields: dict[str, list], step: int = -1) -> np.ndarray:
        """One reward per row of a rollout batch. `fields` are per prompt (column -> one value per
        prompt); each row gets its prompt's, so the reward functions see one value per sample.
        With a refresh set, the samples are also labelled and kept as `step`'s pairs for the next
        one (a retried call replaces them: scoring a step twice counts it once)."""
        per_row = {k: [values[i] for i in batch["prompt_index"]] for k, values in fields.items()}
        prompts, completions = list(batch["prompt_text"]), list(batch["response_text"])
        if self.labeler is not None:
            labels = score(self.labeler, prompts, completions, name=self.refresh_spec.labels, **per_row)
            self.recent[step] = pairs_from_samples(prompts, completions, labels, batch["prompt_index"])
            for old in sorted(self.recent)[: -self.refresh_spec.window]:
                del self.recent[old]
        return self.scorer.score(prompts, completions, **per_row)

    def refresh(self, heldout: list[PreferencePair]) -> dict[str, float]:
        """Retrain the `model:` term in place on the pairs of the recent steps (the next `score`
        uses it). Returns its Kendall tau before and after on the recent pairs of a fifth of their
        prompts, chosen by hash and not trained on (`rm_tau_recent_*`: the policy's current
        samples), and on the fixed `heldout` pairs (`rm_tau_heldout_*`); how far its scores of
        those moved (`rm_heldout_score_shift`, mean absolute change); and how many pairs it trained on."""
        model, spec = self.scorer.model_term(), self.refresh_spec
        pairs = [p for step in sorted(self.recent) for p in self.recent[step]]
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

    def save(self, location: str) -> None:
        """The refreshed reward model (Hugging Face format) and the pairs waiting for the next
        refresh, under `location` (nothing without a refresh: the reward is then fixed)."""
        if self.labeler is None:
            return
        model = self.scorer.model_term()
        with on_this_node("reward", "write", location), writing(location) as path:
            model.model.save_pretrained(path / "model", safe_serialization=True)
            model.tokenizer.save_pretrained(path / "model")
            pending = {step: [dataclasses.asdict(p) for p in pairs] for step, pairs in self.recent.items()}
            (path / "refresh_state.json").write_text(json.dumps({"refreshes": self.refreshes, "recent": pending}))

    def load(self, location: str) -> None:
        """Restore what `save` wrote: the reward model's weights, the refresh count and pending pairs."""
        if self.labeler is None:
            return
        from transformers import AutoModelForSequenceClassification  # only a refreshed model: term needs it

        with on_this_node("reward", "read", location), reading(location) as path:
            self.scorer.model_term().model = AutoModelForSequenceClassification.from_pretrained(path / "model").eval()
            state = json.loads((path / "refresh_state.json").read_text())
        self.refreshes = state["refreshes"]
        self.recent = {int(step): [PreferencePair(**p) for p in pairs] for step, pairs in state["recent"].items()}

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
