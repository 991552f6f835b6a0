"""The one minibatch iterator: the experience buffer cuts each step's rows this way, and the
learner and the critic train on what it cuts."""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import numpy as np


def minibatch_rows(n: int, size: int, seed: int, epochs: int = 1) -> Iterator[np.ndarray]:
    """Row indices of each minibatch: `n` rows shuffled once with `seed`, cut into ceil(n / size)
    minibatches of equal size give or take one row (never more than `size`), the same order again
    for each of `epochs` passes.

    Equal cuts, not `size`-row cuts with a short remainder: each minibatch gets one optimizer step
    of the same weight, so 130 rows at size 64 train as 44 + 43 + 43, not as 64 + 64 + a 2-row
    step that counts as much as a full one.

    >>> [rows.tolist() for rows in minibatch_rows(5, 2, seed=0, epochs=2)]
    [[2, 4], [3, 0], [1], [2, 4], [3, 0], [1]]
    >>> [len(rows) for rows in minibatch_rows(130, 64, seed=0)]
    [44, 43, 43]
    """
    order = np.random.default_rng(seed).permutation(n)
    cuts = np.array_split(order, max(1, -(-n // size)))  # ceil(n / size) parts, sizes differ by <= 1
    for _ in range(epochs):
        yield from cuts


def minibatch_count(n: int, size: int, epochs: int = 1) -> int:
    """How many minibatches `minibatch_rows` cuts `n` rows into.

    >>> minibatch_count(5, 2, epochs=2), minibatch_count(130, 64)
    (6, 3)
    """
    return max(1, -(-n // size)) * epochs


def minibatches(columns: Mapping[str, np.ndarray], size: int, seed: int, epochs: int = 1) -> list[dict[str, np.ndarray]]:
    """`columns` cut into the minibatches of `minibatch_rows` (rows stay whole).

    >>> [mb["x"].tolist() for mb in minibatches({"x": np.arange(5) * 10}, 2, seed=0)]
    [[20, 40], [30, 0], [10]]
    """
    n = len(next(iter(columns.values())))
    return [{k: v[rows] for k, v in columns.items()} for rows in minibatch_rows(n, size, seed, epochs)]
