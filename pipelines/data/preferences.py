"""Preference pairs for DPO: (prompt, chosen, rejected), and their token arrays.

A built-in task gives a pair for each of its problems: its right answer is chosen, its typical
slip rejected (arithmetic: the carries dropped, `47+38=` -> `75`), else a near miss. A
dataset gives them from its rows (`chosen` / `rejected` columns, see
`pipelines.data.dataset.preference_problem`), already rendered as text.
"""

from __future__ import annotations

import functools
import random
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from pipelines.data.tasks import Problem


@dataclass(frozen=True)
class PreferencePair:
    prompt: str
    chosen: str
    rejected: str


def near_miss(answer: str) -> str:
    """A wrong answer close to `answer`: a number one more, else the text reversed (or with its
    last character doubled, when reversing changes nothing).

    >>> near_miss("19"), near_miss("-3"), near_miss("abc"), near_miss("aa")
    ('20', '-2', 'cba', 'aaa')
    """
    try:
        return str(int(answer) + 1)
    except ValueError:
        return answer[::-1] if answer[::-1] != answer else answer + answer[-1:]


def corrupted(answer: str, rng: random.Random) -> str:
    """A wrong answer drawn from many kinds of mistakes: off by 1, 10 or 100, a digit dropped,
    doubled or two swapped, or another number as long (for text: reversed, a character dropped
    or doubled). A reward model trained against these must check the answer, not its look.

    >>> rng = random.Random(0)
    >>> sorted({corrupted("85", rng) for _ in range(200)} & {"84", "95", "8", "58", "885"})
    ['58', '8', '84', '885', '95']
    """
    digits = len(answer.lstrip("-"))

    def off_by():  # 1, 10 or 100 too many or too few
        return str(int(answer) + rng.choice([-1, 1]) * 10 ** rng.randrange(3))

    def same_length():
        return str(rng.randrange(10 ** (digits - 1) if digits > 1 else 0, 10**digits))

    def drop(i):
        return answer[:i] + answer[i + 1 :]

    def double(i):
        return answer[:i] + answer[i] + answer[i:]

    def swap(i):
        return answer[:i] + answer[i + 1 : i + 2] + answer[i] + answer[i + 2 :]

    edits = [lambda: rng.choice([drop, double, swap])(rng.randrange(len(answer)))]
    kinds = [off_by, same_length, *edits * 3] if answer.lstrip("-").isdigit() else [*edits, lambda: answer[::-1]]
    for _ in range(20):
        wrong = rng.choice(kinds)()
        if wrong and wrong != answer:
            return wrong
    return near_miss(answer)


def pair_of(problem: Problem, rng: random.Random | None = None) -> PreferencePair:
    """The preference pair of a problem: a dataset row's own `chosen` / `rejected`, or for a
    built-in task its answer over its slip (or a near miss when it has none). With `rng` (reward
    models), a built-in problem's rejected answer is its slip a third of the time and one of the
    `corrupted` answers otherwise, so the mistakes vary.

    >>> pair_of(Problem("47+38=", "85", slip="75")), pair_of(Problem("12+7=", "19", slip="19")).rejected
    (PreferencePair(prompt='47+38=', chosen='85', rejected='75'), '20')
    """
    fields = problem.fields or {}
    if "chosen" in fields and "rejected" in fields:
        return PreferencePair(problem.prompt, fields["chosen"], fields["rejected"])
    if problem.answer is None:
        raise ValueError(f"problem {problem.prompt!r} has neither chosen/rejected completions nor an answer to build them from")
    has_slip = problem.slip not in (None, problem.answer)
    if rng is not None and not (has_slip and rng.random() < 1 / 3):
        return PreferencePair(problem.prompt, problem.answer, corrupted(problem.answer, rng))
    return PreferencePair(problem.prompt, problem.answer, problem.slip if has_slip else near_miss(problem.answer))


def varied_pairs(problems: Sequence[Problem], seed: int) -> list[PreferencePair]:
    """`pair_of` each problem with its rejected answer drawn from many kinds of mistakes (as a
    reward model trains on them), seeded."""
    rng = random.Random(seed)
    return [pair_of(p, rng) for p in problems]


def heldout_pairs(problems: Sequence[Problem], seed: int) -> list[PreferencePair]:
    """The held-out pairs a reward model is checked on (`raypo train-rm`, and each refresh during
    RL): `varied_pairs` of held-out problems (never trained on) drawn with seed -1 - seed."""
    return varied_pairs(problems, -1 - seed)


