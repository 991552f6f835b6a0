"""The phases of one RL step that every algorithm shares, and their timing.

Every phase takes and returns ObjectRefs; the driver waits on them (without fetching) only to
time each phase. Algorithms (rl/grpo.py, rl/ppo.py) compose these phases.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
import ray

from actors.buffer import minibatch_refs
from pipelines.algos.losses import LossSpec
from pipelines.algos.sampling import prompt_seeds
from pipelines.algos.schedules import clip_eps, group_size
from pipelines.config import RaypoConfig
from pipelines.data.tasks import Problem, reward_fields
from pipelines.rl.recovery import RecoveryError
from pipelines.rl.roles import Roles, sampling_spec


class Phases:
    """Wall time per phase of one step: each `done(name, *refs)` waits (without fetching) for
    the phase's results and records the time since the previous phase ended; `done_together`
    does so for phases launched at once, each timed to its own end (their times overlap).
    `metrics` holds the times, as `time_<name>`, and what the phases report beside them."""

    def __init__(self):
        self.metrics: dict[str, float] = {}
        self._last = time.monotonic()

    def done(self, name: str, *refs) -> None:
        self.done_together(**{name: [r for r in refs if r is not None]})

    def done_together(self, **phases) -> None:
        """`phases`: name -> a ref or a list of refs (None: the phase did not run)."""
        refs = {name: [r for r in (v if isinstance(v, list) else [v]) if r is not None] for name, v in phases.items()}
        waiting = {name: set(rs) for name, rs in refs.items()}
        for name in [n for n, rs in waiting.items() if not rs]:
            self.metrics[f"time_{name}"] = time.monotonic() - self._last
            del waiting[name]
        while waiting:
            pending = [r for rs in waiting.values() for r in rs]
            ready, _ = ray.wait(pending, num_returns=1, fetch_local=False)
            now = time.monotonic()
            for name in list(waiting):
                waiting[name] -= set(ready)
                if not waiting[name]:
                    self.metrics[f"time_{name}"] = now - self._last
                    del waiting[name]
        self._last = time.monotonic()


def group_size_at(cfg: RaypoConfig, step: int) -> int:
    """Samples per prompt at `step`: the seeds' growth by `group_growth` per round of
    `group_growth_every` steps from `group_size` (constant when the growth is 0)."""
    algo = cfg.algo
    return group_size(step // algo.group_growth_every, algo.group_size, algo.group_growth, algo.group_size_max)


def prompts_at(cfg: RaypoConfig, step: int) -> int:
    """Prompts per step: the batch's samples divided among groups of `group_size_at(step)`
    (DPO, which samples nothing, learns from `batch_size` preference pairs)."""
    if not cfg.algo.generates:
        return cfg.training.batch_size
    return max(1, cfg.training.batch_size // group_size_at(cfg, step))


@dataclass
class Generation:
    """One step's rollout in flight: the engines' shares of its prompts, each a (batch, info) ref
    pair from `RolloutActor.sample`. Launched when the step starts, or steps before with
    `algo.off_policy_steps` (`Roles.ahead`), so that it runs while the learners train."""

    step: int
    problems: list[Problem]
    chunks: list[np.ndarray]  # the prompt indices of each engine's share
    version: int  # the weights pushed before the launch: each engine holds them (or newer) when it samples
    parts: list[tuple[ray.ObjectRef, ray.ObjectRef]] = field(default_factory=list)


def launch_generation(roles: Roles, cfg: RaypoConfig, problems: list[Problem], step: int) -> Generation:
    """Ask the engines for all prompts of `step`, split over them, each prompt with its own
    sampling seed (from the run seed, the step and its index in the step). An engine samples with
    the weights it holds when it reaches the call: its calls run in the order they were made."""
    chunks = [c for c in np.array_split(np.arange(len(problems)), len(roles.rollouts)) if len(c)]
    generation = Generation(step, problems, chunks, roles.weight_sync.version)
    generation.parts = [_launch_share(roles, cfg, generation, i) for i in range(len(chunks))]
    return generation


def _launch_share(roles: Roles, cfg: RaypoConfig, generation: Generation, i: int):
    idx, seeds = generation.chunks[i], prompt_seeds(cfg.seed, generation.step, len(generation.problems))
    return roles.rollouts[i].sample.remote(
        [generation.problems[j].prompt for j in idx], group_size_at(cfg, generation.step), sampling_spec(cfg),
        cfg.inference.max_tokens, [seeds[j] for j in idx],
    )  # fmt: skip


def generate(roles: Roles, cfg: RaypoConfig, problems: list[Problem], step: int) -> tuple[ray.ObjectRef, dict]:
    """The step's batch (a ref): its generation launched ahead (`Roles.ahead`), else launched now.
    Also returns `weights_version` (the oldest weights any share was sampled with) and
    `time_generate_busy` (the slowest engine's seconds on it).

    An engine that Ray restarted meanwhile (its process died) gets the current weights, and its
    share is generated again, with the same seeds: the batch is the one it would have been."""
    generation = roles.ahead.pop(step, None) or launch_generation(roles, cfg, problems, step)
    for _ in range(cfg.resource.max_actor_restarts + 1):
        batches = [batch for batch, _ in generation.parts]
        ray.wait(batches, num_returns=len(batches), fetch_local=False)
        infos = _share_infos(generation)
        failed = {i for i, info in infos.items() if info is None}
        # A share drawn with older weights than were pushed before its launch was drawn by an engine
        # Ray restarted meanwhile (it starts from the model's own). Told by the share itself: asking
        # each engine's pid every step waited behind the weights load queued on it.
        behind = {i for i, info in infos.items() if info is not None and info["weights_version"] < generation.version}
        redo = failed | behind
        # Where every push waits for the loads (a broadcast), the engines are idle now and each is
        # asked: one restarted since its share must join the broadcast again before the next push.
        asked = range(len(generation.chunks)) if roles.weight_sync.WAITS_FOR_LOADS else sorted(redo)
        restarted = set(restart_engines(roles, asked))
        if not redo:
            break
        if unseen := redo - restarted:  # the restart was seen elsewhere: its weights are given again
            roles.weight_sync.restore([roles.rollouts[i] for i in sorted(unseen)])
        for i in redo:
            generation.parts[i] = _launch_share(roles, cfg, generation, i)
    infos = ray.get([info for _, info in generation.parts])  # an engine that keeps failing raises here
    if any(info["weights_version"] < generation.version for info in infos):  # restarted again at each retry
        tries = cfg.resource.max_actor_restarts + 1
        raise RecoveryError(f"step {step}: a rollout engine was restarted under its share at each of {tries} tries")
    facts = {"weights_version": min(i["weights_version"] for i in infos), "time_generate_busy": max(i["seconds"] for i in infos)}
    batches = [batch for batch, _ in generation.parts]
    return (batches[0] if len(batches) == 1 else roles.helpers.concat_batches.remote(*batches)), facts


def _share_infos(generation: Generation) -> dict[int, dict | None]:
    """Each share's info (`RolloutActor.sample`), None where its engine died under it."""
    infos = {}
    for i, (_, info) in enumerate(generation.parts):
        try:
            infos[i] = ray.get(info)
        except ray.exceptions.RayActorError:
            infos[i] = None
    return infos


def launch_ahead(roles: Roles, cfg: RaypoConfig) -> None:
    """Launch the generations of the steps in `roles.upcoming` not launched yet, in step order
    (`algo.off_policy_steps`). Launched before this step's update, they sample with the weights
    the engines hold now: each engine runs its calls in the order they were made."""
    for step in sorted(roles.upcoming):
        if step not in roles.ahead:
            roles.ahead[step] = launch_generation(roles, cfg, roles.upcoming[step], step)


def restart_engines(roles: Roles, engines) -> list[int]:
    """The indices among `engines` of the rollout engines Ray restarted since the last look, given
    the current weights again (a restarted engine starts from the model's own)."""
    restarted = roles.watch.restarted([f"rollout-{i}" for i in engines])
    indices = [int(role.rsplit("-", 1)[1]) for role in restarted]
    if indices:
        roles.weight_sync.restore([roles.rollouts[i] for i in indices])
    return indices


def rollout_and_score(roles: Roles, cfg: RaypoConfig, step: int, problems: list[Problem], phases: Phases):
    """The phases every RL algorithm starts with: generate, then reward, reference log-probs and
    (with a critic) values, launched together on the batch. Returns refs to the batch, its
    rewards, its reference log-probs (None without a reference) and its values (None without)."""
    batch, facts = generate(roles, cfg, problems, step)
    phases.done("generate", batch)
    phases.metrics |= facts
    scores = roles.reward.score.remote(batch, reward_fields(problems), step)
    reference_logprobs = roles.reference.logprobs.remote(batch) if roles.reference else None
    values = roles.value.values.remote(batch) if roles.value else None
    scored = {"reward": scores, "reference": reference_logprobs} | ({"value": values} if roles.value else {})
    phases.done_together(**scored)
    # The next steps' batches are sampled while this one learns (algo.off_policy_steps); not
    # sooner, where the engines would share the CPUs with the reference and the critic too.
    launch_ahead(roles, cfg)
    roles.generated()
    return batch, scores, reference_logprobs, values


def policy_loss_spec(cfg: RaypoConfig, step: int) -> LossSpec:
    """The policy loss of `step`: `algo`'s settings with the clip range decayed to this step."""
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
        behaviour_weight_cap=algo.off_policy_weight_cap if algo.off_policy_steps else None,
        poisoned=step in cfg.chaos.nan_loss_steps,
    )


