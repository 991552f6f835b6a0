"""The one minibatch iterator: the experience buffer cuts each step's rows this way, and the
learner and the critic train on what it cuts."""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import numpy as np


def minibatch_rows(n: int, size: int, seed: int, epochs: int = 1) -> Iterator[np.ndarray]:
    """Row indices of each minibatch: `n` rows shuffled once with `seed`, cut into minibatches of
    `size` rows (the last one may be shorter), the same order again for each of `epochs` passes.

    >>> [rows.tolist() for rows in minibatch_rows(5, 2, seed=0, epochs=2)]
    [[2, 4], [3, 0], [1], [2, 4], [3, 0], [1]]
    """
    order = np.random.default_rng(seed).permutation(n)
    for _ in range(epochs):
        for start in range(0, n, size):
            yield order[start : start + size]


def minibatches(columns: Mapping[str, np.ndarray], size: int, seed: int, epochs: int = 1) -> list[dict[str, np.ndarray]]:
    """`columns` cut into the minibatches of `minibatch_rows` (rows stay whole).

    >>> [mb["x"].tolist() for mb in minibatches({"x": np.arange(5) * 10}, 2, seed=0)]
    [[20, 40], [30, 0], [10]]
    """
    n = len(next(iter(columns.values())))
    return [{k: v[rows] for k, v in columns.items()} for rows in minibatch_rows(n, size, seed, epochs)]
