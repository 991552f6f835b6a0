"""DPO (Rafailov et al. 2023): offline, from preference pairs; nothing is sampled or scored.

the step's pairs -> token arrays (a Ray task) -> reference log-probs (once per pair) -> buffer
-> the learners' `dpo_step` on its minibatches -> sync weights (for evaluation and serving).
Every call passes ObjectRefs; the driver reads the metrics only.
"""

from __future__ import annotations

import ray
import torch

from pipelines.algos.losses import DPOSpec, dpo_loss
from pipelines.config import RaypoConfig
from pipelines.data.preferences import pair_of
from pipelines.data.tasks import Problem
from pipelines.rl.phases import Phases, store_learn_sync
from pipelines.rl.roles import Roles


def dpo_spec(cfg: RaypoConfig) -> DPOSpec:
    algo = cfg.algo
    return DPOSpec(beta=algo.dpo_beta, kind=algo.dpo_kind, label_smoothing=algo.dpo_label_smoothing, nll_coef=algo.dpo_nll_coef)


def _pairs_and_reference(roles: Roles, problems: list[Problem]):
    pairs = roles.helpers.encode_pairs.remote(roles.model_dir, [pair_of(p) for p in problems])
    return pairs, roles.reference.pair_logprobs.remote(pairs)


def dpo_step(roles: Roles, cfg: RaypoConfig, step: int, problems: list[Problem]) -> dict:
    phases = Phases()
    pairs, reference = _pairs_and_reference(roles, problems)
    phases.done("reference", reference)
    learned = store_learn_sync(roles, cfg, step, pairs, reference, len(problems), phases, "dpo_step", dpo_spec(cfg))
    return {"pairs": len(problems), **learned}


def dpo_evaluate(roles: Roles, cfg: RaypoConfig, problems: list[Problem]) -> dict:
    """How the policy's implicit reward, beta * (log pi - log pi_ref), ranks held-out pairs:
    `reward_accuracy` (share of pairs where the chosen completion's is higher) and
    `reward_margin` (mean chosen minus rejected), with the DPO loss on them."""
    pairs, reference = _pairs_and_reference(roles, problems)
    policy = roles.learners.run("pair_logprobs", pairs)[0]  # identical on every rank
    reference = ray.get(reference)
    spec = dpo_spec(cfg)
    loss, metrics = dpo_loss(
        *(torch.tensor(policy[f"policy_{side}"]) for side in ("chosen", "rejected")),
        *(torch.tensor(reference[f"reference_{side}"]) for side in ("chosen", "rejected")),
        beta=spec.beta,
        kind=spec.kind,
        label_smoothing=spec.label_smoothing,
        nll_coef=spec.nll_coef,
        chosen_tokens=torch.tensor(ray.get(pairs)["chosen_mask"].sum(axis=1)).float(),
    )
    return {"dpo_loss": loss.item(), **metrics}
