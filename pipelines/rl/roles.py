"""The actors (roles) of a run: the one resource plan (a placement bundle per role), whether it
fits the cluster, and building the roles in their bundles.

Every role is an actor from actors/; the driver holds their handles in one typed `Roles`.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import ray
from ray.actor import ActorHandle
from ray.util.placement_group import PlacementGroup

from actors.buffer import ExperienceBuffer
from actors.common import ResourceFitError, check_fit, cpu_shortfall, threads_for
from actors.core.learner import LearnerSpec
from actors.core.reward import RefreshSpec
from actors.helpers import HelperActor
from actors.learner import LearnerGroup
from actors.placement import Bundle, Placement
from actors.reference import ReferenceActor
from actors.reward import RewardActor
from actors.rollout import RolloutActor
from actors.value import ValueActor
from actors.weight_sync import WeightSync, make_weight_sync
from pipelines.algos.sampling import SamplingSpec
from pipelines.config import NODE_TYPE_RESOURCE, NODE_TYPE_SHARE, RaypoConfig
from pipelines.rl.recovery import ActorWatch


def actor_name(cfg: RaypoConfig, role: str) -> str:
    """Actors are named by run, driver process and role, so dashboards and tools can find them."""
    return f"raypo:{cfg.name}:{os.getpid()}:{role}"


@dataclass
class Roles:
    """Handles to a run's actors."""

    rollouts: list[ActorHandle[RolloutActor]]
    reward: ActorHandle[RewardActor]
    learners: LearnerGroup
    buffer: ActorHandle[ExperienceBuffer]
    weight_sync: WeightSync
    helpers: ActorHandle[HelperActor]  # the step's targets, batches concatenated, pairs encoded
    model_dir: str  # the policy's starting weights and tokenizer
    placement: Placement  # the run's placement group: which bundle, and so which node, each role took
    watch: ActorWatch  # which of the restartable roles Ray restarted (rl/recovery.py)
    reference: ActorHandle[ReferenceActor] | None = None  # only for DPO or a KL term (algo.uses_reference)
    value: ActorHandle[ValueActor] | None = None  # only with a critic (algo.advantage = gae)
    # Sampling ahead of learning (algo.off_policy_steps): the prompts of the steps after the one
    # training (step -> problems, drawn by the driver) and their rl/phases.py Generations once launched.
    upcoming: dict = field(default_factory=dict)
    ahead: dict = field(default_factory=dict)
    # The engines on a learner rank's node (`engines_beside_learners`): sampling ahead, the ranks
    # take their cores once these are idle (rl/phases.py's store_learn_sync).
    beside_learners: list[int] = field(default_factory=list)
    # Work for the first engine once a step's batch is generated, to run while the learners train
    # (the driver's evaluation beside the step): started by `generated`, once.
    after_generation: list = field(default_factory=list)

    def generated(self) -> None:
        """A step's batch is generated (rl/phases.py's rollout_and_score), or none will be: start
        the work waiting for that (`after_generation`)."""
        while self.after_generation:
            self.after_generation.pop(0)()

    def rebuild_learners(self, spec: LearnerSpec) -> None:
        """A new learner group in the bundles of the old one (stopped: a rank died), wired to the engines."""
        self.learners.kill()
        self.learners = LearnerGroup(spec, self.placement, len(self.learners.actors), threads=self.learners.threads)
        self.weight_sync.rewire(self.learners)

    def shutdown(self) -> None:
        """End every actor of the run and free its placement group."""
        for actor in [*self.rollouts, self.reward, self.buffer, self.helpers, self.reference, self.value]:
            if actor is not None:
                ray.kill(actor)
        self.learners.shutdown()
        self.placement.remove()


# CPUs each role reserves in Ray's scheduler. A role's torch threads are set apart from this
# (roles take turns within a step), so the reservations only have to fit the machine together.
ROLE_CPUS = {"rollout": 0.2, "reference": 0.2, "value": 0.2, "reward": 0.05, "buffer": 0.05, "helpers": 0.1}


def role_bundle(cfg: RaypoConfig, role: str, kind: str, cpus: float, by_node_type: bool, gpu: bool = False) -> Bundle:
    """The bundle of `role` (of `kind`, a key of resource.node_types): its CPUs, a GPU when it
    runs on one, and the node-type resource that pins it to its cluster.yaml node type."""
    resources = {"CPU": cpus}
    if gpu:
        resources["GPU"] = 1.0
    node_type = cfg.resource.node_types.get(kind)
    if by_node_type and node_type:
        resources[NODE_TYPE_RESOURCE + node_type] = NODE_TYPE_SHARE
    if kind in ("learner", "value") and cfg.resource.accelerator_type:
        resources[f"accelerator_type:{cfg.resource.accelerator_type}"] = NODE_TYPE_SHARE
    return Bundle(role, resources)


