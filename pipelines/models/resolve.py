"""Which model directory a run uses: the configured one, or the embedded tiny model."""

from __future__ import annotations

from pathlib import Path

from pipelines.config import RaypoConfig
from pipelines.models.tiny import make_tiny


def resolve_model_path(cfg: RaypoConfig) -> Path:
    """The configured model directory, or the embedded tiny model (built on first use)."""
    if cfg.model.path:
        path = Path(cfg.model.path).expanduser()
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"model.path {str(path)!r} is not a Hugging Face model directory (no config.json)")
        return path
    return make_tiny(cfg.model.tiny)[0]
