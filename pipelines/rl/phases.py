"""The shared steps of an RL pipeline, and the actors (roles) they drive.

Every step takes and returns ObjectRefs; the driver waits on them (without fetching) only to
time each phase. Algorithms (pipelines/rl/grpo.py, pipelines/rl/ppo.py) compose these steps.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from actors.common import cpu_shortfall
from pipelines.config import RaypoConfig
from pipelines.algos.schedules import clip_eps, group_size
from pipelines.data.tasks import Problem


def actor_name(cfg: RaypoConfig, role: str) -> str:
    """Actors are named by run, driver process and role, so dashboards and tools can find them."""
    return f"raypo:{cfg.name}:{os.getpid()}:{role}"


@dataclass
class Roles:
    """Handles to a run's actors and helper tasks."""

    rollouts: list
    reward: Any
    learners: Any  # actors.learner.LearnerGroup
    buffer: Any = None
    reference: Any = None
    value: Any = None
    remote_prepare: Any = None
    remote_concat: Any = None
    weight_sync: str = "object_store"  # or "broadcast" (a collective from learner rank 0)

    def shutdown(self) -> None:
        """End every actor of the run and free the learners' placement group."""
        import ray

        for actor in [*self.rollouts, self.reward, self.buffer, self.reference, self.value]:
            if actor is not None:
                ray.kill(actor)
        self.learners.shutdown()


# CPUs each role reserves in Ray's scheduler. A role's torch threads are set apart from this
# (roles take turns within a step), so the reservations only have to fit the machine together.
ROLE_CPUS = {"rollout": 0.2, "reference": 0.2, "value": 0.2, "reward": 0.05, "buffer": 0.05, "helper task": 0.05}
HELPER_TASKS = 2  # prepare_experience and concat_batches may run at once


class ResourceFitError(RuntimeError):
    """The run's actors cannot all be placed on the Ray cluster; the message names the resource."""


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
    if cfg.algo.kl_coef > 0:
        plan["reference"] = ROLE_CPUS["reference"]
    if cfg.algo.advantage == "gae":
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


def build_roles(cfg: RaypoConfig, model_dir: Path, out_dir: Path) -> Roles:
    import ray

    from actors.buffer import ExperienceBuffer
    from actors.core.learner import LearnerSpec
    from actors.learner import LearnerGroup
    from actors.reference import ReferenceActor
    from actors.reward import RewardActor
    from actors.rollout import RolloutActor
    from actors.value import ValueActor

    res, threads = cfg.resource, min(os.cpu_count() or 1, 4)
    rollouts = [
        RolloutActor.options(
            num_cpus=ROLE_CPUS["rollout"], num_gpus=1 if res.use_gpu else 0, name=actor_name(cfg, f"rollout-{i}")
        ).remote(str(model_dir), threads, dtype=cfg.model.dtype, seed=cfg.seed + i, gpu_memory_fraction=res.gpu_memory_fraction)
        for i in range(res.num_rollout_workers)
    ]
    terms = [(t.fn, t.weight) for t in cfg.reward.terms]
    reward = RewardActor.options(num_cpus=ROLE_CPUS["reward"]).remote(terms, cfg.reward.normalize, cfg.reward.value_range)
    spill_dir = str(out_dir / "experience") if cfg.training.spill_experience else None
    buffer = ExperienceBuffer.options(num_cpus=ROLE_CPUS["buffer"]).remote(1, spill_dir)
    reference = None
    if cfg.algo.kl_coef > 0:
        reference = ReferenceActor.options(num_cpus=ROLE_CPUS["reference"]).remote(
            str(model_dir), cfg.inference.temperature, threads
        )
    value = None
    if cfg.algo.advantage == "gae":
        value = ValueActor.options(num_cpus=ROLE_CPUS["value"]).remote(
            str(model_dir), cfg.training.lr, cfg.training.grad_clip, cfg.algo.value_clip, cfg.seed, threads
        )
    spec = LearnerSpec(
        model_dir=str(model_dir),
        lr=cfg.training.lr,
        warmup_steps=cfg.training.warmup_steps,
        grad_clip=cfg.training.grad_clip,
        zero_stage=res.zero_stage,
        bf16=cfg.model.dtype == "bfloat16",
        gradient_checkpointing=cfg.model.gradient_checkpointing,
        temperature=cfg.inference.temperature,
        seed=cfg.seed,
        use_gpu=res.use_gpu,
    )
    learners = LearnerGroup(spec, res.num_learners, res.cpus_per_learner, res.accelerator_type)
    weight_sync = res.weight_sync if res.weight_sync != "auto" else "broadcast" if res.use_gpu else "object_store"
    if weight_sync == "broadcast":
        learners.open_weight_sync(rollouts, backend="nccl" if res.use_gpu else "gloo")
    return Roles(
        rollouts=rollouts,
        reward=reward,
        learners=learners,
        buffer=buffer,
        reference=reference,
        value=value,
        remote_prepare=ray.remote(num_cpus=ROLE_CPUS["helper task"], num_returns=2)(prepare_experience),
        remote_concat=ray.remote(num_cpus=ROLE_CPUS["helper task"])(concat_batches),
        weight_sync=weight_sync,
    )


