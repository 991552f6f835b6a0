"""Generator: the Ray-free core of a rollout actor, one vLLM engine.

Samples `n` completions per prompt and returns them as a batch of numpy arrays, with the
behaviour log-probs of the sampled tokens under the distribution they were drawn from (after
temperature, top-k and top-p: vLLM's `processed_logprobs`), which the learner computes the same
way (pipelines/algos/sampling.py).
`update_weights` loads a new state dict into the running engine without re-creating it.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from types import SimpleNamespace

import numpy as np

from actors.core.weight_sync import open_group, receive, tensors_from_arrays
from pipelines.algos.sampling import SamplingSpec
from pipelines.models.vllm_engine import greedy, make_llm, sampling_params
from pipelines.models.vllm_reload import load_in_place


class Generator:
    def __init__(
        self,
        model_dir: str,
        dtype: str = "float32",
        seed: int = 0,
        max_model_len: int | None = None,
        gpu_memory_fraction: float = 0.8,
    ):
        from vllm.v1.engine.detokenizer import uses_fast_detokenizer  # heavy: only where an engine is made

        self.model_dir = str(model_dir)
        self.llm = make_llm(
            self.model_dir,
            dtype=dtype,
            seed=seed,
            max_model_len=max_model_len,
            gpu_memory_fraction=gpu_memory_fraction,
            logprobs_mode="processed_logprobs",
        )
        self.tokenizer = self.llm.get_tokenizer()
        # An engine in this process (on CPU) decoding as it samples takes the time from sampling: its
        # samples are decoded after (`response_texts`), unless the tokenizer is a slow one. An engine in
        # a process of its own (on GPU) decodes here, beside its forward passes, as it samples.
        in_process = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0"
        self.decodes_after = in_process and uses_fast_detokenizer(self.tokenizer)
        self.weights_version = 0

    def generate(
        self,
        prompts: Sequence[str],
        n: int = 1,
        sampling: SamplingSpec | None = None,
        max_tokens: int = 16,
        seeds: Sequence[int] | None = None,
    ) -> dict[str, np.ndarray]:
        """`n` samples for each prompt, grouped contiguously (prompt i -> rows i*n .. i*n+n-1),
        drawn as `sampling` says, prompt i seeded with `seeds[i]` (None: unseeded).

        Returns numpy arrays: `prompt_ids` [N, P] (left-padded), `prompt_mask` [N, P],
        `response_ids` [N, T] and `response_mask` [N, T] (right-padded),
        `behaviour_logprobs` [N, T] float32, `prompt_index` [N]; and object arrays
        `prompt_text`, `response_text`, `finished` (stopped by EOS rather than length).
        """
        params = sampling_params(n, sampling or SamplingSpec(), max_tokens, seeds, len(prompts), 0, not self.decodes_after)
        outputs = self.llm.generate(list(prompts), params, use_tqdm=False)
        rows = [(i, out.prompt_token_ids, sample) for i, out in enumerate(outputs) for sample in out.outputs]
        if self.decodes_after:
            texts = response_texts(self.tokenizer, [(prompt_ids, sample) for _, prompt_ids, sample in rows], params[0])
        else:
            texts = [sample.text for _, _, sample in rows]
        P = max(len(p) for _, p, _ in rows)
        T = max(1, max(len(s.token_ids) for _, _, s in rows))
        N = len(rows)
        pad = self.tokenizer.pad_token_id or 0
        batch = {
            "prompt_ids": np.full((N, P), pad, dtype=np.int64),
            "prompt_mask": np.zeros((N, P), dtype=np.int64),
            "response_ids": np.full((N, T), pad, dtype=np.int64),
            "response_mask": np.zeros((N, T), dtype=np.int64),
            "behaviour_logprobs": np.zeros((N, T), dtype=np.float32),
            "prompt_index": np.array([i for i, _, _ in rows], dtype=np.int64),
        }
        for r, (_, prompt_ids, sample) in enumerate(rows):
            batch["prompt_ids"][r, P - len(prompt_ids) :] = prompt_ids
            batch["prompt_mask"][r, P - len(prompt_ids) :] = 1
            ids = list(sample.token_ids)
            batch["response_ids"][r, : len(ids)] = ids
            batch["response_mask"][r, : len(ids)] = 1
            batch["behaviour_logprobs"][r, : len(ids)] = [lp[tok].logprob for lp, tok in zip(sample.logprobs, ids, strict=True)]
        batch["prompt_text"] = np.array([prompts[i] for i, _, _ in rows], dtype=object)
        batch["response_text"] = np.array(texts, dtype=object)
        batch["finished"] = np.array([s.finish_reason == "stop" for _, _, s in rows])
        return batch

    def greedy(self, prompts: Sequence[str], max_tokens: int = 16) -> list[str]:
        return greedy(self.llm, prompts, max_tokens)

    def open_weight_sync(self, host: str, port: int, rank: int, world_size: int, backend: str) -> None:
        """Join the learner's weight-sync group (actors/core/weight_sync.py) inside the engine's
        worker, where the model lives, so received tensors land on its device directly."""

        def join(worker):
            worker.raypo_weight_group = open_group(host, port, rank, world_size, backend)

        self.llm.collective_rpc(join)

    def receive_weights(self, layout, version: int | None = None) -> int:
        """Receive the weights learner rank 0 broadcasts now, and load them in place."""

        def load(worker):
            _reload(worker, list(receive(worker.raypo_weight_group, layout, getattr(worker, "device", "cpu"))))

        self.llm.collective_rpc(load)
        return self._weights_loaded(version)

    def _weights_loaded(self, version: int | None) -> int:
        self.llm.reset_prefix_cache()  # cached KV blocks were computed with the old weights
        self.weights_version = self.weights_version + 1 if version is None else version
        return self.weights_version

    def update_weights(self, state: Mapping[str, np.ndarray], version: int | None = None) -> int:
        """Load `state` (parameter name -> array, Hugging Face names) into the engine in place."""
        tensors = tensors_from_arrays(state)

        self.llm.collective_rpc(lambda worker: _reload(worker, tensors))
        return self._weights_loaded(version)


def _reload(worker, tensors: list) -> None:
    """Load `tensors` into the worker's model in place: on CPU without vLLM's layerwise machinery
    where that applies (pipelines/models/vllm_reload.py), else with vLLM's `reload_weights`."""
    if not load_in_place(worker.model_runner.get_model(), tensors):
        worker.model_runner.reload_weights(weights_iterator=iter(tensors))


