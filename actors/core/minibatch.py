"""The one minibatch iterator: the learner, the critic and the experience buffer all cut a
step's rows this way."""

from __future__ import annotations

from collections.abc import Iterator

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