def compute_advantages(
    roles: Roles, cfg: RaypoConfig, step: int, batch, scores, reference_logprobs, values=None, lam: float | None = None
):
    """Refs to the step's targets (advantages; reference log-probs; returns for a critic) and
    its summary stats, computed by the helper actor (actors/helpers.py) next to the data."""
    algo = cfg.algo
    return roles.helpers.prepare_experience.remote(
        batch,
        scores,
        reference_logprobs,
        values,
        algo.advantage,
        group_size_at(cfg, step),
        algo.gamma,
        algo.lam if lam is None else lam,
        reward_floor(cfg),
    )


def learn_and_sync(roles: Roles, cfg: RaypoConfig, step: int, batch, targets, stats, phases: Phases) -> dict:
    """The phases every RL algorithm ends with: store the experience in the buffer, update the
    policy (and the critic, if there is one, alongside) on the minibatches the buffer serves,
    sync weights. Returns the step's metrics."""
    loss = policy_loss_spec(cfg, step)
    summary = {"group_size": group_size_at(cfg, step), **ray.get(stats), "clip_eps": loss.clip_low}
    if summary["reward_unscored"] == summary["samples"]:
        # Nothing to learn from; the weights stay as they are (the alerts print a warning).
        return {**summary, "update_skipped": 1, **phases.metrics}
    return {**summary, **store_learn_sync(roles, cfg, step, batch, targets, summary["samples"], phases, "train_step", loss)}


