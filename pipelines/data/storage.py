"""Where a run's durable outputs live: a local directory (shared by the nodes, or this machine's),
or any URI that pyarrow's filesystems take (s3://, gs://, hdfs://, and file:// for a local
directory read and written the way an object store is).

A process writes into a local directory and, for a URI, uploads it when done (`writing`); it
reads from a local copy (`reading`). So the node that holds the data writes it, and nothing
passes through the driver.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pyarrow.fs as pafs


class StorageError(OSError):
    """A storage location cannot be reached, read or written; the message names it."""


def is_uri(location: str) -> bool:
    """Whether `location` is a URI, read and written through pyarrow's filesystems (a file:// URI
    too, the same way as an object store), rather than a plain local path.

    >>> is_uri("s3://bucket/runs"), is_uri("file:///shared/runs"), is_uri("/shared/runs"), is_uri("runs")
    (True, True, False, False)
    """
    return "://" in location


def local_path(location: str) -> Path:
    """The absolute path of a local `location`, a relative one taken from the working directory.

    >>> local_path("/tmp/../tmp/x")
    PosixPath('/tmp/x')
    """
    return Path(location).expanduser().resolve()


def join(location: str, *parts: str) -> str:
    """`location`/`parts`, for a path or a URI.

    >>> join("s3://bucket/runs/", "grpo", "checkpoints"), join("/shared/runs", "grpo")
    ('s3://bucket/runs/grpo/checkpoints', '/shared/runs/grpo')
    """
    if is_uri(location):
        return "/".join([location.rstrip("/"), *parts])
    return str(Path(location).joinpath(*parts))


def _filesystem(uri: str) -> tuple[pafs.FileSystem, str]:
    try:
        return pafs.FileSystem.from_uri(uri)
    except (ValueError, OSError) as err:  # pyarrow's ArrowInvalid is a ValueError
        raise StorageError(f"storage {uri!r}: pyarrow cannot open it ({err})") from None


@contextlib.contextmanager
def writing(location: str) -> Iterator[Path]:
    """A local directory to write `location`'s files into: the directory itself when local,
    else a temporary one uploaded to the URI on a clean exit."""
    if not is_uri(location):
        path = local_path(location)
        path.mkdir(parents=True, exist_ok=True)
        yield path
        return
    fs, root = _filesystem(location)
    with tempfile.TemporaryDirectory(prefix="raypo-upload-") as tmp:
        yield Path(tmp)
        try:
            fs.create_dir(root, recursive=True)
            pafs.copy_files(tmp, root, destination_filesystem=fs)
        except OSError as err:
            raise StorageError(f"could not upload to {location!r}: {err}") from err


@contextlib.contextmanager
def reading(location: str) -> Iterator[Path]:
    """A local directory holding `location`'s files: itself when local, else a temporary download."""
    if not is_uri(location):
        path = local_path(location)
        if not path.exists():
            raise StorageError(f"{str(path)!r} does not exist on this node")
        yield path
        return
    fs, root = _filesystem(location)
    if fs.get_file_info(root).type != pafs.FileType.Directory:
        raise StorageError(f"{location!r} does not exist")
    with tempfile.TemporaryDirectory(prefix="raypo-download-") as tmp:
        try:
            pafs.copy_files(root, tmp, source_filesystem=fs)
        except OSError as err:
            raise StorageError(f"could not download {location!r}: {err}") from err
        yield Path(tmp)


def read_text(location: str) -> str | None:
    """The text of the file at `location`, or None when there is none."""
    if not is_uri(location):
        path = local_path(location)
        return path.read_text() if path.is_file() else None
    fs, path = _filesystem(location)
    if fs.get_file_info(path).type != pafs.FileType.File:
        return None
    with fs.open_input_stream(path) as f:
        return f.read().decode()


