"""RolloutActor: one vLLM engine that samples completions for the prompts of a step."""

from __future__ import annotations

import time
from collections.abc import Sequence

import numpy as np
import ray

from actors.common import Restartable, limit_threads
from actors.core.generator import Generator
from pipelines.algos.sampling import SamplingSpec


@ray.remote
class RolloutActor(Restartable):
    def __init__(self, model_dir: str, threads: int = 2, **engine):
        """`engine`: the `Generator`'s options (dtype, seed, max_model_len, gpu_memory_fraction)."""
        limit_threads(threads)
        self.generator = Generator(model_dir, **engine)

    def generate(
        self, prompts: Sequence[str], n: int, sampling: SamplingSpec, max_tokens: int, seeds: Sequence[int] | None = None
    ) -> dict[str, np.ndarray]:
        """`n` samples per prompt, prompt i seeded with `seeds[i]`: token ids, text and behaviour
        log-probs (see `Generator.generate`)."""
        return self.generator.generate(prompts, n=n, sampling=sampling, max_tokens=max_tokens, seeds=seeds)

    @ray.method(num_returns=2)
    def sample(
        self, prompts: Sequence[str], n: int, sampling: SamplingSpec, max_tokens: int, seeds: Sequence[int] | None = None
    ) -> tuple[dict[str, np.ndarray], dict]:
        """`generate`'s batch, and what the driver reads without fetching the batch: the
        `weights_version` the samples were drawn with and the `seconds` the engine took."""
        started = time.monotonic()
        batch = self.generate(prompts, n, sampling, max_tokens, seeds)
        return batch, {"weights_version": self.generator.weights_version, "seconds": time.monotonic() - started}

    def greedy(self, prompts: Sequence[str], max_tokens: int) -> list[str]:
        return self.generator.greedy(prompts, max_tokens)

    def update_weights(self, state: dict[str, np.ndarray], version: int) -> int:
        """Load new weights in place (object store on CPU); returns the weights version now served."""
        return self.generator.update_weights(state, version)

    def open_weight_sync(self, host: str, port: int, rank: int, world_size: int, backend: str) -> None:
        """Join the learner's weight-sync group as `rank` (see actors/core/weight_sync.py)."""
        self.generator.open_weight_sync(host, port, rank, world_size, backend)

    def receive_weights(self, layout, version: int) -> int:
        """Receive the weights learner rank 0 broadcasts now (NCCL on GPUs, gloo on CPU)."""
        return self.generator.receive_weights(layout, version)

    def weights_version(self) -> int:
        return self.generator.weights_version
