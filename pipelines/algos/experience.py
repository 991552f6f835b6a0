"""Pure functions over a step's experience: one batch from several rollout actors, and the
targets the learners fit (advantages, returns, reference log-probs) with the step's summary
stats. They run in the run's helper actor (actors/helpers.py), never in the driver; plain numpy
and torch here."""

from __future__ import annotations

import numpy as np
import torch

from pipelines.algos.advantages import ADVANTAGES, AdvantageBatch, AdvantageParams


def prepare_experience(
    batch, scores, reference_logprobs, values, advantage: str, group_size: int, gamma: float, lam: float, reward_floor: float
) -> tuple[dict[str, np.ndarray], dict]:
    """The learners' targets for a rollout batch and its summary stats.

    targets: `advantages` `[N, T]`; `scored` `[N]` (False where no reward scored the sample: NaN
    in `scores`; the learners leave those out); `reference_logprobs` `[N, T]` when given (the KL
    term); `returns` and `old_values` `[N, T]` when `values` (a critic's) are given.
    stats: `reward_mean`/`_std` over the scored samples, `reward_unscored` (how many were not).
    """
    scored = np.isfinite(scores)
    mask = torch.from_numpy(batch["response_mask"])
    inputs = AdvantageBatch(
        scores=torch.from_numpy(scores).double(),
        mask=mask,
        values=None if values is None else torch.from_numpy(values).double(),
    )
    adv, returns = ADVANTAGES.get(advantage)(inputs, AdvantageParams(gamma, lam, group_size))
    targets = {"advantages": adv.float().numpy(), "scored": scored}
    if reference_logprobs is not None:
        targets["reference_logprobs"] = reference_logprobs
    if values is not None:
        targets["returns"] = returns.float().numpy()
        targets["old_values"] = values
    lengths = batch["response_mask"].sum(axis=1)
    valid = adv.float()[mask.bool() & torch.from_numpy(scored)[:, None]]
    rewards = scores[scored]
    stats = {
        "reward_mean": float(rewards.mean()) if rewards.size else None,  # None: no sample scored (JSON null)
        "reward_std": float(rewards.std()) if rewards.size else None,
        "reward_unscored": int((~scored).sum()),
        "samples": int(scored.size),
        "advantage_mean": float(valid.mean()) if valid.numel() else 0.0,
        "advantage_std": float(valid.std()) if valid.numel() > 1 else 0.0,
        "response_length": float(lengths.mean()),
        "response_tokens": int(lengths.sum()),
        "prompt_tokens": int(batch["prompt_mask"].sum()),
        # each distinct prompt once: what a learner running a group's shared prompt once computes
        "prompt_tokens_distinct": int(batch["prompt_mask"][np.unique(batch["prompt_index"], return_index=True)[1]].sum()),
        "truncated_fraction": float(1.0 - batch["finished"].mean()),
        "reward_all_zero": bool(rewards.size and np.all(rewards <= reward_floor + 1e-6)),
    }
    return targets, stats


def concat_batches(*batches: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """One batch from several rollout actors' batches: 2-D columns padded to the widest
    (prompts on the left, responses on the right), `prompt_index` offset past the earlier
    batches' prompts, rows in the order given."""
    widths = {k: max(b[k].shape[1] for b in batches) for k, v in batches[0].items() if v.ndim == 2}
    parts: dict[str, list] = {k: [] for k in batches[0]}
    offset = 0
    for b in batches:
        for k, v in b.items():
            if k in widths:
                pad = widths[k] - v.shape[1]
                # prompts are left-padded, responses right-padded
                v = np.pad(v, ((0, 0), (pad, 0) if k.startswith("prompt") else (0, pad)))
            elif k == "prompt_index":
                v = v + offset
            parts[k].append(v)
        offset += int(b["prompt_index"].max()) + 1
    return {k: np.concatenate(vs) for k, vs in parts.items()}
