"""Held-out evaluation with real engines: during training through the rollout and reward
actors, and for `raypo eval` through an in-process vLLM engine and reward scorer (no Ray).
Both hand `pipelines.data.evaluate.evaluate_problems` the same three callables."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import ray

from actors.core.reward import RewardScorer
from pipelines.algos.sampling import EVALUATION, SamplingSpec, prompt_seeds
from pipelines.config import RaypoConfig
from pipelines.data.dataset import eval_max_tokens, load_task
from pipelines.data.evaluate import evaluate_problems, write_rows
from pipelines.data.tasks import Problem
from pipelines.models import vllm_engine
from pipelines.rl.roles import Roles


def _grouped(texts, prompt_index, prompts: int) -> list[list[str]]:
    groups: list[list[str]] = [[] for _ in range(prompts)]
    for text, i in zip(texts, prompt_index, strict=True):
        groups[int(i)].append(str(text))
    return groups


def eval_seeds(cfg: RaypoConfig, prompts) -> list[int]:
    """pass@k's sampling seeds, one per held-out prompt: the same in training and `raypo eval`."""
    return prompt_seeds(cfg.seed, 0, len(prompts), EVALUATION)


class StaleEvaluation(RuntimeError):
    """The engine an evaluation ran on served older weights than the run's: Ray restarted it
    (from the model's own weights) before the evaluation's calls reached it."""


def launch_evaluation(roles: Roles, cfg: RaypoConfig, problems: list[Problem]) -> Callable[[], tuple[dict, list[dict]]]:
    """`evaluate_problems` on the first rollout engine and the reward actor, begun: the engine's
    calls (greedy completions, and the pass@k samples) are queued now, so they run with the
    weights it holds now, ahead of any weight sync sent after them. Returns the rest (waiting for
    them, scoring, summing up), which a thread may run while training goes on. The rest raises
    `StaleEvaluation` where the engine served older weights than the run's when the calls reached
    it (its weights version, asked just ahead of them in its queue, tells)."""
    engine, max_tokens, k = roles.rollouts[0], eval_max_tokens(cfg, problems), cfg.eval.samples
    prompts = [p.prompt for p in problems]
    expected, served = roles.weight_sync.version, engine.weights_version.remote()
    greedy_ref = engine.greedy.remote(prompts, max_tokens)
    sampling = SamplingSpec(temperature=cfg.eval.temperature)
    sample_ref = engine.generate.remote(prompts, k, sampling, max_tokens, eval_seeds(cfg, prompts)) if k > 0 else None

    def greedy(asked):
        assert asked == prompts, "evaluate_problems asks for the prompts queued above"
        if (version := ray.get(served)) < expected:
            raise StaleEvaluation(
                f"rollout-0 served weights version {version}, not the run's {expected}: Ray restarted it (from the "
                "model's own weights) before the evaluation's calls reached it"
            )
        return ray.get(greedy_ref)

    def sample(asked, n):
        assert asked == prompts and n == k, "evaluate_problems asks for the samples queued above"
        batch = ray.get(sample_ref)
        return _grouped(batch["response_text"], batch["prompt_index"], len(prompts))

    def score_terms(prompts, completions, fields):
        return ray.get(roles.reward.scores_by_term.remote(prompts, completions, fields))

    return lambda: evaluate_problems(problems, greedy, score_terms, cfg.pass_threshold, sample, k)


def reward_scorer(cfg: RaypoConfig) -> RewardScorer:
    """The run's reward in this process, as the reward actor computes it."""
    return RewardScorer([(t.fn, t.weight) for t in cfg.reward.terms], cfg.reward.normalize, cfg.reward.value_range)


def evaluate_model(cfg: RaypoConfig, model_dir: str | Path, out_file: str | Path | None = None) -> dict:
    """`raypo eval`: the held-out evaluation of the model in `model_dir`, in this process.
    Writes one JSON line per problem to `out_file` when given; returns the summary."""
    task = load_task(cfg, model_dir)
    problems = task.sample(cfg.task.eval_problems, "heldout", cfg.seed)
    llm = vllm_engine.make_llm(str(model_dir), dtype=cfg.engine_dtype, seed=cfg.seed)
    scorer = reward_scorer(cfg)
    max_tokens = eval_max_tokens(cfg, problems)

    def score_terms(prompts, completions, fields):
        return scorer.scores_by_term(prompts, completions, **fields)

    def sample(prompts, n):
        return vllm_engine.sample(llm, prompts, n, cfg.eval.temperature, max_tokens, eval_seeds(cfg, prompts))

    summary, rows = evaluate_problems(
        problems, lambda ps: vllm_engine.greedy(llm, ps, max_tokens), score_terms, cfg.pass_threshold, sample, cfg.eval.samples
    )
    if out_file is not None:
        write_rows(out_file, rows)
    dtype = str(llm.llm_engine.model_config.dtype).removeprefix("torch.")  # the engine's weights (inference.dtype)
    return {"model": str(model_dir), "task": task.name, "dtype": dtype, **summary}
