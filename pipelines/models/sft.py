"""Supervised fine-tuning on task problems: the tiny model's warm start.

A plain torch loop (AdamW, warmup + cosine), loss on the answer tokens only. RL learners use
DeepSpeed; this loop only has to turn a random model into one that is right some of the time.

The warm start's data is noisy on purpose, the way real SFT data is: in a share
(`sft_slip_share`) of the examples the answer carries the task's typical systematic error
(column addition with the carries dropped: `47+38=75`). With more than half of them slipped,
greedy decoding makes the slip and sampling still finds the right answer often: a model
that knows the skill but does not use it by default, which RL rewarded on exact answers can
fix (and which no amount of further SFT on the same data would).
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence

import torch

from pipelines.config import TinyModelConfig
from pipelines.data.tasks import Problem, task_from_config

IGNORE_INDEX = -100


def sft_problems(cfg: TinyModelConfig) -> tuple[list[Problem], list[Problem], list[Problem]]:
    """Train problems of every SFT task; held-out problems of the first task (the reported
    accuracy); and as many again held-out problems, disjoint from those, for the band check."""
    train: list[Problem] = []
    for task_cfg in cfg.sft_tasks:
        train += task_from_config(task_cfg).sample(cfg.sft_problems, "train", cfg.seed)
    heldout = task_from_config(cfg.sft_tasks[0]).sample(cfg.heldout_problems + cfg.band.problems, "heldout", cfg.seed)
    return train, heldout[: cfg.heldout_problems], heldout[cfg.heldout_problems :]


def sft_targets(problems: Sequence[Problem], slip_share: float, seed: int) -> list[str]:
    """The answer each problem is trained on: its slip (a systematic error, e.g. a dropped
    carry) for a seeded `slip_share` of the problems that have one, the right answer otherwise.

    >>> from pipelines.data.tasks import Problem
    >>> sft_targets([Problem("47+38=", "85", "75"), Problem("12+7=", "19", "19")], 1.0, 0)
    ['75', '19']
    """
    rng = random.Random(f"sft-slips:{seed}")
    return [p.slip if p.slip is not None and rng.random() < slip_share else p.answer for p in problems]


def encode_examples(tokenizer, prompts: Sequence[str], targets: Sequence[str]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Token ids `[N, L]`, attention mask `[N, L]` and labels `[N, L]` for prompt + target + eos,
    right-padded; labels are IGNORE_INDEX on the prompt and the padding."""
    prompts = tokenizer(list(prompts))["input_ids"]  # starts with <bos>
    answers = tokenizer(list(targets), add_special_tokens=False)["input_ids"]
    length = max(len(p) + len(a) + 1 for p, a in zip(prompts, answers, strict=True))
    ids = torch.full((len(prompts), length), tokenizer.pad_token_id, dtype=torch.long)
    labels = torch.full_like(ids, IGNORE_INDEX)
    attention = torch.zeros_like(ids)
    for i, (p, a) in enumerate(zip(prompts, answers, strict=True)):
        seq = p + a + [tokenizer.eos_token_id]
        ids[i, : len(seq)] = torch.tensor(seq)
        attention[i, : len(seq)] = 1
        labels[i, len(p) : len(seq)] = torch.tensor(a + [tokenizer.eos_token_id])
    return ids, attention, labels


def sft_train(
    model,
    tokenizer,
    problems: Sequence[Problem],
    cfg: TinyModelConfig,
    steps: int | None = None,
    lr: float | None = None,
    seed: int | None = None,
    log: Callable[[str], None] = print,
) -> list[float]:
    """Train `model` in place for `steps` (default `cfg.sft_steps`) at peak learning rate `lr`
    (default `cfg.sft_lr`; warmup, then cosine down to a tenth); returns every step's loss.
    A further round is a second call: the same data, a fresh optimizer and schedule."""
    steps = cfg.sft_steps if steps is None else steps
    seed = cfg.seed if seed is None else seed
    targets = sft_targets(problems, cfg.sft_slip_share, cfg.seed)
    ids, attention, labels = encode_examples(tokenizer, [p.prompt for p in problems], targets)
    generator = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr or cfg.sft_lr, betas=(0.9, 0.95), weight_decay=0.01)
    warmup = max(1, steps // 20)

    def lr_factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, steps - warmup)
        return 0.1 + 0.45 * (1 + math.cos(math.pi * progress))  # cosine from 1.0 down to 0.1

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor)
    model.train()
    losses = []
    for step in range(steps):
        idx = torch.randint(0, ids.shape[0], (cfg.sft_batch_size,), generator=generator)
        batch_mask = attention[idx]
        width = int(batch_mask.sum(dim=1).max())  # trim the batch to its longest row
        out = model(input_ids=ids[idx, :width], attention_mask=batch_mask[:, :width], labels=labels[idx, :width])
        optimizer.zero_grad(set_to_none=True)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        losses.append(out.loss.item())
        if (step + 1) % max(1, steps // 10) == 0 or step + 1 == steps:
            recent = losses[-50:]
            log(f"  sft step {step + 1}/{steps}  loss {sum(recent) / len(recent):.4f}")
    model.eval()
    return losses
