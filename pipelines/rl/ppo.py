"""PPO: a critic (ValueActor) and GAE advantages.

generate -> reward -> reference log-probs and values -> GAE -> learn policy and critic
(in parallel) -> sync weights.
"""

from __future__ import annotations

from pipelines.config import RaypoConfig
from pipelines.algos.schedules import gae_lambda
from pipelines.rl.phases import Phases, Roles, learn_and_sync, prepare, rollout_and_score
from pipelines.data.tasks import Problem


def ppo_step(roles: Roles, cfg: RaypoConfig, step: int, problems: list[Problem]) -> dict:
    if roles.value is None:
        raise ValueError("PPO needs a critic: set algo.advantage=gae")
    algo, phases = cfg.algo, Phases()
    batch, scores, ref = rollout_and_score(roles, cfg, step, problems, phases)
    values = roles.value.values.remote(batch)
    phases.done("value", values)
    lam = gae_lambda(step, algo.lam_start, algo.lam, algo.lam_ramp_steps)
    extra, stats = prepare(roles, cfg, step, batch, scores, ref, values, lam)
    critic = roles.value.train_step.remote(batch, extra, cfg.training.minibatch_size, cfg.training.epochs)
    return {**learn_and_sync(roles, cfg, step, batch, extra, stats, phases, side_updates=[critic]), "gae_lambda": lam}
