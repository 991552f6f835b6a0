"""The one minibatch iterator: the experience buffer cuts each step's rows this way, and the
learner and the critic train on what it cuts."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass

import numpy as np


def minibatch_rows(n: int, size: int, seed: int, epochs: int = 1, groups: np.ndarray | None = None) -> Iterator[np.ndarray]:
    """Row indices of each minibatch: `n` rows shuffled once with `seed`, cut into ceil(n / size)
    minibatches of equal size give or take one row (never more than `size`), the same order again
    for each of `epochs` passes.

    Equal cuts, not `size`-row cuts with a short remainder: each minibatch gets one optimizer step
    of the same weight, so 130 rows at size 64 train as 44 + 43 + 43, not as 64 + 64 + a 2-row
    step that counts as much as a full one.

    `groups` `[n]` (each row's prompt: a group's samples) shuffles whole groups instead of rows,
    keeping each group's rows together: each cut then splits at most the one group it falls in,
    and none when the cuts' size (n / their number) is a multiple of the group size (32 rows of
    groups of 8 at `size` 16; not 24 rows at 16, cut 12 + 12), so a learner runs each prompt once
    per minibatch (`actors.core.modeling`) and a group's advantages, centred on its own mean,
    stay in one update.

    >>> [rows.tolist() for rows in minibatch_rows(5, 2, seed=0, epochs=2)]
    [[2, 4], [3, 0], [1], [2, 4], [3, 0], [1]]
    >>> [len(rows) for rows in minibatch_rows(130, 64, seed=0)]
    [44, 43, 43]
    >>> [rows.tolist() for rows in minibatch_rows(6, 4, seed=0, groups=np.array([0, 0, 1, 1, 2, 2]))]
    [[2, 3, 4], [5, 0, 1]]
    """
    rng = np.random.default_rng(seed)
    if groups is None:
        order = rng.permutation(n)
    else:
        distinct, group_of_row = np.unique(groups, return_inverse=True)
        place = rng.permutation(len(distinct))  # each group's place in the new order
        order = np.argsort(place[group_of_row], kind="stable")  # a group's rows together, in their own order
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
    """`columns` cut into the minibatches of `minibatch_rows` (rows stay whole), whole groups
    shuffled when they have a `prompt_index` (rollout experience; preference pairs do not).

    >>> [mb["x"].tolist() for mb in minibatches({"x": np.arange(5) * 10}, 2, seed=0)]
    [[20, 40], [30, 0], [10]]
    """
    n = len(next(iter(columns.values())))
    groups = columns.get("prompt_index")
    return [{k: v[rows] for k, v in columns.items()} for rows in minibatch_rows(n, size, seed, epochs, groups)]


def scored_tokens(columns: Mapping[str, np.ndarray]) -> np.ndarray:
    """`[N, T]`: the response tokens of the samples a reward scored (`scored` `[N]`; all when there
    is no such column). Unscored samples stay out of every loss and normalizer.

    >>> scored_tokens({"response_mask": np.array([[1, 1], [1, 0]]), "scored": np.array([False, True])}).tolist()
    [[0, 0], [1, 0]]
    """
    mask = columns["response_mask"]
    if "scored" in columns:
        mask = mask * np.asarray(columns["scored"], dtype=np.int64)[:, None]
    return mask


@dataclass(frozen=True)
class Shard:
    """One learner rank's rows of a minibatch (consecutive rows, `shards`), all that the rank
    fetches, and what its losses need of the whole minibatch: how many rows it has, its scored
    response tokens and the samples that have any (`pipelines.algos.losses.Normalizers`). A rank
    with no rows of its own holds the minibatch's first row, `owned` 0: the policy update runs it
    without loss (under ZeRO every rank takes part in every forward and backward); DPO and
    reward-model updates run an empty pass."""

    columns: dict[str, np.ndarray]
    owned: int  # rows of `columns` that are this rank's: all of them, or 0
    rows: int  # the whole minibatch's
    tokens: float = 0.0
    sequences: float = 0.0

    @property
    def nbytes(self) -> int:
        return sum(v.nbytes for v in self.columns.values())


def shards(minibatch: Mapping[str, np.ndarray], world_size: int) -> list[Shard]:
    """Each rank's `Shard` of a minibatch: consecutive rows, as many each give or take one (the
    minibatch keeps a group's rows together; so does a rank's share, but for the groups its ends cut).

    >>> mb = {"response_mask": np.array([[1, 1], [1, 0], [0, 0]]), "x": np.arange(3)}
    >>> [(s.columns["x"].tolist(), s.owned, s.rows, s.tokens, s.sequences) for s in shards(mb, 2)]
    [([0, 1], 2, 3, 3.0, 2.0), ([2], 1, 3, 3.0, 2.0)]
    >>> [(s.columns["x"].tolist(), s.owned) for s in shards({"x": np.arange(1)}, 2)]
    [([0], 1), ([0], 0)]
    """
    rows = len(next(iter(minibatch.values())))
    tokens = scored_tokens(minibatch).sum(axis=1) if "response_mask" in minibatch else np.zeros(0)
    whole = {"rows": rows, "tokens": float(tokens.sum()), "sequences": float((tokens > 0).sum())}
    out = []
    for mine in np.array_split(np.arange(rows), world_size):
        columns = {k: v[mine if len(mine) else np.arange(1)] for k, v in minibatch.items()}
        out.append(Shard(columns, owned=len(mine), **whole))
    return out


def joined(parts: Iterable[Shard]) -> dict[str, np.ndarray]:
    """The rows of a minibatch's shards together again, in the minibatch's order.

    >>> joined(shards({"x": np.arange(5)}, 2))["x"].tolist()
    [0, 1, 2, 3, 4]
    """
    parts = [p for p in parts if p.owned]
    return {k: np.concatenate([p.columns[k] for p in parts]) for k in parts[0].columns}