def resource_plan(cfg: RaypoConfig, by_node_type: bool = False) -> list[Bundle]:
    """The run's one resource plan: a bundle per role, in the order the placement group (or a Tune
    trial, after its driver's bundle) reserves them. `by_node_type`: pin roles to their node
    types (the cluster's nodes advertise raypo_node:<type>).

    >>> from pipelines.config import load_config
    >>> [(b.role, b.resources) for b in resource_plan(load_config(), by_node_type=True)][:3]
    [('learner-0', {'CPU': 1.0, 'raypo_node:learner': 0.001}), ('rollout-0', {'CPU': 0.2, 'raypo_node:rollout': 0.001}), \
('reward', {'CPU': 0.05})]
    """
    res, gpu = cfg.resource, cfg.resource.use_gpu
    plan = [role_bundle(cfg, f"learner-{i}", "learner", res.cpus_per_learner, by_node_type, gpu) for i in range(res.num_learners)]
    plan += [
        role_bundle(cfg, f"rollout-{i}", "rollout", ROLE_CPUS["rollout"], by_node_type, gpu)
        for i in range(res.num_rollout_workers)
    ]
    plan += [
        role_bundle(cfg, "reward", "reward", ROLE_CPUS["reward"], by_node_type),
        role_bundle(cfg, "buffer", "buffer", ROLE_CPUS["buffer"], by_node_type),
        role_bundle(cfg, "helpers", "helpers", ROLE_CPUS["helpers"], by_node_type),
    ]
    if cfg.algo.uses_reference:
        plan.append(role_bundle(cfg, "reference", "reference", ROLE_CPUS["reference"], by_node_type))
    if cfg.algo.uses_critic:
        plan.append(role_bundle(cfg, "value", "value", ROLE_CPUS["value"], by_node_type))
    return plan


def cluster_has_node_types(cluster: dict[str, float]) -> bool:
    """Whether a cluster's nodes advertise raypo node types (cluster.yaml's, or the fake cluster's)."""
    return any(key.startswith(NODE_TYPE_RESOURCE) for key in cluster)


def pins_node_types(cfg: RaypoConfig, cluster: dict[str, float]) -> bool:
    """Whether the run's bundles name their node types (`resource.placement`: `auto` when the
    cluster's nodes advertise them now; `node_types` also when the autoscaler has yet to add them)."""
    mode = cfg.resource.placement
    return mode == "node_types" or (mode == "auto" and cluster_has_node_types(cluster))


def reserve(
    cfg: RaypoConfig,
    plan_of: Callable[[RaypoConfig, bool], list[Bundle]],
    local_ray: bool,
    trial_group: PlacementGroup | None = None,
) -> Placement:
    """The run's placement group, from `plan_of(cfg, pins_node_types)`: refused at once when it
    cannot fit a local Ray; on a joined cluster waited for (resource.placement_timeout_s); inside a
    Tune trial, the trial's own group (Tune reserved it whole, so it fits)."""
    cluster = ray.cluster_resources()
    plan = plan_of(cfg, pins_node_types(cfg, cluster))
    if trial_group is None:
        check_fit(lambda: check_fits(plan, cluster), local_ray=local_ray)
    wait_s = 60.0 if local_ray else cfg.resource.placement_timeout_s
    return Placement(plan, name=f"raypo:{cfg.name}:{os.getpid()}", wait_s=wait_s, trial_group=trial_group)


def check_fits(plan: list[Bundle], cluster: dict[str, float]) -> None:
    """Raise ResourceFitError at once when the run's `plan` cannot be placed on a cluster with
    `cluster` resources (`ray.cluster_resources()`), instead of waiting for it forever.

    >>> from pipelines.config import load_config
    >>> try:
    ...     check_fits(resource_plan(load_config(overrides=["resource.num_learners=2"])), {"CPU": 2.0})
    ... except ResourceFitError as err:
    ...     print(str(err).partition(" (")[0], "...", str(err).partition(") ")[2].partition(";")[0])
    this run needs 2.6 CPUs ... but the Ray cluster has 2
    """
    cpus: dict[str, float] = {}
    for bundle in plan:
        part = bundle.role.rsplit("-", 1)[0] + "s" if bundle.role[-1].isdigit() else bundle.role
        cpus[part] = cpus.get(part, 0.0) + bundle.resources.get("CPU", 0.0)
    if short := cpu_shortfall(cpus, cluster):
        raise ResourceFitError(
            f"this run {short}; lower resource.num_learners, resource.cpus_per_learner or resource.num_rollout_workers, "
            "or run on a bigger cluster"
        )
    gpus = sum(bundle.resources.get("GPU", 0.0) for bundle in plan)
    if gpus > cluster.get("GPU", 0.0):
        raise ResourceFitError(
            f"this run needs {gpus:g} GPUs (learners and rollout engines, one each) but the Ray cluster has "
            f"{cluster.get('GPU', 0.0):g}; set resource.use_gpu=false or add GPUs"
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
        micro_batch_size=cfg.training.micro_batch_size,
        sampling=sampling_spec(cfg),
        seed=cfg.seed,
        use_gpu=cfg.resource.use_gpu,
    )


def nodes_of(placement: Placement) -> dict[str, str]:
    """Each role's node id."""
    return {where["role"]: where["node_id"] for where in placement.where()}


