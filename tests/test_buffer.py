import numpy as np
import pytest

from actors.core.buffer import Buffer, to_numpy, to_record_batch


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
