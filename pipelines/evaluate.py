"""Greedy evaluation of a causal LM on task problems, with transformers (no Ray, no vLLM)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from pipelines.rewards import exact_match
from pipelines.tasks import Problem


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
    scores = exact_match([p.prompt for p in problems], completions, answer=[p.answer for p in problems])
    return sum(scores) / len(scores)