def rollout_threads(cfg: RaypoConfig, node: dict[str, str], threads: int) -> int:
    """The engines' torch threads: `threads`, less those of the learners on their node when they
    sample ahead (algo.off_policy_steps), which runs them while the learners train. `node`:
    each role's node id (`nodes_of`)."""
    if not cfg.algo.off_policy_steps:
        return threads  # roles take turns within a step
    beside = sum(node[f"learner-{rank}"] == node["rollout-0"] for rank in range(cfg.resource.num_learners))
    return max(1, threads - beside * threads_for(cfg.resource.cpus_per_learner))


def learner_threads(cfg: RaypoConfig, node: dict[str, str], threads: int) -> tuple[int, int]:
    """Each learner rank's torch threads while the engines on its node sample, and when they are
    idle. Roles taking turns (synchronous), the ranks and the critic that trains beside them share
    their node's `threads`. Sampling ahead (algo.off_policy_steps), a rank keeps to its bundle's
    CPUs while the engine samples (the engine has the rest, `rollout_threads`), and takes that
    share once the engine is done (`engines_beside_learners`)."""
    own = threads_for(cfg.resource.cpus_per_learner)
    if cfg.resource.use_gpu:
        return own, own
    learner_node = node["learner-0"]
    training = [role for role in node if role.startswith("learner-") or role == "value"]
    shared = max(own, threads // sum(node[role] == learner_node for role in training))
    return (own if cfg.algo.off_policy_steps else shared), shared


def engines_beside_learners(node: dict[str, str]) -> list[int]:
    """The indices of the rollout engines on the node of a learner rank, whose cores the ranks share."""
    learner_nodes = {node[role] for role in node if role.startswith("learner-")}
    return [int(role.rsplit("-", 1)[1]) for role in node if role.startswith("rollout-") and node[role] in learner_nodes]


def build_roles(cfg: RaypoConfig, model_dir: Path, out_dir: Path, placement: Placement, checkpoints: str | None = None) -> Roles:
    """Start every role of the run, each in its bundle of `placement`. Ray restarts the roles but
    the learners when their process dies; restarted, the reward model and critic come back from
    the newest whole checkpoint under `checkpoints`."""
    res, threads = cfg.resource, min(os.cpu_count() or 1, 4)
    node = nodes_of(placement)  # one read of the cluster's nodes for the whole start

    def options(role: str, retry_calls: bool = True) -> dict:
        restarts = res.max_actor_restarts
        retries = restarts if retry_calls else 0  # a rollout engine's calls are re-issued by the driver, with weights
        return placement.options(role, name=actor_name(cfg, role), max_restarts=restarts, max_task_retries=retries)

    rollouts = [
        RolloutActor.options(**options(f"rollout-{i}", retry_calls=False)).remote(
            str(model_dir),
            rollout_threads(cfg, node, threads),
            dtype=cfg.engine_dtype,
            seed=cfg.seed + i,
            gpu_memory_fraction=res.gpu_memory_fraction,
        )  # fmt: skip
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
    reward = RewardActor.options(**options("reward")).remote(terms, rw.normalize, rw.value_range, refresh, checkpoints)
    spill_dir = str(out_dir / "experience") if cfg.training.spill_experience else None
    tr = cfg.training
    buffer = ExperienceBuffer.options(**options("buffer")).remote(1, spill_dir, tr.spill_max_gb, tr.spill_max_age_hours)
    restartable = {**{f"rollout-{i}": r for i, r in enumerate(rollouts)}, "reward": reward, "buffer": buffer}
    reference = None
    if cfg.algo.uses_reference:
        # in the learner's dtype (its bf16 mode, else float32), so policy and reference agree at step 0
        reference = ReferenceActor.options(**options("reference")).remote(
            str(model_dir), cfg.inference.temperature, threads, "bfloat16" if cfg.model.dtype == "bfloat16" else "float32"
        )
        restartable["reference"] = reference
    value = None
    if cfg.algo.uses_critic:
        value = ValueActor.options(**options("value")).remote(
            str(model_dir), cfg.training.lr, cfg.training.grad_clip, cfg.algo.value_clip, cfg.seed, threads, checkpoints
        )
        restartable["value"] = value
    names = [actor_name(cfg, f"learner-{rank}") for rank in range(res.num_learners)]
    spec = learner_spec(cfg, model_dir)
    learners = LearnerGroup(spec, placement, res.num_learners, names, learner_threads(cfg, node, threads))
    helpers = HelperActor.options(**options("helpers")).remote()
    restartable["helpers"] = helpers
    return Roles(
        rollouts=rollouts,
        reward=reward,
        learners=learners,
        buffer=buffer,
        weight_sync=make_weight_sync(res.weight_sync, learners, rollouts, res.use_gpu),
        helpers=helpers,
        model_dir=str(model_dir),
        placement=placement,
        watch=ActorWatch(restartable, res.max_actor_restarts),
        reference=reference,
        value=value,
        beside_learners=engines_beside_learners(node),
    )