def pairs_from_samples(
    prompts: Sequence[str], completions: Sequence[str], labels: Sequence[float | None], groups: Sequence[int]
) -> list[PreferencePair]:
    """Preference pairs from sampled completions that a label ranks: within each group (one
    prompt's samples), each completion with the top label is paired with one of the lowest, in
    turn; groups whose labels are all equal (or missing) give none.

    >>> pairs_from_samples(["a=", "a=", "a=", "b="], ["1", "2", "3", "9"], [1.0, 0.0, 0.0, 1.0], [0, 0, 0, 1])
    [PreferencePair(prompt='a=', chosen='1', rejected='2')]
    """
    by_group: dict[int, list[int]] = {}
    for i, group in enumerate(groups):
        if labels[i] is not None:
            by_group.setdefault(int(group), []).append(i)
    pairs = []
    for rows in by_group.values():
        top, bottom = max(labels[i] for i in rows), min(labels[i] for i in rows)
        if top == bottom:
            continue
        best, worst = [i for i in rows if labels[i] == top], [i for i in rows if labels[i] == bottom]
        pairs += [PreferencePair(prompts[b], completions[b], completions[worst[k % len(worst)]]) for k, b in enumerate(best)]
    return pairs


def encode_pairs(tokenizer, pairs: Sequence[PreferencePair]) -> dict[str, np.ndarray]:
    """Token arrays of `pairs`, one row per pair: `prompt_ids` / `prompt_mask` `[N, P]`
    (left-padded, with the tokenizer's special tokens, as the engines tokenize prompts) and
    `chosen_ids` / `chosen_mask`, `rejected_ids` / `rejected_mask` `[N, T]` (right-padded; the
    completion ends with EOS, added unless its text already holds it, as a chat turn does)."""
    eos, pad = tokenizer.eos_token_id, pad_id(tokenizer)

    def completion(text: str) -> list[int]:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        return ids if eos is None or eos in ids else [*ids, eos]

    prompts = [tokenizer(p.prompt)["input_ids"] for p in pairs]
    out = _padded(prompts, pad, left=True, name="prompt")
    for side in ("chosen", "rejected"):
        out |= _padded([completion(getattr(p, side)) for p in pairs], pad, left=False, name=side)
    return out


def _padded(rows: list[list[int]], pad: int, left: bool, name: str) -> dict[str, np.ndarray]:
    width = max(1, max(len(r) for r in rows))
    ids = np.full((len(rows), width), pad, dtype=np.int64)
    mask = np.zeros((len(rows), width), dtype=np.int64)
    for i, r in enumerate(rows):
        span = slice(width - len(r), width) if left else slice(0, len(r))
        ids[i, span], mask[i, span] = r, 1
    return {f"{name}_ids": ids, f"{name}_mask": mask}


def pad_id(tokenizer) -> int:
    """The id padding uses: the tokenizer's pad token, else its EOS (many Llama-family tokenizers
    have no pad token), else 0. A reward model finds its last real token by this id."""
    for candidate in (tokenizer.pad_token_id, tokenizer.eos_token_id):
        if candidate is not None:
            return candidate
    return 0


def reward_model_inputs(tokenizer, prompts: Sequence[str], completions: Sequence[str]) -> dict[str, np.ndarray]:
    """What a reward model reads: `prompt + completion` as one text, with the tokenizer's special
    tokens, right-padded with `pad_id`: `input_ids`, `attention_mask` `[N, L]`. The same for
    training the RM and for scoring with it (`actors.core.reward.ModelReward`)."""
    rows = [tokenizer(p + c)["input_ids"] for p, c in zip(prompts, completions, strict=True)]
    out = _padded(rows, pad_id(tokenizer), left=False, name="input")
    return {"input_ids": out["input_ids"], "attention_mask": out["input_mask"]}


def encode_reward_pairs(tokenizer, pairs: Sequence[PreferencePair]) -> dict[str, np.ndarray]:
    """`chosen_input_ids` / `chosen_attention_mask` and the same for `rejected`: each pair's two
    sequences as a reward model reads them (`reward_model_inputs`). A completion rendered by a
    chat template ends with the end-of-turn text, which sampled completions (the engines' text,
    special tokens skipped) lack: it is cut here, so the RM learns on what it will score."""
    eos = tokenizer.eos_token

    def as_sampled(text: str) -> str:
        return text.split(eos)[0] if eos and eos in text else text

    out = {}
    for side in ("chosen", "rejected"):
        completions = [as_sampled(getattr(p, side)) for p in pairs]
        inputs = reward_model_inputs(tokenizer, [p.prompt for p in pairs], completions)
        out |= {f"{side}_{k}": v for k, v in inputs.items()}
    return out


@functools.cache
def _tokenizer(model_dir: str):
    from transformers import AutoTokenizer  # heavy: only the process that encodes pairs loads it

    return AutoTokenizer.from_pretrained(model_dir)


def encode_pairs_for(model_dir: str, pairs: Sequence[PreferencePair]) -> dict[str, np.ndarray]:
    """`encode_pairs` with the tokenizer in `model_dir` (loaded once per process): a Ray task."""
    return encode_pairs(_tokenizer(model_dir), pairs)


def encode_reward_pairs_for(model_dir: str, pairs: Sequence[PreferencePair]) -> dict[str, np.ndarray]:
    """`encode_reward_pairs` with the tokenizer in `model_dir`: a Ray task."""
    return encode_reward_pairs(_tokenizer(model_dir), pairs)
