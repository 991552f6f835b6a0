"""RewardScorer: the Ray-free core of the reward actor.

Combines weighted reward terms into one score per completion. A term is a rule (a built-in
name or `path/to/file.py:function`), a remote HTTP endpoint (`http://...`: timeouts, retries
with backoff, a clear error after the last try), or a Hugging Face sequence-classification
model (`model:/path/to/dir`). Terms that return None for a sample are left out of its sum; a
sample that no term scored is unscored (NaN in `score`, None in `scores_by_term`), and RL leaves
it out of the group statistics and the loss instead of counting it as a zero reward.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from pipelines.data.preferences import PreferencePair, encode_reward_pairs, reward_model_inputs
from pipelines.data.rewards import RewardFn, load_reward, score


class RewardError(RuntimeError):
    """A reward term could not score a batch; the message names the term."""


@dataclass(frozen=True)
class HttpReward:
    """POSTs `{"prompts": [...], "completions": [...], **fields}`; expects `{"rewards": [...]}`."""

    url: str
    timeout_s: float = 10.0
    retries: int = 3
    backoff_s: float = 0.5

    def __call__(self, prompts: Sequence[str], completions: Sequence[str], **fields) -> list[float | None]:
        body = json.dumps({"prompts": list(prompts), "completions": list(completions), **_jsonable(fields)}).encode()
        last_error: Exception | None = None
        for attempt in range(self.retries + 1):
            if attempt:
                time.sleep(self.backoff_s * 2 ** (attempt - 1))
            request = urllib.request.Request(self.url, data=body, headers={"Content-Type": "application/json"})
            try:
                with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
                    return json.loads(response.read())["rewards"]
            except (urllib.error.URLError, TimeoutError, ConnectionError, KeyError, json.JSONDecodeError) as err:
                last_error = err
        raise RewardError(
            f"reward URL {self.url} failed after {self.retries + 1} tries: {type(last_error).__name__}: {last_error}"
        )


def _jsonable(fields: dict) -> dict:
    return {k: [None if x is None else str(x) for x in v] for k, v in fields.items()}


class ModelReward:
    """Scores `prompt + completion` with a sequence-classification model (first logit)."""

    def __init__(self, model_dir: str):
        # Only a `model:` term needs torch and transformers (seconds to import): rule and HTTP rewards do not.
        import torch
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        self.torch = torch
        self.model = AutoModelForSequenceClassification.from_pretrained(model_dir).eval()
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)

    def __call__(self, prompts: Sequence[str], completions: Sequence[str], **_) -> list[float | None]:
        from actors.core.modeling import sequence_scores  # imports torch: only a model: term needs it

        enc = {k: self.torch.from_numpy(v) for k, v in reward_model_inputs(self.tokenizer, prompts, completions).items()}
        with self.torch.no_grad():
            return sequence_scores(self.model, enc["input_ids"], enc["attention_mask"]).tolist()

    def pair_scores(self, pairs: Sequence[PreferencePair]) -> tuple[list[float], list[float]]:
        """This model's scores of the chosen and of the rejected completion of each pair."""
        prompts = [p.prompt for p in pairs]
        return self(prompts, [p.chosen for p in pairs]), self(prompts, [p.rejected for p in pairs])

    def fit(self, pairs: Sequence[PreferencePair], spec: RefreshSpec, seed: int) -> None:
        """Train the model in place on `pairs` (Bradley-Terry, Adam with L2): `spec.steps`
        minibatches of up to `spec.batch_size` pairs drawn with `seed`."""
        from actors.core.modeling import COMPLETIONS, completion_scores  # torch: only a model: term needs it
        from pipelines.algos.losses import bradley_terry_loss

        torch = self.torch
        arrays = encode_reward_pairs(self.tokenizer, pairs)
        optimizer = torch.optim.Adam(self.model.parameters(), lr=spec.lr, weight_decay=spec.l2_coef)
        rng = np.random.default_rng(seed)
        self.model.train()
        for _ in range(spec.steps):
            rows = rng.choice(len(pairs), size=min(spec.batch_size, len(pairs)), replace=False)
            chosen, rejected = (completion_scores(self.model, arrays, rows, side) for side in COMPLETIONS)
            loss, _ = bradley_terry_loss(chosen, rejected)
            optimizer.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), spec.grad_clip)
            optimizer.step()
        self.model.eval()


@dataclass(frozen=True)
class RefreshSpec:
    """How the reward actor refreshes its `model:` term during RL (`reward.refresh_*`)."""

    labels: str = "exact_match"  # the rule reward that labels recent samples
    window: int = 1  # steps of samples kept for the next refresh
    steps: int = 50
    lr: float = 1e-4
    l2_coef: float = 1e-4
    grad_clip: float = 1.0
    batch_size: int = 64
    seed: int = 0


def make_term(spec: str) -> RewardFn:
    if spec.startswith(("http://", "https://")):
        return HttpReward(spec)
    if spec.startswith("model:"):
        return ModelReward(spec.removeprefix("model:"))
    return load_reward(spec)


class RewardScorer:
    def __init__(self, terms: Sequence[tuple[str, float]], normalize: bool = True, value_range: tuple[float, float] = (0.0, 1.0)):
        self.terms = [(spec, weight, make_term(spec)) for spec, weight in terms]
        self.normalize = normalize
        self.value_range = value_range

    def score_terms(self, prompts: Sequence[str], completions: Sequence[str], **fields) -> dict[str, list[float | None]]:
        """Each term's own scores (spec -> one float or None per completion), unweighted."""
        return {spec: score(fn, prompts, completions, name=spec, **fields) for spec, _, fn in self.terms}

    def combine(self, term_scores: dict[str, list[float | None]]) -> np.ndarray:
        """The weighted sum of the terms that scored each completion, raw; NaN where no term did.

        >>> RewardScorer([("exact_match", 1.0), ("answer_format", 0.5)]).combine(
        ...     {"exact_match": [1.0, None, None], "answer_format": [1.0, 0.0, None]}).tolist()
        [1.5, 0.0, nan]
        """
        n = len(next(iter(term_scores.values())))
        total, scored = np.zeros(n, dtype=np.float64), np.zeros(n, dtype=bool)
        for spec, weight, _ in self.terms:
            values = term_scores[spec]
            total += weight * np.array([0.0 if v is None else v for v in values])
            scored |= np.array([v is not None for v in values])
        return np.where(scored, total, np.nan)

    def scores_by_term(self, prompts: Sequence[str], completions: Sequence[str], **fields) -> dict[str, list]:
        """Each term's scores and, under `combined`, their raw weighted sum (None where no term
        scored the sample): for evaluation."""
        terms = self.score_terms(prompts, completions, **fields)
        return {**terms, "combined": [None if np.isnan(c) else float(c) for c in self.combine(terms)]}

    def model_term(self) -> ModelReward:
        """The one `model:` term (a reward model), for a refresh."""
        models = [fn for _, _, fn in self.terms if isinstance(fn, ModelReward)]
        if len(models) != 1:
            raise RewardError(f"a reward-model refresh needs exactly one model: term, got {len(models)}")
        return models[0]

    def score(self, prompts: Sequence[str], completions: Sequence[str], **fields) -> np.ndarray:
        """One float32 reward per completion: the weighted sum of the terms that scored it,
        scaled from `value_range` to [-1, 1] when `normalize` is on; NaN where no term scored it."""
        total = self.combine(self.score_terms(prompts, completions, **fields))
        if self.normalize:
            lo, hi = self.value_range
            total = np.clip(2.0 * (total - lo) / (hi - lo) - 1.0, -1.0, 1.0)
        return total.astype(np.float32)
