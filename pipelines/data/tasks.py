"""Built-in verifiable tasks: problems with one exactly checkable answer.

A task yields `Problem(prompt, answer)` rows from a train or a held-out split. The split is a
pure function of the problem (a hash of its prompt), so no held-out problem is ever trained
on, whatever the seed or the number of samples drawn.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from pipelines.registry import Registry

if TYPE_CHECKING:  # for annotations only: the config does not need the tasks at load
    from pipelines.config import ArithmeticTaskConfig, ReverseTaskConfig

Split = Literal["train", "heldout"]
HELDOUT_PERCENT = 20  # share of all problems that belong to the held-out split


@dataclass(frozen=True)
class Problem:
    prompt: str
    answer: str | None  # the reference answer (None: a dataset without an answer column)
    slip: str | None = None  # the answer as a typical systematic error gives it (None: no such error)
    fields: dict | None = None  # a dataset row's columns for the reward functions (None: just `answer`)

    def reward_fields(self) -> dict:
        """The keyword arguments the reward functions get for this problem."""
        return {"answer": self.answer} if self.fields is None else self.fields


def reward_fields(problems: Sequence[Problem]) -> dict[str, list]:
    """Column -> one value per problem (None where a problem lacks the column): the `**fields`
    of the reward functions, TRL's convention.

    >>> reward_fields([Problem("a", "1"), Problem("b", None, fields={"level": 2})])
    {'answer': ['1', None], 'level': [None, 2]}
    """
    rows = [p.reward_fields() for p in problems]
    columns = list(dict.fromkeys(k for row in rows for k in row))
    return {k: [row.get(k) for row in rows] for k in columns}


def add_without_carry(a: int, b: int) -> int:
    """`a + b` with every carry dropped (each digit is the sum of its column mod 10): the
    classic slip of column addition.

    >>> add_without_carry(47, 38), add_without_carry(12, 7), add_without_carry(95, 5)
    (75, 19, 90)
    """
    digits, place = 0, 1
    while a or b:
        digits += ((a % 10 + b % 10) % 10) * place
        a, b, place = a // 10, b // 10, place * 10
    return digits


def in_heldout(prompt: str, percent: int = HELDOUT_PERCENT) -> bool:
    """Whether `prompt` belongs to the held-out `percent` of all prompts (a hash: stable everywhere)."""
    bucket = int.from_bytes(hashlib.sha256(prompt.encode()).digest()[:4], "big") % 100
    return bucket < percent


def _split_of(prompt: str) -> Split:
    return "heldout" if in_heldout(prompt) else "train"


class Task:
    """A generator of problems; subclasses define `sample_one(rng)` and `name`."""

    name: str

    def sample_one(self, rng: random.Random) -> Problem:
        raise NotImplementedError

    def sample(self, n: int, split: Split, seed: int = 0) -> list[Problem]:
        """`n` distinct problems of `split`, drawn deterministically from `seed`."""
        if split not in ("train", "heldout"):
            raise ValueError(f"unknown split {split!r}; known: train, heldout")
        rng = random.Random(f"{self.name}:{split}:{seed}")
        seen: dict[str, Problem] = {}
        attempts = 0
        while len(seen) < n:
            attempts += 1
            if attempts > 200 * n + 10_000:
                raise ValueError(f"task {self.name!r} has fewer than {n} distinct {split} problems; widen its ranges")
            problem = self.sample_one(rng)
            if _split_of(problem.prompt) == split:
                seen.setdefault(problem.prompt, problem)
        return list(seen.values())

    def stream(self, split: Split, seed: int = 0):
        """An endless stream of problems of `split` (repeats allowed), for RL prompts."""
        rng = random.Random(f"{self.name}:stream:{split}:{seed}")
        while True:
            problem = self.sample_one(rng)
            if _split_of(problem.prompt) == split:
                yield problem


TASKS: Registry[type[Task]] = Registry("task")

_OPERATORS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}


@TASKS.register("arithmetic")
@dataclass
class Arithmetic(Task):
    """`a<op>b=` -> the exact integer result, e.g. `12+7=` -> `19`.

    >>> Arithmetic(min_operand=0, max_operand=9, operators="+").sample(2, "train")[0].prompt[-1]
    '='
    """

    min_operand: int = 0
    max_operand: int = 99
    operators: str = "+-"
    name: str = "arithmetic"

    def __post_init__(self):
        unknown = set(self.operators) - set(_OPERATORS)
        if unknown or not self.operators:
            raise ValueError(f"arithmetic operators must be drawn from {''.join(_OPERATORS)}, got {self.operators!r}")
        if self.min_operand < 0 or self.max_operand < self.min_operand:
            raise ValueError(f"arithmetic needs 0 <= min_operand <= max_operand, got {self.min_operand}, {self.max_operand}")

    def sample_one(self, rng: random.Random) -> Problem:
        a = rng.randint(self.min_operand, self.max_operand)
        b = rng.randint(self.min_operand, self.max_operand)
        op = rng.choice(self.operators)
        slip = str(add_without_carry(a, b)) if op == "+" else None
        return Problem(prompt=f"{a}{op}{b}=", answer=str(_OPERATORS[op](a, b)), slip=slip)


@TASKS.register("reverse")
@dataclass
class Reverse(Task):
    """`rev abc=` -> the string reversed, e.g. `rev abc=` -> `cba`."""

    min_length: int = 2
    max_length: int = 5
    alphabet: str = "abcdefghij"
    name: str = "reverse"

    def __post_init__(self):
        if not 1 <= self.min_length <= self.max_length:
            raise ValueError(f"reverse needs 1 <= min_length <= max_length, got {self.min_length}, {self.max_length}")
        if not self.alphabet or "=" in self.alphabet:
            raise ValueError(f"reverse alphabet must be non-empty and must not contain '=', got {self.alphabet!r}")

    def sample_one(self, rng: random.Random) -> Problem:
        length = rng.randint(self.min_length, self.max_length)
        text = "".join(rng.choice(self.alphabet) for _ in range(length))
        return Problem(prompt=f"rev {text}=", answer=text[::-1])


def make_task(name: str, **options) -> Task:
    """Build a registered task by name with its options (the config's task section)."""
    try:
        return TASKS.get(name)(**options)
    except TypeError as err:
        raise ValueError(f"bad options for task {name!r}: {err}") from None


def task_from_config(section: ArithmeticTaskConfig | ReverseTaskConfig) -> Task:
    """The task a config section describes (`task.task`, or an entry of `model.tiny.sft_tasks`).

    >>> from pipelines.config import ReverseTaskConfig
    >>> task_from_config(ReverseTaskConfig(max_length=3))
    Reverse(min_length=2, max_length=3, alphabet='abcdefghij', name='reverse')
    """
    return make_task(section.name, **section.model_dump(exclude={"name"}))
