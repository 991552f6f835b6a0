"""GRPO (and GSPO, with `algo.policy_loss: gspo`): group baselines, no critic.

generate G samples per prompt -> reward -> reference log-probs -> group advantages -> learn
-> sync weights. Every call passes ObjectRefs; the driver reads the metrics only.
"""

from __future__ import annotations

from pipelines.config import RaypoConfig
from pipelines.steps import (
    Phases,
    Roles,
    buffer_metrics,
    group_size_at,
    policy_loss_spec,
    record_experience,
    reward_floor,
    rollout_and_score,
    sync_weights,
)
from pipelines.tasks import Problem


def grpo_step(roles: Roles, cfg: RaypoConfig, step: int, problems: list[Problem]) -> dict:
    import ray

    algo, phases = cfg.algo, Phases()
    batch, scores, ref = rollout_and_score(roles, cfg, step, problems, phases)
    extra, stats = roles.remote_prepare.remote(
        batch, scores, ref, None, algo.advantage, group_size_at(cfg, step), algo.gamma, algo.lam, reward_floor(cfg)
    )
    stored = record_experience(roles, step, batch, extra)
    loss = policy_loss_spec(cfg, step)
    learned = roles.learners.train_step(batch, extra, loss, cfg.training.minibatch_size, cfg.training.epochs)
    phases.done("learn")
    sync_weights(roles, step + 1)
    phases.done("sync")
    return {
        "group_size": group_size_at(cfg, step),
        **ray.get(stats),
        **buffer_metrics(ray.get(stored)),
        **learned,
        **phases.times,
        "clip_eps": loss.clip_low,
    }
