"""The RL driver: actors exchange ObjectRefs; the driver reads only metrics.

One step: generate (rollout actors) -> reward -> reference log-probs -> advantages (a Ray
task) -> learn (learner group) -> sync weights (learner -> rollout actors). `train(cfg)` is
the one entry point the CLI, Ray Jobs and Ray Tune trials call.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from pipelines.config import RaypoConfig, task_options
from pipelines.schedules import clip_eps
from pipelines.tasks import Problem, make_task

MetricsCallback = Callable[[dict], None]


def _prepare_experience(batch, scores, ref_logprobs, advantage: str, group_size: int, gamma: float, lam: float):
    """Advantages for a rollout batch (a Ray task: runs next to the data, not in the driver)."""
    import torch

    from pipelines.advantages import ADVANTAGES, AdvantageBatch, AdvantageParams

    mask = torch.from_numpy(batch["response_mask"])
    adv, _ = ADVANTAGES.get(advantage)(
        AdvantageBatch(scores=torch.from_numpy(scores).double(), mask=mask), AdvantageParams(gamma, lam, group_size)
    )
    extra = {"advantages": adv.float().numpy()}
    if ref_logprobs is not None:
        extra["ref_logprobs"] = ref_logprobs
    lengths = batch["response_mask"].sum(axis=1)
    valid = adv.float()[mask.bool()]
    stats = {
        "reward_mean": float(scores.mean()),
        "reward_std": float(scores.std()),
        "advantage_mean": float(valid.mean()) if valid.numel() else 0.0,
        "advantage_std": float(valid.std()) if valid.numel() > 1 else 0.0,
        "response_length": float(lengths.mean()),
        "response_tokens": int(lengths.sum()),
        "reward_all_zero": bool(np.all(scores == scores.flat[0])) and float(scores.flat[0]) <= -1.0 + 1e-6,
    }
    return extra, stats


def _concat_batches(*batches):
    """One batch from several rollout actors' batches (a Ray task), re-indexing prompts."""
    width = {k: max(b[k].shape[1] for b in batches) for k in batches[0] if batches[0][k].ndim == 2}
    out = {}
    offset = 0
    parts: dict[str, list] = {k: [] for k in batches[0]}
    for b in batches:
        for k, v in b.items():
            if k in width:
                pad = width[k] - v.shape[1]
                # prompts are left-padded, responses right-padded
                v = np.pad(v, ((0, 0), (pad, 0) if k.startswith("prompt") else (0, pad)))
            elif k == "prompt_index":
                v = v + offset
            parts[k].append(v)
        offset += int(b["prompt_index"].max()) + 1
    for k, vs in parts.items():
        out[k] = np.concatenate(vs)
    return out


