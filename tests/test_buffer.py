import numpy as np
import pytest

from actors.core.buffer import Buffer, CorruptSpill, checksum_path, enforce_limits, spill_files, to_numpy, to_record_batch
from actors.core.minibatch import minibatches, shards


def _experience(n=6, width=3, seed=0):
    rng = np.random.default_rng(seed)
    return {
        "response_ids": rng.integers(0, 100, (n, width)),
        "behaviour_logprobs": rng.normal(size=(n, width)).astype(np.float32),
        "prompt_index": np.arange(n),
        "response_text": np.array([f"r{i}" for i in range(n)], dtype=object),
    }


def test_round_trip_through_arrow_keeps_values_and_dtypes():
    data = _experience()
    back = to_numpy(to_record_batch(data))
    for k, v in data.items():
        np.testing.assert_array_equal(back[k], v)
        assert back[k].dtype == v.dtype


def test_minibatches_are_a_shuffled_partition():
    buf = Buffer()
    size = buf.add(_experience(n=10))
    assert size["rows"] == 10 and size["steps"] == 1 and size["bytes"] > 0
    parts = buf.minibatches(4, seed=1)
    assert [len(p["prompt_index"]) for p in parts] == [4, 3, 3]  # equal cuts: no 2-row step weighing as a full one
    seen = np.concatenate([p["prompt_index"] for p in parts])
    assert sorted(seen) == list(range(10)) and list(seen) != list(range(10))
    for p in parts:  # rows stay whole
        np.testing.assert_array_equal(p["response_text"], [f"r{i}" for i in p["prompt_index"]])


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_minibatches_and_shards_keep_a_prompts_samples_together(seed):
    """32 samples of 4 prompts (8 each, interleaved as a batch may come) at 16 per minibatch: each
    minibatch holds two whole groups, the groups' order differs by seed, and on two learner ranks
    each rank gets one whole group (so each runs its prompt once)."""
    data = _experience(n=32) | {"prompt_index": np.arange(32) % 4}
    parts = minibatches(data, 16, seed=seed)
    assert [sorted(np.unique(p["prompt_index"], return_counts=True)[1]) for p in parts] == [[8, 8], [8, 8]]
    assert sorted(np.concatenate([p["response_text"] for p in parts])) == sorted(data["response_text"])
    for part in parts:
        assert [np.unique(s.columns["prompt_index"]).size for s in shards(part, 2)] == [1, 1]
    orders = {tuple(np.concatenate([p["prompt_index"] for p in minibatches(data, 16, seed=s)])[::8]) for s in range(6)}
    assert len(orders) > 1


def test_spill_to_parquet_zstd_and_read_back(tmp_path):
    import pyarrow.parquet as pq

    buf = Buffer(max_steps=2)
    for step in range(3):
        buf.add(_experience(seed=step))
    assert buf.size()["steps"] == 2  # old steps are dropped
    path = buf.spill(tmp_path / "step.parquet")
    assert pq.ParquetFile(path).metadata.row_group(0).column(0).compression == "ZSTD"
    back = Buffer.read(path)
    np.testing.assert_array_equal(back["response_ids"], _experience(seed=2)["response_ids"])


def test_bad_experience_is_rejected():
    buf = Buffer()
    with pytest.raises(ValueError, match="differ in length"):
        buf.add({"a": np.zeros(3), "b": np.zeros(4)})
    with pytest.raises(ValueError, match="3 dimensions"):
        buf.add({"a": np.zeros((2, 2, 2))})
    with pytest.raises(LookupError, match="empty"):
        Buffer().minibatches(2)


def test_a_corrupt_truncated_or_unfinished_spill_is_quarantined_not_read(tmp_path):
    buf = Buffer(max_steps=3)
    paths = []
    for step in range(3):
        buf.add(_experience(seed=step))
        paths.append(buf.spill(tmp_path / f"step_{step:06d}.parquet"))
    np.testing.assert_array_equal(Buffer.read(paths[0])["response_ids"], _experience(seed=0)["response_ids"])
    data = paths[0].read_bytes()
    paths[0].write_bytes(data[:100] + bytes(b ^ 0xFF for b in data[100:200]) + data[200:])  # same size, flipped bytes
    paths[1].write_bytes(paths[1].read_bytes()[:-50])  # truncated
    checksum_path(paths[2]).unlink()  # a write that did not finish
    for path, why in zip(paths, ["does not match its checksum", "bytes, ", "no checksum beside it"], strict=True):
        with pytest.raises(CorruptSpill, match=f"{path}: .*{why}.*moved to .*quarantine.*not trained on"):
            Buffer.read(path)
        assert not path.exists() and (tmp_path / "quarantine" / path.name).exists()
    assert spill_files(tmp_path) == []


def test_the_spill_directory_keeps_within_its_size_and_age(tmp_path):
    buf = Buffer()
    for step in range(5):
        buf.add(_experience(seed=step))
        buf.spill(tmp_path / f"step_{step:06d}.parquet")
    one = (tmp_path / "step_000000.parquet").stat().st_size
    removed = enforce_limits(tmp_path, max_bytes=int(3.5 * one), max_age_s=0)
    assert [p.name for p in removed] == ["step_000000.parquet", "step_000001.parquet"]
    assert [p.name for p in spill_files(tmp_path)] == ["step_000002.parquet", "step_000003.parquet", "step_000004.parquet"]
    now = (tmp_path / "step_000004.parquet").stat().st_mtime + 7200
    assert len(enforce_limits(tmp_path, max_bytes=0, max_age_s=3600, now=now)) == 2  # the newest file always stays
    assert [p.name for p in spill_files(tmp_path)] == ["step_000004.parquet"]
    assert not list(tmp_path.glob("step_000000*"))  # the checksum files went with them