def response_texts(tokenizer, samples: Sequence[tuple[Sequence[int], object]], params) -> list[str]:
    """The text of each sampled response `(prompt_ids, vLLM CompletionOutput)` exactly as the
    engine would have decoded it with `params` (a `SamplingParams`, no stop strings): vLLM's own
    `FastIncrementalDetokenizer`, primed with the prompt, fed the response at once (the stop token
    that ended it left out, as the engine does), once per distinct (prompt, response) of a batch.
    An engine in this process decoding every token of every sample as it goes took ~6% of a
    tiny-model generation; a batch's samples repeat (a group shares its prompt, short answers coincide)."""
    from vllm.v1.engine.detokenizer import FastIncrementalDetokenizer  # heavy: only where an engine exists

    texts: dict[tuple[tuple[int, ...], tuple[int, ...], bool], str] = {}
    out = []
    for prompt_ids, sample in samples:
        key = (tuple(prompt_ids), tuple(sample.token_ids), sample.finish_reason == "stop")
        if key not in texts:
            request = SimpleNamespace(request_id="", prompt_token_ids=list(prompt_ids), sampling_params=params)
            detokenizer = FastIncrementalDetokenizer(tokenizer, request)
            detokenizer.update(list(sample.token_ids), stop_terminated=key[2])
            texts[key] = detokenizer.get_next_output_text(finished=True, delta=False)
        out.append(texts[key])
    return out
