"""Shared fixtures. The tiny model is built once per machine (cached under RAYPO_CACHE,
default ~/.cache/raypo) with the default config, exactly as `raypo make-tiny` builds it."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def tiny_model():
    """(directory, manifest) of the default embedded tiny model."""
    from pipelines.config import TinyModelConfig
    from pipelines.tiny import make_tiny

    return make_tiny(TinyModelConfig())
