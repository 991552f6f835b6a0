"""GRPO (and GSPO, with `algo.policy_loss: gspo`): group baselines, no critic.

generate G samples per prompt -> reward and reference log-probs (together) -> group advantages -> learn
-> sync weights. Every call passes ObjectRefs; the driver reads the metrics only.
"""

from __future__ import annotations

from pipelines.config import RaypoConfig
from pipelines.data.tasks import Problem
from pipelines.rl.phases import Phases, compute_advantages, learn_and_sync, rollout_and_score
from pipelines.rl.roles import Roles


def grpo_step(roles: Roles, cfg: RaypoConfig, step: int, problems: list[Problem]) -> dict:
    phases = Phases()
    batch, scores, reference_logprobs, _ = rollout_and_score(roles, cfg, step, problems, phases)
    targets, stats = compute_advantages(roles, cfg, step, batch, scores, reference_logprobs)
    return learn_and_sync(roles, cfg, step, batch, targets, stats, phases)
