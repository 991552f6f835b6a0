"""Creating a vLLM engine the same way everywhere (rollout actors, checks, benchmarks).

On CPU the engine runs in-process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`) with a small KV cache;
on GPU it takes `gpu_memory_fraction` of the device. vLLM is imported only when an engine is
made, so importing this module stays cheap.

`python -m pipelines.models.vllm_engine MODEL_DIR PROMPT...` prints vLLM's greedy continuations as
JSON: a separate process, as vLLM wants to be created under `__main__` or inside an actor.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Sequence

import torch

from pipelines.algos.sampling import SamplingSpec


def _on_gpu() -> bool:
    return torch.cuda.is_available()


def make_llm(
    model_dir: str,
    dtype: str = "float32",
    seed: int = 0,
    max_model_len: int | None = None,
    gpu_memory_fraction: float = 0.8,
    kv_cache_gib: int = 1,
    **engine_kwargs,
):
    """A `vllm.LLM` for `model_dir`, configured for this machine (CPU or GPU)."""
    on_gpu = _on_gpu()
    if not on_gpu:
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(kv_cache_gib))
    from vllm import LLM  # heavy: imported only when an engine is made, after the env above is set

    if not on_gpu:
        _rank_eagerly()
    # On CPU a seeded request whose prompt is split across scheduler steps (chunked prefill) fails
    # ("CPU Generator does not use offset": vLLM rewinds the request's torch generator, which CPU
    # generators cannot do); without chunking each prompt is prefilled whole.
    kwargs = {"gpu_memory_utilization": gpu_memory_fraction} if on_gpu else {"enable_chunked_prefill": False}
    return LLM(
        model=str(model_dir),
        dtype=dtype,
        seed=seed,
        max_model_len=max_model_len,
        enforce_eager=not on_gpu,
        **kwargs,
        **engine_kwargs,
    )


def count_at_least(x: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """How many entries of each row of `x` [N, V] are at least that row's `values` [N, 1]: the rank
    vLLM's sampler gives each sampled token (1 = the most likely one).

    >>> count_at_least(torch.tensor([[-0.1, -2.0, -0.5], [-3.0, -1.0, -1.0]]), torch.tensor([[-0.5], [-1.0]])).tolist()
    [2, 2]
    """
    return (x >= values).sum(-1)


def _rank_eagerly() -> None:
    """Make the in-process engine's sampler rank sampled tokens with `count_at_least` instead of
    vLLM's `torch.compile`d copy of the same count (vllm/v1/sample/ops/logprobs.py). On CPU that
    compile (inductor, C++ codegen) ran at an engine's first request for log-probs, the rollout's
    every request: ~2.9 s of the first step's generation on the tiny model, again after every
    engine restart; and it fails under `ATEN_CPU_CAPABILITY=default` (`'at::vec' has not been
    declared`). Eagerly the count is one comparison of the `[N, V]` log-probs the sampler already
    holds. GPU engines, in processes of their own, keep vLLM's kernel; a vLLM other than the pinned
    one without that name keeps its own sampler (slower to start, not wrong)."""
    from vllm.v1.sample import sampler

    if hasattr(sampler, "batched_count_greater_than"):
        sampler.batched_count_greater_than = count_at_least


def greedy(llm, prompts: Sequence[str], max_tokens: int) -> list[str]:
    """Greedy continuations of `prompts`, special tokens dropped."""
    from vllm import SamplingParams  # heavy: only where an engine exists

    outputs = llm.generate(list(prompts), SamplingParams(temperature=0.0, max_tokens=max_tokens), use_tqdm=False)
    return [out.outputs[0].text for out in outputs]


def sampling_params(
    n: int,
    sampling: SamplingSpec,
    max_tokens: int,
    seeds: Sequence[int] | None,
    prompts: int,
    logprobs: int | None = None,
    detokenize: bool = True,
) -> list:
    """One `SamplingParams` per prompt, each with its own seed (`seeds[i]`, e.g. from
    `pipelines.algos.sampling.prompt_seeds`): vLLM seeds sample j of a request `seed + j`, so a
    seed shared by every prompt would give sample j of each the same random numbers.
    `detokenize=False`: the outputs carry token ids only (the caller decodes them)."""
    from vllm import SamplingParams  # heavy: only where an engine exists

    if seeds is not None and len(seeds) != prompts:
        raise ValueError(f"{len(seeds)} sampling seeds for {prompts} prompts: give one per prompt")
    return [
        SamplingParams(
            n=n,
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            top_k=sampling.top_k,
            max_tokens=max_tokens,
            logprobs=logprobs,
            seed=None if seeds is None else int(seeds[i]),
            detokenize=detokenize,
        )
        for i in range(prompts)
    ]


def sample(llm, prompts: Sequence[str], n: int, temperature: float, max_tokens: int, seeds: Sequence[int]) -> list[list[str]]:
    """`n` sampled continuations of each prompt (pure temperature sampling), one seed per prompt."""
    params = sampling_params(n, SamplingSpec(temperature=temperature), max_tokens, seeds, len(prompts))
    return [[s.text for s in out.outputs] for out in llm.generate(list(prompts), params, use_tqdm=False)]


def main(argv: list[str]) -> int:
    if len(argv) < 2:
        usage = "usage: python -m pipelines.models.vllm_engine MODEL_DIR PROMPT... (max tokens from RAYPO_MAX_TOKENS)"
        print(usage, file=sys.stderr)
        return 2
    llm = make_llm(argv[0])
    texts = greedy(llm, argv[1:], int(os.environ.get("RAYPO_MAX_TOKENS", "8")))
    print("RAYPO_JSON " + json.dumps(texts))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
