"""The policy's engine replica in both serving modes: Ray's LLMServer, its vLLM engine run as
`vllm serve` runs a one-worker engine."""

from __future__ import annotations

from ray.llm._internal.serve.core.server.llm_server import LLMServer
from ray.llm._internal.serve.engines.vllm.vllm_engine import VLLMEngine


class OneProcessVLLMEngine(VLLMEngine):
    """Ray's vLLM engine, run as `vllm serve` runs a one-worker engine: the model in the engine
    core's own process (vLLM's UniProcExecutor). On CPU Ray asks for the multiprocess executor,
    which adds a worker process and an IPC round trip to every engine step; GPU engines (Ray's
    executor, placement groups) are left as Ray makes them."""

    def _prepare_engine_config(self, callback_ctx):
        engine_args, frontend_args, config = super()._prepare_engine_config(callback_ctx)
        parallel = config.parallel_config
        if parallel.world_size == 1 and parallel.distributed_executor_backend == "mp":
            parallel.distributed_executor_backend = "uni"
        return engine_args, frontend_args, config


class OneProcessLLMServer(LLMServer):
    """Ray's LLMServer with `OneProcessVLLMEngine`: each version's replica (serve/app.py), and the
    replica that answers HTTP itself (serve/engine_ingress.py)."""

    _default_engine_cls = OneProcessVLLMEngine
