"""GRPO (and GSPO, with `algo.policy_loss: gspo`): group baselines, no critic.

generate G samples per prompt -> reward -> reference log-probs -> group advantages -> learn
-> sync weights. Every call passes ObjectRefs; the driver reads the metrics only.
"""

from __future__ import annotations

from pipelines.config import RaypoConfig
from pipelines.rl.phases import Phases, Roles, learn_and_sync, prepare, rollout_and_score
from pipelines.data.tasks import Problem


def grpo_step(roles: Roles, cfg: RaypoConfig, step: int, problems: list[Problem]) -> dict:
    phases = Phases()
    batch, scores, ref = rollout_and_score(roles, cfg, step, problems, phases)
    extra, stats = prepare(roles, cfg, step, batch, scores, ref)
    return learn_and_sync(roles, cfg, step, batch, extra, stats, phases)
