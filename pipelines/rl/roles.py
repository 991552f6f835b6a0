"""The actors (roles) of a run: what each reserves, whether they fit the cluster, building them.

Every role is an actor from actors/; the driver holds their handles in one typed `Roles`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import ray
from ray.actor import ActorHandle
from ray.remote_function import RemoteFunction

from actors.buffer import ExperienceBuffer
from actors.common import ResourceFitError, cpu_shortfall
from actors.core.learner import LearnerSpec
from actors.core.reward import RefreshSpec
from actors.learner import LearnerGroup
from actors.reference import ReferenceActor
from actors.reward import RewardActor
from actors.rollout import RolloutActor
from actors.value import ValueActor
from actors.weight_sync import WeightSync, make_weight_sync
from pipelines.algos.sampling import SamplingSpec
from pipelines.config import RaypoConfig
from pipelines.data.preferences import encode_pairs_for
from pipelines.rl.experience import concat_batches, prepare_experience


def actor_name(cfg: RaypoConfig, role: str) -> str:
    """Actors are named by run, driver process and role, so dashboards and tools can find them."""
    return f"raypo:{cfg.name}:{os.getpid()}:{role}"


@dataclass
class Roles:
    """Handles to a run's actors and helper tasks."""

    rollouts: list[ActorHandle[RolloutActor]]
    reward: ActorHandle[RewardActor]
    learners: LearnerGroup
    buffer: ActorHandle[ExperienceBuffer]
    weight_sync: WeightSync
    prepare_experience: RemoteFunction  # rl/experience.py's prepare_experience, as a Ray task
    concat_batches: RemoteFunction  # rl/experience.py's concat_batches, as a Ray task
    encode_pairs: RemoteFunction  # data/preferences.py's encode_pairs_for(model_dir, pairs), as a Ray task
    model_dir: str  # the policy's starting weights and tokenizer
    reference: ActorHandle[ReferenceActor] | None = None  # only for DPO or a KL term (algo.uses_reference)
    value: ActorHandle[ValueActor] | None = None  # only with a critic (algo.advantage = gae)

    def shutdown(self) -> None:
        """End every actor of the run and free the learners' placement group."""
        for actor in [*self.rollouts, self.reward, self.buffer, self.reference, self.value]:
            if actor is not None:
                ray.kill(actor)
        self.learners.shutdown()


# CPUs each role reserves in Ray's scheduler. A role's torch threads are set apart from this
# (roles take turns within a step), so the reservations only have to fit the machine together.
ROLE_CPUS = {"rollout": 0.2, "reference": 0.2, "value": 0.2, "reward": 0.05, "buffer": 0.05, "helper task": 0.05}
HELPER_TASKS = 2  # prepare_experience and concat_batches may run at once


def cpu_plan(cfg: RaypoConfig) -> dict[str, float]:
    """CPUs each role of `cfg`'s run reserves, by role."""
    res = cfg.resource
    plan = {
        "learners": res.num_learners * res.cpus_per_learner,
        "rollout": res.num_rollout_workers * ROLE_CPUS["rollout"],
        "reward": ROLE_CPUS["reward"],
        "buffer": ROLE_CPUS["buffer"],
        "helper tasks": HELPER_TASKS * ROLE_CPUS["helper task"],
    }
    if cfg.algo.uses_reference:
        plan["reference"] = ROLE_CPUS["reference"]
    if cfg.algo.uses_critic:
        plan["value"] = ROLE_CPUS["value"]
    return plan


def check_fits(cfg: RaypoConfig, cluster: dict[str, float]) -> None:
    """Raise ResourceFitError at once when the run cannot be placed on a cluster with
    `cluster` resources (`ray.cluster_resources()`), instead of waiting for it forever.

    >>> from pipelines.config import load_config
    >>> try:
    ...     check_fits(load_config(overrides=["resource.num_learners=2"]), {"CPU": 2.0})
    ... except ResourceFitError as err:
    ...     print(str(err).partition(" (")[0], "...", str(err).partition(") ")[2].partition(";")[0])
    this run needs 2.6 CPUs ... but the Ray cluster has 2
    """
    if short := cpu_shortfall(cpu_plan(cfg), cluster):
        raise ResourceFitError(
            f"this run {short}; lower resource.num_learners, resource.cpus_per_learner or resource.num_rollout_workers, "
            "or run on a bigger cluster"
        )
    res = cfg.resource
    gpus = res.num_learners + res.num_rollout_workers if res.use_gpu else 0
    if gpus > cluster.get("GPU", 0.0):
        raise ResourceFitError(
            f"this run needs {gpus} GPUs ({res.num_learners} learners + {res.num_rollout_workers} rollout engines, one "
            f"each) but the Ray cluster has {cluster.get('GPU', 0.0):g}; set resource.use_gpu=false or add GPUs"
        )


