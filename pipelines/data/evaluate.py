"""Is an answer correct, and greedy or sampled accuracy of a causal LM on task problems with
transformers (no Ray, no vLLM). `count_correct` is the one check: the trainer's vLLM
evaluation and these use it alike."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from pipelines.data.rewards import exact_match
from pipelines.data.tasks import Problem


def count_correct(problems: Sequence[Problem], completions: Sequence[str]) -> int:
    """How many `completions` are exactly their problem's answer (the `exact_match` reward).

    >>> count_correct([Problem("2+2=", "4"), Problem("1+2=", "3")], [" 4", "4"])
    1
    """
    return int(sum(exact_match([p.prompt for p in problems], completions, answer=[p.answer for p in problems])))


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
