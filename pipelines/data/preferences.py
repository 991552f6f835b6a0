"""Preference pairs for DPO: (prompt, chosen, rejected), and their token arrays.

A built-in task gives a pair for each of its problems: its right answer is chosen, its typical
slip rejected (arithmetic: the carries dropped, `47+38=` -> `75`), else a near miss. A
dataset gives them from its rows (`chosen` / `rejected` columns, see
`pipelines.data.dataset.preference_problem`), already rendered as text.
"""

from __future__ import annotations

import functools
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


def pair_of(problem: Problem) -> PreferencePair:
    """The preference pair of a problem: a dataset row's own `chosen` / `rejected`, or for a
    built-in task its answer over its slip (or a near miss when it has none).

    >>> pair_of(Problem("47+38=", "85", slip="75")), pair_of(Problem("12+7=", "19", slip="19")).rejected
    (PreferencePair(prompt='47+38=', chosen='85', rejected='75'), '20')
    """
    fields = problem.fields or {}
    if "chosen" in fields and "rejected" in fields:
        return PreferencePair(problem.prompt, fields["chosen"], fields["rejected"])
    if problem.answer is None:
        raise ValueError(f"problem {problem.prompt!r} has neither chosen/rejected completions nor an answer to build them from")
    slip = problem.slip if problem.slip not in (None, problem.answer) else near_miss(problem.answer)
    return PreferencePair(problem.prompt, problem.answer, slip)


def encode_pairs(tokenizer, pairs: Sequence[PreferencePair]) -> dict[str, np.ndarray]:
    """Token arrays of `pairs`, one row per pair: `prompt_ids` / `prompt_mask` `[N, P]`
    (left-padded, with the tokenizer's special tokens, as the engines tokenize prompts) and
    `chosen_ids` / `chosen_mask`, `rejected_ids` / `rejected_mask` `[N, T]` (right-padded; the
    completion ends with EOS, added unless its text already holds it, as a chat turn does)."""
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id or 0

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


@functools.cache
def _tokenizer(model_dir: str):
    from transformers import AutoTokenizer  # heavy: only the process that encodes pairs loads it

    return AutoTokenizer.from_pretrained(model_dir)


def encode_pairs_for(model_dir: str, pairs: Sequence[PreferencePair]) -> dict[str, np.ndarray]:
    """`encode_pairs` with the tokenizer in `model_dir` (loaded once per process): a Ray task."""
    return encode_pairs(_tokenizer(model_dir), pairs)