def store_learn_sync(
    roles: Roles, cfg: RaypoConfig, step: int, batch, targets, rows: int, phases: Phases, update: str, spec
) -> dict:
    """Store the step's `rows` rows in the buffer, run the learners' `update` method (`train_step`,
    `dpo_step`) with `spec` on the minibatches the buffer cuts (the critic, if there is one,
    alongside), sync weights. Returns the buffer's and the update's metrics and the phases' times."""
    training = cfg.training
    stored = roles.buffer.add.remote(step, batch, targets)  # a ref to the buffer's size after this step
    # Refs to each learner rank's shards of the step's minibatches (rows shuffled with the step's
    # seed), which the ranks (and the critic, all of them) fetch from the object store
    # themselves; the driver never holds the data.
    minibatches = minibatch_refs(
        roles.buffer, batch, targets, rows, training.minibatch_size, cfg.seed + step, training.epochs, len(roles.learners.actors)
    )
    critic = roles.value.train_step.remote(minibatches) if roles.value else None
    # Sampling ahead, a call queued behind each engine beside the learners is done once the engine
    # is idle (its batch ahead sampled, an evaluation queued after it done): the ranks then take its cores.
    beside = [[roles.rollouts[i].__ray_ready__.remote() for i in roles.beside_learners]] if cfg.algo.off_policy_steps else []
    learned = roles.learners.update(update, minibatches, spec, *beside)
    side_metrics = ray.get(critic) if critic else {}
    phases.done("learn")
    try:
        # Running ahead, the engines load the weights after the generation queued before them,
        # and the step goes on without waiting (an engine that died loading them is seen at the next push).
        roles.weight_sync.push(step + 1, wait=not cfg.algo.off_policy_steps)
    except ray.exceptions.RayActorError:
        if not restart_engines(roles, range(len(roles.rollouts))):  # an engine died as it loaded them: give it the weights
            raise
    phases.done("sync")
    moved = {"sync_bytes": float(roles.weight_sync.push_bytes())}
    return {**buffer_metrics(ray.get(stored)), **learned, **side_metrics, **moved, **phases.metrics}


def reward_floor(cfg: RaypoConfig) -> float:
    """The lowest reward there is: -1 when rewards are normalised, else the range's low end."""
    return -1.0 if cfg.reward.normalize else cfg.reward.value_range[0]


def buffer_metrics(size: dict) -> dict:
    return {"buffer_rows": size["rows"], "buffer_bytes": size["bytes"], "buffer_quarantined": size["quarantined"]}
