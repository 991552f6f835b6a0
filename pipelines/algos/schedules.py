"""The seeds' hyper-parameter schedules, as pure functions of the step or round.

- clip epsilon starts at 0.2 and decays 5% every 1000 steps;
- the GAE lambda goes from 0.9 early in training to 0.95 later;
- the GRPO group size grows 10% per round from its start value.
"""

from __future__ import annotations

import math


def clip_eps(step: int, start: float = 0.2, decay: float = 0.05, every: int = 1000) -> float:
    """Step-wise decay: start * (1 - decay) ** (step // every).

    >>> clip_eps(0), round(clip_eps(1000), 6), round(clip_eps(2999), 6)
    (0.2, 0.19, 0.1805)
    """
    if step < 0 or every <= 0:
        raise ValueError(f"clip_eps needs step >= 0 and every > 0, got step={step}, every={every}")
    return start * (1.0 - decay) ** (step // every)


def gae_lambda(step: int, start: float = 0.9, end: float = 0.95, ramp_steps: int = 1000) -> float:
    """Linear ramp of lambda from `start` to `end` over `ramp_steps`, then constant.

    >>> gae_lambda(0), gae_lambda(500), gae_lambda(5000)
    (0.9, 0.925, 0.95)
    """
    if ramp_steps <= 0 or step >= ramp_steps:
        return end
    return start + (end - start) * max(step, 0) / ramp_steps


def group_size(round_index: int, start: int = 8, growth: float = 0.10, maximum: int | None = None) -> int:
    """Group size after `round_index` rounds of `growth` (rounded half up), capped at `maximum`.

    >>> [group_size(r, start=32) for r in range(4)]
    [32, 35, 39, 43]
    """
    if start < 1 or round_index < 0:
        raise ValueError(f"group_size needs start >= 1 and round_index >= 0, got {start}, {round_index}")
    size = max(start, math.floor(start * (1.0 + growth) ** round_index + 0.5))
    return size if maximum is None else min(size, maximum)
