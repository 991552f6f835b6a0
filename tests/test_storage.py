"""Run storage: a local directory, or a URI read and written through pyarrow's filesystems
(file:// here, the same code path as s3:// or gs://)."""

import pytest

from pipelines.data import storage


@pytest.fixture(params=["path", "uri"])
def root(request, tmp_path):
    return str(tmp_path / "runs") if request.param == "path" else f"file://{tmp_path}/runs"


def test_a_directory_written_is_read_back_whole(root):
    location = storage.join(root, "r", "checkpoints", "step_000001")
    with storage.writing(location) as out:
        (out / "policy").mkdir()
        (out / "policy" / "model.safetensors").write_bytes(b"\x00weights")
        (out / "trainer_state.json").write_text('{"step": 1}')
    with storage.reading(location) as got:
        assert sorted(str(p.relative_to(got)) for p in got.rglob("*")) == [
            "policy", "policy/model.safetensors", "trainer_state.json"
        ]  # fmt: skip
        assert (got / "policy" / "model.safetensors").read_bytes() == b"\x00weights"


def test_text_files_replace_whole_and_a_missing_one_reads_as_none(root):
    pointer = storage.join(root, "r", "checkpoints", "latest")
    assert storage.read_text(pointer) is None
    storage.write_text(pointer, "step_000001")
    storage.write_text(pointer, "step_000002")
    assert storage.read_text(pointer) == "step_000002"


def test_copy_dir_replaces_the_destination(root):
    src, dst = storage.join(root, "ck", "policy"), storage.join(root, "final")
    with storage.writing(dst) as out:
        (out / "stale.txt").write_text("old")
    with storage.writing(src) as out:
        (out / "config.json").write_text("{}")
    storage.copy_dir(src, dst)
    with storage.reading(dst) as got:
        assert sorted(p.name for p in got.iterdir()) == ["config.json"]
    storage.remove_dir(dst)
    with pytest.raises(storage.StorageError, match="does not exist"), storage.reading(dst):
        pass


def test_a_uri_checkpoint_is_downloaded_once_for_serving(tmp_path):
    uri = f"file://{tmp_path}/store/r/final"
    with storage.writing(uri) as out:
        (out / "config.json").write_text("{}")
    first = storage.local_copy(uri, tmp_path / "cache")
    assert (first / "config.json").read_text() == "{}" and first.parent.parent == tmp_path / "cache"
    assert storage.local_copy(uri, tmp_path / "cache") == first
    assert storage.local_copy(str(tmp_path / "store" / "r" / "final"), tmp_path / "cache") == tmp_path / "store" / "r" / "final"


def test_an_unknown_scheme_is_named():
    with pytest.raises(storage.StorageError, match=r"storage 'nosuch://x/y': pyarrow cannot open it"):
        storage.read_text("nosuch://x/y")


def test_a_manifest_tells_a_whole_directory_from_a_corrupt_truncated_or_unfinished_one(root, tmp_path):
    location = storage.join(root, "r", "checkpoints", "step_000002")
    with storage.writing(location) as out:
        (out / "policy").mkdir()
        (out / "policy" / "model.safetensors").write_bytes(b"w" * 10_000)
        (out / "trainer_state.json").write_text('{"step": 2}')
    assert storage.manifest_problem(location) == "no MANIFEST.json (its save did not finish)"
    files = storage.write_manifest(location)
    assert (
        sorted(files) == ["policy/model.safetensors", "trainer_state.json"]
        and files["policy/model.safetensors"]["bytes"] == 10_000
    )
    assert storage.manifest_problem(location) is None
    on_disk = tmp_path / "runs" / "r" / "checkpoints" / "step_000002" / "policy" / "model.safetensors"
    on_disk.write_bytes(b"w" * 4_000 + b"x" * 4_096 + b"w" * 1_904)  # garbage of the same size
    assert storage.manifest_problem(location) == "policy/model.safetensors does not match its checksum (corrupted)"
    on_disk.write_bytes(b"w" * 5_000)
    assert storage.manifest_problem(location) == (
        "policy/model.safetensors has 5000 bytes, 10000 when saved (truncated or overwritten)"
    )
    on_disk.unlink()
    assert storage.manifest_problem(location) == "policy/model.safetensors is missing"
    assert storage.list_dirs(storage.join(root, "r", "checkpoints")) == ["step_000002"]


def test_replace_dir_swaps_a_directory_in_whole(tmp_path):
    old, new = tmp_path / "step_000001", tmp_path / "step_000001.tmp"
    old.mkdir()
    (old / "a").write_text("old")
    new.mkdir()
    (new / "a").write_text("new")
    storage.replace_dir(str(new), str(old))
    assert (old / "a").read_text() == "new" and sorted(p.name for p in tmp_path.iterdir()) == ["step_000001"]
