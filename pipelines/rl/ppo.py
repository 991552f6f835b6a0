"""PPO: a critic (ValueActor) and GAE advantages.

generate -> reward, reference log-probs and values (together) -> GAE -> learn policy and critic
(in parallel) -> sync weights.
"""

from __future__ import annotations

from pipelines.algos.schedules import gae_lambda
from pipelines.config import RaypoConfig
from pipelines.data.tasks import Problem
from pipelines.rl.phases import Phases, compute_advantages, learn_and_sync, rollout_and_score
from pipelines.rl.roles import Roles


def ppo_step(roles: Roles, cfg: RaypoConfig, step: int, problems: list[Problem]) -> dict:
    algo, phases = cfg.algo, Phases()
    # config guarantees the critic (algo.name=ppo needs advantage=gae), so `values` is a ref
    batch, scores, reference_logprobs, values = rollout_and_score(roles, cfg, step, problems, phases)
    lam = gae_lambda(step, algo.lam_start, algo.lam, algo.lam_ramp_steps)
    targets, stats = compute_advantages(roles, cfg, step, batch, scores, reference_logprobs, values, lam)
    return {**learn_and_sync(roles, cfg, step, batch, targets, stats, phases), "gae_lambda": lam}
