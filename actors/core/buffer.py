"""Buffer: the Ray-free core of the experience buffer (the seeds' "experience pool").

Holds each step's experience as an Arrow record batch (2-D arrays as fixed-size lists, so a
row is one sample), serves shuffled minibatches as numpy, spills to Parquet with zstd, and
reports its size. Old steps are dropped beyond `max_steps`.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from actors.core.minibatch import minibatches


def to_record_batch(columns: Mapping[str, np.ndarray]) -> pa.RecordBatch:
    """numpy columns (1-D, or 2-D `[N, W]`) -> one Arrow record batch of N rows."""
    arrays, names = [], []
    for name, values in columns.items():
        values = np.asarray(values)
        if values.dtype == object:
            arrays.append(pa.array([None if v is None else str(v) for v in values], type=pa.string()))
        elif values.ndim == 2:
            flat = pa.array(np.ascontiguousarray(values).reshape(-1))
            arrays.append(pa.FixedSizeListArray.from_arrays(flat, values.shape[1]))
        elif values.ndim == 1:
            arrays.append(pa.array(values))
        else:
            raise ValueError(f"column {name!r} has {values.ndim} dimensions; the buffer stores 1-D and 2-D columns")
        names.append(name)
    return pa.RecordBatch.from_arrays(arrays, names=names)


def to_numpy(batch: pa.RecordBatch | pa.Table) -> dict[str, np.ndarray]:
    """The inverse of `to_record_batch` (zero-copy for numeric columns without nulls)."""
    out = {}
    for name, column in zip(batch.schema.names, batch.columns, strict=True):
        if isinstance(column, pa.ChunkedArray):
            column = column.combine_chunks()
        if pa.types.is_fixed_size_list(column.type):
            width = column.type.list_size
            out[name] = column.flatten().to_numpy(zero_copy_only=False).reshape(-1, width)
        elif pa.types.is_string(column.type):
            out[name] = np.array(column.to_pylist(), dtype=object)
        else:
            out[name] = column.to_numpy(zero_copy_only=False)
    return out


class Buffer:
    def __init__(self, max_steps: int = 1):
        self.steps: deque[pa.RecordBatch] = deque(maxlen=max_steps)
        self.keys: deque = deque(maxlen=max_steps)

    def add(self, columns: Mapping[str, np.ndarray], key=None) -> dict:
        """Store one step's experience (all columns have the same number of rows); added again
        under the newest step's `key` (a retried call), it replaces that step's rows."""
        lengths = {name: len(v) for name, v in columns.items()}
        if len(set(lengths.values())) != 1:
            raise ValueError(f"experience columns differ in length: {lengths}")
        if key is not None and self.keys and self.keys[-1] == key:
            self.steps.pop()
            self.keys.pop()
        self.steps.append(to_record_batch(columns))
        self.keys.append(key)
        return self.size()

    def size(self) -> dict:
        return {
            "steps": len(self.steps),
            "rows": sum(b.num_rows for b in self.steps),
            "bytes": sum(b.nbytes for b in self.steps),
        }

    def latest(self) -> dict[str, np.ndarray]:
        if not self.steps:
            raise LookupError("the experience buffer is empty")
        return to_numpy(self.steps[-1])

    def minibatches(self, size: int, seed: int = 0) -> list[dict[str, np.ndarray]]:
        """The latest step's rows, shuffled with `seed`, in minibatches of `size` rows (one pass)."""
        return minibatches(self.latest(), size, seed)

    def spill(self, path: str | Path) -> Path:
        """Write the latest step to Parquet (zstd) at `path`."""
        if not self.steps:
            raise LookupError("the experience buffer is empty")
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(pa.Table.from_batches([self.steps[-1]]), path, compression="zstd")
        return path

    @staticmethod
    def read(path: str | Path) -> dict[str, np.ndarray]:
        return to_numpy(pq.read_table(path))