class Phases:
    """Wall time per phase of one step: each `done(name, *refs)` waits (without fetching) for
    the phase's results and records the time since the previous phase ended."""

    def __init__(self):
        self.times: dict[str, float] = {}
        self._last = time.monotonic()

    def done(self, name: str, *refs) -> None:
        import ray

        pending = [r for r in refs if r is not None]
        if pending:
            ray.wait(pending, num_returns=len(pending), fetch_local=False)
        now = time.monotonic()
        self.times[f"time_{name}"] = now - self._last
        self._last = now


def group_size_at(cfg: RaypoConfig, step: int) -> int:
    """Samples per prompt at `step`: the seeds' growth by `group_growth` per round of
    `group_growth_every` steps from `group_size` (constant when the growth is 0)."""
    algo = cfg.algo
    return group_size(step // algo.group_growth_every, algo.group_size, algo.group_growth, algo.group_size_max)


def prompts_at(cfg: RaypoConfig, step: int) -> int:
    """Prompts per step: the batch's samples divided among groups of `group_size_at(step)`."""
    return max(1, cfg.training.batch_size // group_size_at(cfg, step))


def generate(roles: Roles, cfg: RaypoConfig, problems: list[Problem], step: int):
    """All prompts of the step, split over the rollout actors; one batch ref back."""
    chunks = [c for c in np.array_split(np.arange(len(problems)), len(roles.rollouts)) if len(c)]
    inf = cfg.inference
    parts = [
        actor.generate.remote(
            [problems[i].prompt for i in idx],
            group_size_at(cfg, step),
            inf.temperature,
            inf.top_p,
            inf.max_tokens,
            cfg.seed * 100_003 + step,
        )
        for actor, idx in zip(roles.rollouts, chunks, strict=False)
    ]
    return parts[0] if len(parts) == 1 else roles.remote_concat.remote(*parts)


def rollout_and_score(roles: Roles, cfg: RaypoConfig, step: int, problems: list[Problem], phases: Phases):
    """The phases every RL algorithm starts with: generate, reward, reference log-probs.
    Returns refs to the batch, its rewards and its reference log-probs (None without KL)."""
    batch = generate(roles, cfg, problems, step)
    phases.done("generate", batch)
    scores = roles.reward.score.remote(batch, [p.answer for p in problems])
    phases.done("reward", scores)
    ref = roles.reference.logprobs.remote(batch) if roles.reference else None
    phases.done("reference", ref)
    return batch, scores, ref


def policy_loss_spec(cfg: RaypoConfig, step: int):
    from actors.core.learner import LossSpec

    algo = cfg.algo
    eps = clip_eps(step, algo.clip_eps, algo.clip_decay, algo.clip_decay_every)
    return LossSpec(
        policy_loss=algo.policy_loss,
        clip_low=eps,
        clip_high=eps * algo.clip_high / algo.clip_eps,
        aggregate=algo.aggregate,
        kl_coef=algo.kl_coef,
        kl_kind=algo.kl_kind,
        entropy_coef=algo.entropy_coef,
    )


def prepare(roles: Roles, cfg: RaypoConfig, step: int, batch, scores, ref, values=None, lam: float | None = None):
    """Refs to the step's advantages (plus returns for a critic) and its summary stats."""
    algo = cfg.algo
    return roles.remote_prepare.remote(
        batch,
        scores,
        ref,
        values,
        algo.advantage,
        group_size_at(cfg, step),
        algo.gamma,
        algo.lam if lam is None else lam,
        reward_floor(cfg),
    )


def learn_and_sync(roles: Roles, cfg: RaypoConfig, step: int, batch, extra, stats, phases: Phases, side_updates=()) -> dict:
    """The phases every RL algorithm ends with: store the experience, update the policy (while
    `side_updates`, e.g. the critic's, run alongside), sync weights. Returns the step's metrics."""
    import ray

    stored = record_experience(roles, step, batch, extra)
    loss = policy_loss_spec(cfg, step)
    learned = roles.learners.train_step(batch, extra, loss, cfg.training.minibatch_size, cfg.training.epochs)
    side_metrics = [ray.get(ref) for ref in side_updates]
    phases.done("learn")
    sync_weights(roles, step + 1)
    phases.done("sync")
    metrics = {"group_size": group_size_at(cfg, step), **ray.get(stats), **buffer_metrics(ray.get(stored)), **learned}
    for extra_metrics in side_metrics:
        metrics.update(extra_metrics)
    return {**metrics, **phases.times, "clip_eps": loss.clip_low}


def reward_floor(cfg: RaypoConfig) -> float:
    """The lowest reward there is: -1 when rewards are normalised, else the range's low end."""
    return -1.0 if cfg.reward.normalize else cfg.reward.value_range[0]


def record_experience(roles: Roles, step: int, batch, extra):
    """Store the step's experience in the buffer (spilled to Parquet when configured); a ref to its size."""
    return roles.buffer.add.remote(step, batch, extra)


def buffer_metrics(size: dict) -> dict:
    return {"buffer_rows": size["rows"], "buffer_bytes": size["bytes"]}


def sync_weights(roles: Roles, version: int) -> None:
    """New learner weights -> every rollout engine: a broadcast from learner rank 0 (NCCL on
    GPUs, gloo on CPU), or through the object store."""
    import ray

    if roles.weight_sync == "broadcast":
        roles.learners.broadcast_weights(roles.rollouts, version)
        return
    weights = roles.learners.state_dict_ref()
    ray.get([r.update_weights.remote(weights, version) for r in roles.rollouts])


def prepare_experience(
    batch, scores, ref_logprobs, values, advantage: str, group_size: int, gamma: float, lam: float, reward_floor: float
):
    """Advantages (and returns, old values for a critic) of a rollout batch, plus summary stats.
    Runs as a Ray task next to the data, never in the driver."""
    import torch

    from pipelines.algos.advantages import ADVANTAGES, AdvantageBatch, AdvantageParams

    mask = torch.from_numpy(batch["response_mask"])
    inputs = AdvantageBatch(
        scores=torch.from_numpy(scores).double(),
        mask=mask,
        values=None if values is None else torch.from_numpy(values).double(),
    )
    adv, returns = ADVANTAGES.get(advantage)(inputs, AdvantageParams(gamma, lam, group_size))
    extra = {"advantages": adv.float().numpy()}
    if ref_logprobs is not None:
        extra["ref_logprobs"] = ref_logprobs
    if values is not None:
        extra["returns"] = returns.float().numpy()
        extra["old_values"] = values
    lengths = batch["response_mask"].sum(axis=1)
    valid = adv.float()[mask.bool()]
    stats = {
        "reward_mean": float(scores.mean()),
        "reward_std": float(scores.std()),
        "advantage_mean": float(valid.mean()) if valid.numel() else 0.0,
        "advantage_std": float(valid.std()) if valid.numel() > 1 else 0.0,
        "response_length": float(lengths.mean()),
        "response_tokens": int(lengths.sum()),
        "truncated_fraction": float(1.0 - batch["finished"].mean()),
        "reward_all_zero": bool(np.all(scores <= reward_floor + 1e-6)),
    }
    return extra, stats


def concat_batches(*batches):
    """One batch from several rollout actors' batches (a Ray task); prompts re-indexed."""
    widths = {k: max(b[k].shape[1] for b in batches) for k, v in batches[0].items() if v.ndim == 2}
    parts: dict[str, list] = {k: [] for k in batches[0]}
    offset = 0
    for b in batches:
        for k, v in b.items():
            if k in widths:
                pad = widths[k] - v.shape[1]
                # prompts are left-padded, responses right-padded
                v = np.pad(v, ((0, 0), (pad, 0) if k.startswith("prompt") else (0, pad)))
            elif k == "prompt_index":
                v = v + offset
            parts[k].append(v)
        offset += int(b["prompt_index"].max()) + 1
    return {k: np.concatenate(vs) for k, vs in parts.items()}