def write_text(location: str, text: str) -> None:
    """Write `text` to the file at `location`, replacing it whole (a local file via rename)."""
    if not is_uri(location):
        path = local_path(location)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        with open(tmp, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        tmp.replace(path)
        _fsync_dir(path.parent)
        return
    fs, path = _filesystem(location)
    fs.create_dir(path.rsplit("/", 1)[0], recursive=True)
    with fs.open_output_stream(path) as f:  # object stores make the object visible only once it is closed
        f.write(text.encode())


def copy_dir(source: str, destination: str) -> None:
    """Replace the directory `destination` with a copy of `source` (both in one storage)."""
    if not is_uri(source):
        dst = local_path(destination)
        tmp = dst.with_name(dst.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.copytree(local_path(source), tmp)
        shutil.rmtree(dst, ignore_errors=True)
        tmp.rename(dst)
        return
    fs, src = _filesystem(source)
    _, dst = _filesystem(destination)
    remove_dir(destination)
    fs.create_dir(dst, recursive=True)
    pafs.copy_files(src, dst, source_filesystem=fs, destination_filesystem=fs)


def upload_files(local_dir: Path, names: list[str], location: str) -> None:
    """Copy the files and directories `names` of `local_dir` (those that exist) to `location`;
    nothing to do when `location` is `local_dir` itself."""
    if not is_uri(location) and local_path(location) == local_dir.resolve():
        return
    with writing(location) as out:
        for name in names:
            src = local_dir / name
            if src.is_dir():
                shutil.copytree(src, out / name, dirs_exist_ok=True)
            elif src.is_file():
                shutil.copy2(src, out / name)


def remove_dir(location: str) -> None:
    """Delete the directory at `location` if it exists."""
    if not is_uri(location):
        shutil.rmtree(local_path(location), ignore_errors=True)
        return
    fs, path = _filesystem(location)
    with contextlib.suppress(FileNotFoundError):
        fs.delete_dir(path)


def local_copy(location: str, cache: Path) -> Path:
    """A local directory holding `location`: the path itself, or for a URI a copy downloaded once
    into `cache` (keyed by the URI; renamed in whole, so a partial download is never used)."""
    if not is_uri(location):
        return local_path(location)
    target = cache / "checkpoints" / hashlib.sha256(location.encode()).hexdigest()[:16]
    if target.is_dir():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f"{target.name}.tmp{os.getpid()}")
    with reading(location) as path:
        shutil.copytree(path, tmp)
    tmp.rename(target)
    return target


MANIFEST = "MANIFEST.json"  # a directory's file sizes and checksums, written last: the directory is whole


def list_files(location: str) -> dict[str, int]:
    """Every file under the directory `location` (recursively) by relative path, with its size."""
    if not is_uri(location):
        root = local_path(location)
        return {str(p.relative_to(root)): p.stat().st_size for p in sorted(root.rglob("*")) if p.is_file()}
    fs, root = _filesystem(location)
    infos = fs.get_file_info(pafs.FileSelector(root, recursive=True, allow_not_found=True))
    return {i.path[len(root) :].lstrip("/"): i.size for i in sorted(infos, key=lambda i: i.path) if i.type == pafs.FileType.File}


def list_dirs(location: str) -> list[str]:
    """The names of the directories directly under `location` (none when it does not exist)."""
    if not is_uri(location):
        root = local_path(location)
        return sorted(p.name for p in root.iterdir() if p.is_dir()) if root.is_dir() else []
    fs, root = _filesystem(location)
    infos = fs.get_file_info(pafs.FileSelector(root, allow_not_found=True))
    return sorted(i.base_name for i in infos if i.type == pafs.FileType.Directory)


def file_sha256(location: str) -> str:
    """The sha256 of the file at `location`, read in blocks; for a local file also fsynced."""
    digest = hashlib.sha256()
    if not is_uri(location):
        with open(local_path(location), "rb") as f:
            while block := f.read(1 << 20):
                digest.update(block)
            os.fsync(f.fileno())  # written by another process: make it durable before the manifest says it is whole
        return digest.hexdigest()
    fs, path = _filesystem(location)
    with fs.open_input_stream(path) as f:
        while block := f.read(1 << 20):
            digest.update(block)
    return digest.hexdigest()


def write_manifest(location: str) -> dict[str, dict]:
    """Checksum every file of the directory `location` and write its MANIFEST.json, last (fsynced
    with the directories, where local). Returns the manifest's files."""
    files = {
        name: {"bytes": size, "sha256": file_sha256(join(location, name))}
        for name, size in list_files(location).items()
        if name != MANIFEST
    }
    if not is_uri(location):
        for directory in {local_path(location) / Path(name).parent for name in files}:
            _fsync_dir(directory)
    write_text(join(location, MANIFEST), json.dumps({"files": files}, indent=1))
    return files


def manifest_problem(location: str) -> str | None:
    """What makes the directory `location` not whole by its MANIFEST.json (no manifest, a file
    missing, of another size or checksum), naming the file; None when every file checks out."""
    text = read_text(join(location, MANIFEST))
    if text is None:
        return f"no {MANIFEST} (its save did not finish)"
    try:
        expected = json.loads(text)["files"]
    except (ValueError, KeyError, TypeError):
        return f"{MANIFEST} is not readable"
    present = list_files(location)
    for name, want in expected.items():
        if name not in present:
            return f"{name} is missing"
        if present[name] != want["bytes"]:
            return f"{name} has {present[name]} bytes, {want['bytes']} when saved (truncated or overwritten)"
        if file_sha256(join(location, name)) != want["sha256"]:
            return f"{name} does not match its checksum (corrupted)"
    return None


STEP_DIR = re.compile(r"^step_(\d+)$")  # a checkpoint's directory: step_000012


def step_of(location: str) -> int:
    """The step of a checkpoint directory.

    >>> step_of("s3://b/runs/g/checkpoints/step_000012")
    12
    """
    return int(STEP_DIR.match(location.rstrip("/").rsplit("/", 1)[-1]).group(1))


def step_dirs(root: str) -> list[str]:
    """The checkpoint directories (step_N) under `root`, newest (highest step) first."""
    return sorted((name for name in list_dirs(root) if STEP_DIR.match(name)), key=step_of, reverse=True)


def newest_whole(root: str, at_most: int | None = None) -> tuple[str | None, list[tuple[str, str]]]:
    """The newest checkpoint under `root` (of step `at_most` or earlier) whose files match its
    manifest (None if none does), and the newer ones skipped, each with why."""
    skipped = []
    for name in step_dirs(root):
        if at_most is not None and step_of(name) > at_most:
            continue
        problem = manifest_problem(join(root, name))
        if problem is None:
            return join(root, name), skipped
        skipped.append((name, problem))
    return None, skipped


def replace_dir(source: str, destination: str) -> None:
    """Make the local directory `source` the directory `destination`: a rename (the old one, if
    any, is moved aside first and deleted after), fsynced; a crash leaves one of the two whole."""
    src, dst = local_path(source), local_path(destination)
    aside = dst.with_name(dst.name + ".replaced")
    shutil.rmtree(aside, ignore_errors=True)
    if dst.exists():
        dst.rename(aside)
    src.rename(dst)
    _fsync_dir(dst.parent)
    shutil.rmtree(aside, ignore_errors=True)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
