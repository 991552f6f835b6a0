"""The vLLM engine of a serving replica: Ray's `VLLMEngine`, with the model run inside vLLM's
engine-core process when it needs one device.

On CPU, Ray's LLM configs force vLLM's multiprocessing executor, which puts the model in a
worker process of its own beside the engine core: every scheduler step then crosses a
shared-memory queue whose waiters poll, and on a small machine they take a core from the model.
`vllm serve` runs a one-device model in the engine core (its uniprocess executor); so does this
engine. Ray loads it from `RAYLLM_VLLM_ENGINE_CLS` in the replica's environment (serve/app.py).
"""

from __future__ import annotations

from ray.llm._internal.serve.engines.vllm.vllm_engine import VLLMEngine


class InProcessVLLMEngine(VLLMEngine):
    def _start_async_llm_engine(self, vllm_engine_args, vllm_engine_config, placement_group):
        parallel = vllm_engine_config.parallel_config
        if parallel.world_size == 1 and parallel.distributed_executor_backend == "mp":
            parallel.distributed_executor_backend = "uni"
        return super()._start_async_llm_engine(vllm_engine_args, vllm_engine_config, placement_group)