class Trainer:
    """Holds the actors of one run; `run()` trains and writes outputs under runs/<name>/."""

    def __init__(self, cfg: RaypoConfig, model_dir: Path, on_metrics: MetricsCallback | None = None):
        import ray

        from actors.core.learner import LearnerSpec
        from actors.learner import LearnerGroup
        from actors.reference import ReferenceActor
        from actors.reward import RewardActor
        from actors.rollout import RolloutActor

        self.cfg, self.model_dir, self.on_metrics = cfg, model_dir, on_metrics
        self.out_dir = Path(cfg.output_dir) / cfg.name
        self.out_dir.mkdir(parents=True, exist_ok=True)
        task_cfg = cfg.task.task
        self.task = make_task(task_cfg.name, **task_options(task_cfg))
        self.eval_problems = self.task.sample(cfg.task.eval_problems, "heldout", cfg.seed)
        self.prompt_stream = self.task.stream("train", cfg.seed)
        threads = min(os.cpu_count() or 1, 4)
        res = cfg.resource
        self.rollouts = [
            RolloutActor.options(num_cpus=0.5, num_gpus=1 if res.use_gpu else 0).remote(
                str(model_dir), cfg.model.dtype, cfg.seed + i, None, res.gpu_memory_fraction, threads
            )
            for i in range(res.num_rollout_workers)
        ]
        terms = [(t.fn, t.weight) for t in cfg.reward.terms]
        self.reward = RewardActor.options(num_cpus=0.1).remote(terms, cfg.reward.normalize, cfg.reward.value_range)
        self.reference = (
            ReferenceActor.options(num_cpus=0.5).remote(str(model_dir), cfg.inference.temperature, threads)
            if cfg.algo.kl_coef > 0
            else None
        )
        spec = LearnerSpec(
            model_dir=str(model_dir),
            lr=cfg.training.lr,
            grad_clip=cfg.training.grad_clip,
            zero_stage=res.zero_stage,
            bf16=cfg.model.dtype == "bfloat16",
            gradient_checkpointing=cfg.model.gradient_checkpointing,
            temperature=cfg.inference.temperature,
            seed=cfg.seed,
            use_gpu=res.use_gpu,
        )
        self.learners = LearnerGroup(spec, res.num_learners, res.cpus_per_learner, res.accelerator_type)
        self.prepare = ray.remote(num_cpus=0.1, num_returns=2)(_prepare_experience)
        self.concat = ray.remote(num_cpus=0.1)(_concat_batches)

    def evaluate(self, problems: list[Problem]) -> float:
        """Greedy accuracy on `problems`, with the first rollout engine (current weights)."""
        import ray

        max_tokens = max(len(p.answer) for p in problems) + 2
        texts = ray.get(self.rollouts[0].greedy.remote([p.prompt for p in problems], max_tokens))
        return sum(t.strip() == p.answer for t, p in zip(texts, problems, strict=True)) / len(problems)

    def step(self, step: int) -> dict:
        import ray

        from actors.core.learner import LossSpec

        cfg, algo = self.cfg, self.cfg.algo
        timings: dict[str, float] = {}
        n_prompts = max(1, cfg.training.batch_size // algo.group_size)
        problems = [next(self.prompt_stream) for _ in range(n_prompts)]
        chunks = np.array_split(np.arange(n_prompts), len(self.rollouts))

        t0 = time.monotonic()
        parts = [
            actor.generate.remote(
                [problems[i].prompt for i in idx],
                algo.group_size,
                cfg.inference.temperature,
                cfg.inference.top_p,
                cfg.inference.max_tokens,
                cfg.seed * 100003 + step,
            )
            for actor, idx in zip(self.rollouts, chunks, strict=True)
            if len(idx)
        ]
        batch = parts[0] if len(parts) == 1 else self.concat.remote(*parts)
        ray.wait([batch], fetch_local=False)
        timings["time_generate"] = time.monotonic() - t0

        t0 = time.monotonic()
        scores = self.reward.score.remote(batch, [p.answer for p in problems])
        ray.wait([scores], fetch_local=False)
        timings["time_reward"] = time.monotonic() - t0

        t0 = time.monotonic()
        ref = self.reference.logprobs.remote(batch) if self.reference else None
        if ref is not None:
            ray.wait([ref], fetch_local=False)
        timings["time_reference"] = time.monotonic() - t0

        extra, stats_ref = self.prepare.remote(batch, scores, ref, algo.advantage, algo.group_size, algo.gamma, algo.lam)
        t0 = time.monotonic()
        eps = clip_eps(step, algo.clip_eps, algo.clip_decay, algo.clip_decay_every)
        loss = LossSpec(
            policy_loss=algo.policy_loss,
            clip_low=eps,
            clip_high=eps * algo.clip_high / algo.clip_eps,
            aggregate=algo.aggregate,
            kl_coef=algo.kl_coef,
            kl_kind=algo.kl_kind,
            entropy_coef=algo.entropy_coef,
        )
        learn = self.learners.train_step(batch, extra, loss, cfg.training.minibatch_size, cfg.training.epochs)
        timings["time_learn"] = time.monotonic() - t0

        t0 = time.monotonic()
        weights = self.learners.state_dict_ref()
        ray.get([r.update_weights.remote(weights, step + 1) for r in self.rollouts])
        timings["time_sync"] = time.monotonic() - t0

        stats = ray.get(stats_ref)
        step_time = sum(timings.values())
        return {
            "step": step,
            **stats,
            **learn,
            **timings,
            "step_time": step_time,
            "clip_eps": eps,
            "tokens_per_s": stats["response_tokens"] / max(timings["time_generate"], 1e-9),
        }

    def run(self) -> dict:
        from tqdm import tqdm

        cfg = self.cfg
        started = time.monotonic()
        acc_start = self.evaluate(self.eval_problems)
        history = []
        with open(self.out_dir / "metrics.jsonl", "a") as sink, tqdm(total=cfg.training.steps, desc="train") as bar:
            for step in range(cfg.training.steps):
                metrics = self.step(step)
                history.append(metrics)
                sink.write(json.dumps(metrics) + "\n")
                sink.flush()
                if self.on_metrics:
                    self.on_metrics(metrics)
                bar.set_postfix(
                    reward=f"{metrics['reward_mean']:.3f}", kl=f"{metrics['kl']:.4f}", s_per_step=f"{metrics['step_time']:.2f}"
                )
                bar.update()
        acc_end = self.evaluate(self.eval_problems)
        self.learners.save_pretrained(str(self.out_dir / "final"))
        summary = {
            "name": cfg.name,
            "algo": cfg.algo.name,
            "steps": cfg.training.steps,
            "eval_problems": len(self.eval_problems),
            "eval_accuracy_start": acc_start,
            "eval_accuracy_end": acc_end,
            "final_reward_mean": history[-1]["reward_mean"] if history else None,
            "wall_seconds": round(time.monotonic() - started, 1),
            "checkpoint": str(self.out_dir / "final"),
        }
        (self.out_dir / "summary.json").write_text(json.dumps(summary, indent=2))
        return summary


def train(cfg: RaypoConfig, address: str | None = None, on_metrics: MetricsCallback | None = None) -> dict:
    """Train with `cfg` on the Ray cluster at `address` (or RAY_ADDRESS), else a local Ray
    this call starts and stops. Returns the run's summary."""
    import ray

    from pipelines.cli import resolve_model_path

    model_dir = resolve_model_path(cfg)
    started_ray = False
    if not ray.is_initialized():
        address = address or os.environ.get("RAY_ADDRESS")
        if address:
            ray.init(address=address)
        else:
            # Logical CPUs beyond the physical cores: roles take turns within a step.
            ray.init(num_cpus=max(4, os.cpu_count() or 1), include_dashboard=False, log_to_driver=False)
            started_ray = True
    try:
        return Trainer(cfg, model_dir, on_metrics).run()
    finally:
        if started_ray:
            ray.shutdown()