def sampling_spec(cfg: RaypoConfig) -> SamplingSpec:
    """How the rollout samples (`inference`), which is also the policy the learners train."""
    inf = cfg.inference
    return SamplingSpec(temperature=inf.temperature, top_p=inf.top_p, top_k=inf.top_k)


def learner_spec(cfg: RaypoConfig, model_dir: Path) -> LearnerSpec:
    return LearnerSpec(
        model_dir=str(model_dir),
        lr=cfg.training.lr,
        warmup_steps=cfg.training.warmup_steps,
        grad_clip=cfg.training.grad_clip,
        zero_stage=cfg.resource.zero_stage,
        bf16=cfg.model.dtype == "bfloat16",
        gradient_checkpointing=cfg.model.gradient_checkpointing,
        sampling=sampling_spec(cfg),
        seed=cfg.seed,
        use_gpu=cfg.resource.use_gpu,
    )


def build_roles(cfg: RaypoConfig, model_dir: Path, out_dir: Path) -> Roles:
    res, threads = cfg.resource, min(os.cpu_count() or 1, 4)
    rollouts = [
        RolloutActor.options(
            num_cpus=ROLE_CPUS["rollout"], num_gpus=1 if res.use_gpu else 0, name=actor_name(cfg, f"rollout-{i}")
        ).remote(str(model_dir), threads, dtype=cfg.model.dtype, seed=cfg.seed + i, gpu_memory_fraction=res.gpu_memory_fraction)
        for i in range(res.num_rollout_workers)
    ]
    terms = [(t.fn, t.weight) for t in cfg.reward.terms]
    rw = cfg.reward
    refresh = None
    if rw.refresh_every:
        refresh = RefreshSpec(
            labels=rw.refresh_labels,
            window=rw.refresh_every,
            steps=rw.refresh_steps,
            lr=rw.refresh_lr,
            l2_coef=cfg.rm.l2_coef,
            grad_clip=cfg.training.grad_clip,
            batch_size=cfg.training.minibatch_size,
            seed=cfg.seed,
        )
    reward = RewardActor.options(num_cpus=ROLE_CPUS["reward"]).remote(terms, rw.normalize, rw.value_range, refresh)
    spill_dir = str(out_dir / "experience") if cfg.training.spill_experience else None
    buffer = ExperienceBuffer.options(num_cpus=ROLE_CPUS["buffer"]).remote(1, spill_dir)
    reference = None
    if cfg.algo.uses_reference:
        # in the learner's dtype (its bf16 mode, else float32), so policy and reference agree at step 0
        reference = ReferenceActor.options(num_cpus=ROLE_CPUS["reference"]).remote(
            str(model_dir), cfg.inference.temperature, threads, "bfloat16" if cfg.model.dtype == "bfloat16" else "float32"
        )
    value = None
    if cfg.algo.uses_critic:
        value = ValueActor.options(num_cpus=ROLE_CPUS["value"]).remote(
            str(model_dir), cfg.training.lr, cfg.training.grad_clip, cfg.algo.value_clip, cfg.seed, threads
        )
    learners = LearnerGroup(learner_spec(cfg, model_dir), res.num_learners, res.cpus_per_learner, res.accelerator_type)
    return Roles(
        rollouts=rollouts,
        reward=reward,
        learners=learners,
        buffer=buffer,
        weight_sync=make_weight_sync(res.weight_sync, learners, rollouts, res.use_gpu),
        prepare_experience=ray.remote(num_cpus=ROLE_CPUS["helper task"], num_returns=2)(prepare_experience),
        concat_batches=ray.remote(num_cpus=ROLE_CPUS["helper task"])(concat_batches),
        encode_pairs=ray.remote(num_cpus=ROLE_CPUS["helper task"])(encode_pairs_for),
        model_dir=str(model_dir),
        reference=reference,
        value=value,
    )
