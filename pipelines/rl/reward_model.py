"""`raypo train-rm`: a Bradley-Terry reward model trained by the learner group on preference pairs.

The RM is the policy's architecture with a one-logit sequence-classification head, started from
the policy's weights (`model`), trained on the pairs of `task` (the built-in preference set, or a
dataset's `{prompt, chosen, rejected}` rows) with L2 regularisation (`rm.l2_coef`, the seeds'
1e-4), and checked on held-out pairs: pairwise accuracy and Kendall tau between its scores and
the pairs' true order (the seeds' consistency target: tau > 0.7). Saved in Hugging Face format
to <output_dir>/<name>/reward_model, where a `model:` reward term reads it.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from pathlib import Path

import numpy as np
import ray
from tqdm import tqdm

from actors.buffer import ExperienceBuffer, minibatch_refs
from actors.helpers import HelperActor
from actors.learner import LearnerGroup
from actors.placement import Bundle, Placement
from pipelines.config import RaypoConfig
from pipelines.data.dataset import load_task
from pipelines.data.evaluate import pairwise_tau
from pipelines.data.preferences import PreferencePair, heldout_pairs, varied_pairs
from pipelines.data.storage import local_path
from pipelines.data.tasks import Problem
from pipelines.models.resolve import resolve_model_path
from pipelines.rl.monitor import Sinks
from pipelines.rl.roles import learner_spec, reserve, resource_plan
from pipelines.rl.trainer import ray_session


def rm_plan(cfg: RaypoConfig, by_node_type: bool = False) -> list[Bundle]:
    """The bundles of reward-model training: the learners, the buffer and the helper actor."""
    return [b for b in resource_plan(cfg, by_node_type) if b.role.startswith("learner-") or b.role in ("buffer", "helpers")]


class RewardModelTrainer:
    """The learner group with a score head, the buffer that serves its minibatches, and the task
    that turns preference pairs into reward-model inputs."""

    def __init__(self, cfg: RaypoConfig, model_dir: Path, placement: Placement):
        self.cfg, self.model_dir, self.placement = cfg, str(model_dir), placement
        self.out_dir = local_path(cfg.output_dir) / cfg.name  # absolute: the learners may run on other nodes
        self.out_dir.mkdir(parents=True, exist_ok=True)
        spec = dataclasses.replace(learner_spec(cfg, model_dir), head="score", l2_coef=cfg.rm.l2_coef)
        self.buffer = ExperienceBuffer.options(**placement.options("buffer")).remote(1)
        self.learners = LearnerGroup(spec, placement, cfg.resource.num_learners)
        restarts = cfg.resource.max_actor_restarts
        self.helpers = HelperActor.options(
            **placement.options("helpers"), max_restarts=restarts, max_task_retries=restarts
        ).remote()

    def pairs_ref(self, pairs: list[PreferencePair]):
        """A ref to the reward-model inputs of `pairs`, encoded by the helper actor."""
        return self.helpers.encode_reward_pairs.remote(self.model_dir, pairs)

    def evaluate(self, pairs_ref) -> dict:
        """Held-out pairwise accuracy, Kendall tau and mean margin of the RM's scores."""
        scores = self.learners.run("pair_scores", pairs_ref)[0]
        chosen, rejected = scores["score_chosen"], scores["score_rejected"]
        return {
            "pairs": len(chosen),
            "accuracy": float(np.mean(chosen > rejected)),
            "kendall_tau": pairwise_tau(chosen, rejected),
            "margin": float(np.mean(chosen - rejected)),
        }

    def step(self, step: int, problems: list[Problem]) -> dict:
        training = self.cfg.training
        pairs = varied_pairs(problems, self.cfg.seed * 100_003 + step)
        encoded = self.pairs_ref(pairs)
        stored = self.buffer.add.remote(step, encoded, {})
        minibatches = minibatch_refs(
            self.buffer,
            encoded,
            {},
            len(pairs),
            training.minibatch_size,
            self.cfg.seed + step,
            training.epochs,
            len(self.learners.actors),
        )
        metrics = self.learners.update("rm_step", minibatches)
        ray.get(stored)
        return metrics

    def save(self) -> Path:
        path = self.out_dir / "reward_model"
        self.learners.run("save_pretrained", str(path))
        return path

    def shutdown(self) -> None:
        ray.kill(self.buffer)
        ray.kill(self.helpers)
        self.learners.shutdown()
        self.placement.remove()


def train_reward_model(cfg: RaypoConfig, address: str | None = None) -> dict:
    """Train, evaluate and save the reward model of `cfg`; returns the summary (also written to
    <output_dir>/<name>/summary.json)."""
    model_dir = resolve_model_path(cfg)
    task = load_task(cfg, model_dir, preferences=True)  # a bad dataset stops here, before Ray starts
    started = time.monotonic()
    with ray_session(cfg, address) as local_ray:
        placement = reserve(cfg, rm_plan, local_ray)
        try:
            rm = RewardModelTrainer(cfg, model_dir, placement)
        except BaseException:
            placement.remove()  # ends the actors already started in it; on a joined cluster nothing else would
            raise
        try:
            heldout = rm.pairs_ref(heldout_pairs(task.sample(cfg.task.eval_problems, "heldout", cfg.seed), cfg.seed))
            eval_start = rm.evaluate(heldout)
            stream = task.stream("train", cfg.seed)
            sinks = Sinks(rm.out_dir)
            try:
                for step in tqdm(range(cfg.training.steps), desc=f"reward model {cfg.name}", dynamic_ncols=True):
                    sinks.write({"step": step, **rm.step(step, [next(stream) for _ in range(cfg.training.batch_size)])})
            finally:
                sinks.close()
            eval_end = rm.evaluate(heldout)
            path = rm.save()
        finally:
            rm.shutdown()
    summary = {
        "name": cfg.name,
        "steps": cfg.training.steps,
        "l2_coef": cfg.rm.l2_coef,
        "eval_start": eval_start,
        "eval_end": eval_end,
        "reward_model": str(path),
        "wall_seconds": round(time.monotonic() - started, 1),
    }
    (rm.out_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    if eval_end["kendall_tau"] < cfg.rm.min_tau:
        print(
            f"warning: held-out Kendall tau {eval_end['kendall_tau']:.3f} is below rm.min_tau={cfg.rm.min_tau}", file=sys.stderr
        )
    return summary
