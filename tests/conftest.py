"""Shared fixtures. The tiny model is built once per test run, exactly as `raypo make-tiny`
builds it, in the run's own fresh cache (a temporary RAYPO_CACHE, unless one is set), so the
suite checks what a new user's first build gives on this machine, not an old cached model."""

from __future__ import annotations

import os
import tempfile

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Subprocesses (raypo train, raypo serve) inherit it, so they use the model built here.
os.environ.setdefault("RAYPO_CACHE", tempfile.mkdtemp(prefix="raypo-test-cache-"))


@pytest.fixture(scope="session")
def tiny_model():
    """(directory, manifest) of the default embedded tiny model."""
    from pipelines.config import TinyModelConfig
    from pipelines.tiny import make_tiny

    return make_tiny(TinyModelConfig())
