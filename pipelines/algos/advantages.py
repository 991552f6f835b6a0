"""Advantage estimators: GAE for PPO, group baselines for GRPO and friends.

Every registered estimator takes the same `AdvantageBatch` and `AdvantageParams` and returns
`(advantages, returns)`, both `[B, T]` and zero outside the response mask, so the trainer
looks an estimator up by name and never special-cases one.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from pipelines.registry import Registry

AdvantageFn = Callable[["AdvantageBatch", "AdvantageParams"], tuple[Tensor, Tensor]]
ADVANTAGES: Registry[AdvantageFn] = Registry("advantage estimator")
register_advantage = ADVANTAGES.register

GROUP_METHODS = ("grpo", "dr_grpo", "reinforce_baseline", "rloo")


@dataclass(frozen=True)
class AdvantageBatch:
    """What an estimator may read. `scores` is one scalar per sequence (the reward), NaN for a
    sample no reward scored: such samples get advantage 0 and count in no group statistic;
    `token_rewards` are extra per-token rewards such as a KL penalty, added to GAE's
    per-token reward; `values` are the critic's estimates (GAE only)."""

    scores: Tensor  # [B]
    mask: Tensor  # [B, T], 1 on response tokens, right-padded
    values: Tensor | None = None  # [B, T]
    token_rewards: Tensor | None = None  # [B, T]


@dataclass(frozen=True)
class AdvantageParams:
    gamma: float = 0.99
    lam: float = 0.95
    group_size: int = 8
    eps: float = 1e-6


def compute_gae(rewards: Tensor, values: Tensor, mask: Tensor, gamma: float, lam: float) -> tuple[Tensor, Tensor]:
    """Generalized Advantage Estimation (Schulman et al. 2016, Eq. 16).

    rewards, values, mask: `[B, T]`, `mask` right-padded (1 on response tokens). Rewards and
    values outside the mask are ignored and the value after the last response token is 0.
    Returns `(advantages, returns)`, `[B, T]`, zero outside the mask; returns = A + V.
    No whitening here: the caller decides.
    """
    valid = mask.bool()
    rewards = torch.where(valid, rewards, torch.zeros_like(rewards))
    values = torch.where(valid, values, torch.zeros_like(values))
    mask_f = valid.to(rewards.dtype)
    B, T = rewards.shape
    advantages = torch.zeros_like(rewards)
    running = torch.zeros(B, dtype=rewards.dtype, device=rewards.device)  # [B]
    for t in reversed(range(T)):
        # next_mask is 0 after the last response token, so V(end) = 0 and the sum stops there.
        next_mask = mask_f[:, t + 1] if t + 1 < T else torch.zeros_like(running)
        next_value = values[:, t + 1] * next_mask if t + 1 < T else torch.zeros_like(running)
        delta = rewards[:, t] + gamma * next_value - values[:, t]  # [B]
        running = delta + gamma * lam * next_mask * running
        advantages[:, t] = running
    advantages = advantages * mask_f
    returns = (advantages + values) * mask_f
    return advantages, returns


def group_advantages(rewards: Tensor, group_size: int, method: str, eps: float = 1e-6) -> Tensor:
    """Group-relative advantages for `rewards` `[B*G]`, grouped contiguously.

    - grpo: (r - mean) / (std + eps), unbiased std (DeepSeekMath, Eq. 3 of GRPO)
    - dr_grpo, reinforce_baseline: r - mean (Dr. GRPO drops the std division)
    - rloo: r - mean of the other G-1 rewards (Ahmadian et al. 2024)

    NaN rewards (unscored samples) are left out: each group's statistics are over its n scored
    members (G becomes n), and unscored samples, and groups with too few scored members for the
    method (under 2 for grpo and rloo, none otherwise), get advantage 0.

    >>> group_advantages(torch.tensor([1.0, 0.0, float("nan"), 0.0]), 4, "dr_grpo").mul(3).round().tolist()
    [2.0, -1.0, 0.0, -1.0]
    """
    if method not in GROUP_METHODS:
        raise ValueError(f"unknown group advantage method {method!r}; known: {GROUP_METHODS}")
    if group_size < 1 or rewards.numel() % group_size:
        raise ValueError(f"{rewards.numel()} rewards do not split into groups of {group_size}")
    if method in ("grpo", "rloo") and group_size < 2:
        raise ValueError(f"{method} needs group_size >= 2, got {group_size}")
    grouped = rewards.reshape(-1, group_size)  # [B*G] -> [B, G]
    scored = ~torch.isnan(grouped)  # [B, G]
    values = torch.where(scored, grouped, torch.zeros_like(grouped))
    n = scored.sum(dim=1, keepdim=True).to(grouped.dtype)  # [B, 1] scored members per group
    mean = values.sum(dim=1, keepdim=True) / n.clamp(min=1)  # [B, 1]
    centred = torch.where(scored, values - mean, torch.zeros_like(values))
    if method == "grpo":
        std = (centred.square().sum(dim=1, keepdim=True) / (n - 1).clamp(min=1)).sqrt()  # unbiased, [B, 1]
        out = centred / (std + eps)
    elif method == "rloo":
        # r - (sum - r) / (n - 1) == n / (n - 1) * (r - mean)
        out = centred * n / (n - 1).clamp(min=1)
    else:
        out = centred
    enough = n >= (2 if method in ("grpo", "rloo") else 1)  # [B, 1]
    return torch.where(enough & scored, out, torch.zeros_like(out)).reshape(-1)  # [B, G] -> [B*G]


@register_advantage("gae")
def _gae(batch: AdvantageBatch, params: AdvantageParams) -> tuple[Tensor, Tensor]:
    if batch.values is None:
        raise ValueError("advantage estimator 'gae' needs critic values (use PPO with a value model)")
    scored = ~torch.isnan(batch.scores)  # [B]; an unscored sample gets no reward and no advantage
    mask = batch.mask * scored[:, None].to(batch.mask.dtype)
    rewards = _score_at_last_token(torch.nan_to_num(batch.scores, nan=0.0), mask)
    if batch.token_rewards is not None:
        rewards = rewards + batch.token_rewards
    return compute_gae(rewards, batch.values, mask, params.gamma, params.lam)


def _score_at_last_token(scores: Tensor, mask: Tensor) -> Tensor:
    """Place each sequence's scalar score on its last response token: `[B]` -> `[B, T]`."""
    last = (mask.long().sum(dim=1) - 1).clamp(min=0)  # [B]
    out = torch.zeros(mask.shape, dtype=scores.dtype, device=scores.device)
    out[torch.arange(mask.shape[0], device=mask.device), last] = scores
    return out * mask.to(scores.dtype)


def _make_group_estimator(method: str) -> AdvantageFn:
    def estimator(batch: AdvantageBatch, params: AdvantageParams) -> tuple[Tensor, Tensor]:
        mask_f = batch.mask.to(batch.scores.dtype)
        adv = group_advantages(batch.scores, params.group_size, method, params.eps)  # [B]
        # Every token of a response shares its sequence's advantage; "returns" is the score (0 if unscored).
        return adv[:, None] * mask_f, torch.nan_to_num(batch.scores, nan=0.0)[:, None] * mask_f  # [B] -> [B, T]

    estimator.__name__ = f"_{method}"
    estimator.__doc__ = f"Group-relative '{method}' advantage broadcast over the response."
    return estimator


for _method in GROUP_METHODS:
    register_advantage(_method)(_make_group_estimator(_method))
