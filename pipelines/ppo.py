"""PPO: a critic (ValueActor) and GAE advantages.

generate -> reward -> reference log-probs and values -> GAE -> learn policy and critic
(in parallel) -> sync weights.
"""

from __future__ import annotations

from pipelines.config import RaypoConfig
from pipelines.schedules import gae_lambda
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


def ppo_step(roles: Roles, cfg: RaypoConfig, step: int, problems: list[Problem]) -> dict:
    import ray

    if roles.value is None:
        raise ValueError("PPO needs a critic: set algo.advantage=gae")
    algo, phases = cfg.algo, Phases()
    batch, scores, ref = rollout_and_score(roles, cfg, step, problems, phases)
    values = roles.value.values.remote(batch)
    phases.done("value", values)
    lam = gae_lambda(step, algo.lam_start, algo.lam, algo.lam_ramp_steps)
    extra, stats = roles.remote_prepare.remote(
        batch, scores, ref, values, algo.advantage, group_size_at(cfg, step), algo.gamma, lam, reward_floor(cfg)
    )
    critic = roles.value.train_step.remote(batch, extra, cfg.training.minibatch_size, cfg.training.epochs)
    stored = record_experience(roles, step, batch, extra)
    loss = policy_loss_spec(cfg, step)
    learned = roles.learners.train_step(batch, extra, loss, cfg.training.minibatch_size, cfg.training.epochs)
    critic_metrics = ray.get(critic)
    phases.done("learn")
    sync_weights(roles, step + 1)
    phases.done("sync")
    return {
        "group_size": group_size_at(cfg, step),
        **ray.get(stats),
        **buffer_metrics(ray.get(stored)),
        **learned,
        **critic_metrics,
        **phases.times,
        "clip_eps": loss.clip_low,
        "gae_lambda": lam,
    }
