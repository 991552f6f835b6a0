"""Is an answer correct, and how well a model does on held-out problems.

`count_correct` is the one exact-answer check. `evaluate_problems` is the one evaluation: mean
reward per reward function, greedy pass rate and pass@k, given callables that generate and
score (the trainer passes its rollout and reward actors, `raypo eval` an in-process engine).
The transformers helpers below (no Ray, no vLLM) serve the tiny model's SFT checks."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from pipelines.data.rewards import exact_match
from pipelines.data.tasks import Problem, reward_fields


def count_correct(problems: Sequence[Problem], completions: Sequence[str]) -> int:
    """How many `completions` are exactly their problem's answer (the `exact_match` reward).

    >>> count_correct([Problem("2+2=", "4"), Problem("1+2=", "3")], [" 4", "4"])
    1
    """
    return int(sum(exact_match([p.prompt for p in problems], completions, answer=[p.answer for p in problems])))


def pairwise_tau(better: Sequence[float], worse: Sequence[float]) -> float:
    """Kendall's tau between scores and the true order, over pairs whose truth differs (item i of
    `better` is truly better than item i of `worse`): (concordant - discordant) / pairs, a pair
    concordant when the better item scores higher; a tie counts as neither.

    >>> pairwise_tau([2.0, 1.0, 3.0, 0.5], [1.0, 1.0, 0.0, 0.7])
    0.25
    """
    if len(better) != len(worse) or not len(better):
        raise ValueError(f"pairwise_tau needs two equal, non-empty score lists, got {len(better)} and {len(worse)}")
    signs = [int(b > w) - int(b < w) for b, w in zip(better, worse, strict=True)]
    return sum(signs) / len(signs)


Greedy = Callable[[list[str]], list[str]]  # prompts -> one greedy completion each
Sampler = Callable[[list[str], int], list[list[str]]]  # prompts, k -> k sampled completions each
TermScorer = Callable[[list[str], list[str], dict], dict]  # prompts, completions, fields -> {term: [...], "combined": [...]}


def _mean(values: Sequence[float | None]) -> float | None:
    scored = [v for v in values if v is not None]
    return sum(scored) / len(scored) if scored else None


def _passes(combined: float | None, threshold: float) -> bool:
    """A sample passes when its combined reward reaches `threshold`; an unscored one does not."""
    return combined is not None and combined >= threshold - 1e-9


def evaluate_problems(
    problems: Sequence[Problem],
    greedy: Greedy,
    score_terms: TermScorer,
    threshold: float,
    sample: Sampler | None = None,
    k: int = 0,
) -> tuple[dict, list[dict]]:
    """(summary, one row per problem) of a model on `problems`.

    summary: `reward_mean` (combined, raw) and `reward_mean/<term>` of the greedy completions,
    `pass_rate` (greedy completions whose combined reward reaches `threshold`), `pass_at_k`
    (problems where one of `k` samples passes) with `k`, and `accuracy` (exact answer) when
    every problem has an answer.

    >>> problems = [Problem("1+1=", "2"), Problem("2+2=", "4")]
    >>> def score(prompts, texts, fields):
    ...     right = [float(t == a) for t, a in zip(texts, fields["answer"])]
    ...     return {"exact_match": right, "combined": right}
    >>> summary, rows = evaluate_problems(problems, lambda ps: ["2", "5"], score, 1.0, lambda ps, k: [["3", "2"], ["5", "1"]], 2)
    >>> summary["pass_rate"], summary["pass_at_k"], summary["accuracy"], rows[1]["greedy"]
    (0.5, 0.5, 0.5, '5')
    """
    if not problems:
        raise ValueError("evaluate_problems needs at least one problem")
    prompts, fields = [p.prompt for p in problems], reward_fields(problems)
    texts = greedy(prompts)
    scores = score_terms(prompts, texts, fields)
    passed = [_passes(c, threshold) for c in scores["combined"]]
    terms = [t for t in scores if t != "combined"]
    summary = {"problems": len(problems), "reward_mean": _mean(scores["combined"])}
    summary |= {f"reward_mean/{t}": _mean(scores[t]) for t in terms}
    summary["pass_rate"] = sum(passed) / len(problems)
    if all(p.answer is not None for p in problems):
        summary["accuracy"] = count_correct(problems, texts) / len(problems)
    rows = [
        {
            "prompt": p.prompt,
            "answer": p.answer,
            "greedy": t,
            "reward": c,
            "passed": ok,
            "rewards": {n: scores[n][i] for n in terms},
        }
        for i, (p, t, c, ok) in enumerate(zip(problems, texts, scores["combined"], passed, strict=True))
    ]
    if sample is not None and k > 0:
        samples = sample(prompts, k)
        flat_prompts = [p for p, group in zip(prompts, samples, strict=True) for _ in group]
        flat_fields = {
            name: [v for v, group in zip(values, samples, strict=True) for _ in group] for name, values in fields.items()
        }
        combined = score_terms(flat_prompts, [t for group in samples for t in group], flat_fields)["combined"]
        for i, row in enumerate(rows):
            row["samples_passed"] = sum(_passes(c, threshold) for c in combined[i * k : (i + 1) * k])
        summary |= {"k": k, "pass_at_k": sum(row["samples_passed"] > 0 for row in rows) / len(rows)}
        summary["sampled_pass_rate"] = sum(row["samples_passed"] for row in rows) / (k * len(rows))
    return summary, rows


def write_rows(path: str | Path, rows: Sequence[dict]) -> None:
    """One JSON line per evaluated problem (`evaluate_problems`' rows) to `path`."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        f.writelines(json.dumps(row) + "\n" for row in rows)


@torch.no_grad()
def greedy_complete(model, tokenizer, prompts: Sequence[str], max_new_tokens: int, batch_size: int = 512) -> list[str]:
    """Greedy continuations of `prompts` (decoded, special tokens dropped), batched with
    left padding so every row continues from its own last prompt token."""
    tokenizer.padding_side = "left"
    was_training = model.training
    model.eval()
    texts: list[str] = []
    for start in range(0, len(prompts), batch_size):
        enc = tokenizer(list(prompts[start : start + batch_size]), return_tensors="pt", padding=True)
        out = model.generate(
            **enc,
            max_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=tokenizer.eos_token_id,
        )
        texts += tokenizer.batch_decode(out[:, enc["input_ids"].shape[1] :], skip_special_tokens=True)
    model.train(was_training)
    return texts


def greedy_accuracy(model, tokenizer, problems: Sequence[Problem], max_new_tokens: int | None = None) -> float:
    """Share of `problems` whose greedy completion is exactly the answer."""
    if not problems:
        raise ValueError("greedy_accuracy needs at least one problem")
    if max_new_tokens is None:
        max_new_tokens = max(len(p.answer) for p in problems) + 2
    completions = greedy_complete(model, tokenizer, [p.prompt for p in problems], max_new_tokens)
    return count_correct(problems, completions) / len(problems)


@torch.no_grad()
def sampled_accuracy(
    model, tokenizer, problems: Sequence[Problem], samples: int, temperature: float = 1.0, seed: int = 0, batch_size: int = 512
) -> float:
    """Share of `samples` sampled completions per problem (pure temperature sampling, no top-k
    or top-p) that are exactly the answer: how often RL's samples hold a right answer."""
    tokenizer.padding_side = "left"
    was_training = model.training
    model.eval()
    torch.manual_seed(seed)
    max_new_tokens = max(len(p.answer) for p in problems) + 2
    right = 0
    for start in range(0, len(problems), batch_size):
        chunk = problems[start : start + batch_size]
        enc = tokenizer([p.prompt for p in chunk], return_tensors="pt", padding=True)
        out = model.generate(
            **enc,
            max_new_tokens=max_new_tokens,
            do_sample=True,
            temperature=temperature,
            top_k=0,
            top_p=1.0,
            num_return_sequences=samples,
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=tokenizer.eos_token_id,
        )
        texts = tokenizer.batch_decode(out[:, enc["input_ids"].shape[1] :], skip_special_tokens=True)
        rows = [p for p in chunk for _ in range(samples)]  # the samples of one prompt are adjacent
        right += count_correct(rows, texts)
    model.train(was_training)
    return right / (len(problems) * samples)
