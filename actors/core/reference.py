"""ReferenceScorer: log-probs of responses under the frozen initial policy (the reference model
of the KL term), no optimizer. The Ray-free core of the reference actor.

It runs in the learner's dtype (bfloat16 under a bf16 learner), so at step 0 the policy's and
the reference's log-probs agree to rounding and DPO's margin and the KL start at zero. Its
log-probs are of the full softmax at the sampling temperature, not truncated by top-k/top-p: a
truncated reference could give a sampled token probability 0 (an infinite KL)."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch
from transformers import AutoModelForCausalLM

from actors.core.modeling import COMPLETIONS, completion_logprobs, response_logprobs, sequence_tensors
from actors.core.onednn import use_onednn


class ReferenceScorer:
    def __init__(self, model_dir: str, temperature: float = 1.0, batch_rows: int = 256, dtype: str = "float32"):
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).eval()
        use_onednn(self.model)  # float32 on CPU: matmuls at this CPU's speed (actors/core/onednn.py)
        self.temperature = temperature
        self.batch_rows = batch_rows

    @torch.no_grad()
    def logprobs(self, batch: Mapping[str, np.ndarray]) -> np.ndarray:
        """`[N, T]` log-probs of the response tokens, 0 on padding."""
        n = len(batch["response_ids"])
        out = []
        for start in range(0, n, self.batch_rows):
            inputs = sequence_tensors(batch, np.arange(start, min(n, start + self.batch_rows)))
            out.append(response_logprobs(self.model, inputs, self.temperature) * inputs["response_mask"])
        return torch.cat(out).numpy().astype(np.float32)

    @torch.no_grad()
    def pair_logprobs(self, pairs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """`reference_chosen` and `reference_rejected`: `[N]` summed log-probs of each pair's
        completions (DPO's reference terms, computed once per pair)."""
        n = len(pairs["prompt_ids"])
        chunks = [np.arange(start, min(n, start + self.batch_rows)) for start in range(0, n, self.batch_rows)]
        return {
            f"reference_{side}": torch.cat([completion_logprobs(self.model, pairs, rows, side) for rows in chunks]).numpy()
            for side in COMPLETIONS
        }
