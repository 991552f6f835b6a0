"""Buffer: the Ray-free core of the experience buffer (the seeds' "experience pool").

Holds each step's experience as an Arrow record batch (2-D arrays as fixed-size lists, so a
row is one sample), serves shuffled minibatches as numpy, spills to Parquet with zstd (each file
with a checksum: a corrupt or truncated one is quarantined, never read back), keeps the spill
directory within a size and an age (the seeds' lifecycle policy), and reports its size. Old
steps are dropped beyond `max_steps`.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from actors.core.minibatch import minibatches
from pipelines.data.storage import file_sha256, write_text


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
        """Write the latest step to Parquet (zstd) at `path`, whole (a temporary name, fsynced,
        renamed), then its checksum beside it (`<path>.sha256`), which `read` checks."""
        if not self.steps:
            raise LookupError("the experience buffer is empty")
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        pq.write_table(pa.Table.from_batches([self.steps[-1]]), tmp, compression="zstd")
        digest = file_sha256(str(tmp))  # fsyncs it too
        tmp.replace(path)
        write_text(str(checksum_path(path)), f"{digest} {path.stat().st_size}\n")
        return path

    @staticmethod
    def read(path: str | Path) -> dict[str, np.ndarray]:
        """A spilled step, after checking it against its checksum; a file that does not match (or
        has none, or does not parse) is moved to quarantine/ beside it and CorruptSpill names it."""
        path = Path(path)
        problem = spill_problem(path)
        if problem is None:
            try:
                return to_numpy(pq.read_table(path))
            except (OSError, pa.ArrowException) as err:
                problem = f"Parquet cannot read it ({err})"
        quarantined = quarantine(path)
        raise CorruptSpill(f"experience file {path}: {problem}; moved to {quarantined}, not trained on")


class CorruptSpill(OSError):
    """A spilled experience file is corrupt or truncated; the message names it and where it was moved."""


def checksum_path(path: Path) -> Path:
    return path.with_name(path.name + ".sha256")


def spill_problem(path: Path) -> str | None:
    """What is wrong with a spilled file by its checksum file, or None."""
    try:
        digest, size = checksum_path(path).read_text().split()
    except (OSError, ValueError):
        return "no checksum beside it (its write did not finish)"
    if not path.is_file():
        return "missing"
    if path.stat().st_size != int(size):
        return f"{path.stat().st_size} bytes, {size} when written (truncated or overwritten)"
    if file_sha256(str(path)) != digest:
        return "does not match its checksum (corrupted)"
    return None


def quarantine(path: Path) -> Path:
    """Move a bad spill file (and its checksum) to quarantine/ in its directory; returns where."""
    target = path.parent / "quarantine" / path.name
    target.parent.mkdir(exist_ok=True)
    if path.exists():
        path.replace(target)
    if checksum_path(path).exists():
        checksum_path(path).replace(checksum_path(target))
    return target


def spill_files(directory: Path) -> list[Path]:
    """The spilled steps in `directory`, oldest first."""
    return sorted(directory.glob("step_*.parquet")) if directory.is_dir() else []


def enforce_limits(directory: Path, max_bytes: int, max_age_s: float, now: float | None = None) -> list[Path]:
    """The lifecycle of the spilled experience: delete the oldest files while the directory holds
    more than `max_bytes` (0 = no limit), and any older than `max_age_s` (0 = none); the newest
    file always stays. Returns the files deleted."""
    files = spill_files(directory)
    now = time.time() if now is None else now
    removed = []
    total = sum(f.stat().st_size for f in files)
    for f in files[:-1]:
        too_old = max_age_s and now - f.stat().st_mtime > max_age_s
        if too_old or (max_bytes and total > max_bytes):
            total -= f.stat().st_size
            f.unlink()
            checksum_path(f).unlink(missing_ok=True)
            removed.append(f)
    return removed
