"""The sampling contract between the rollout engines and the learners.

The policy that PPO/GRPO/GSPO optimise is the distribution the rollout actually samples from:
softmax(logits / temperature) truncated to the top-k tokens, then to the top-p nucleus, and
renormalised (vLLM's order and rule, `vllm/v1/sample/ops/topk_topp_sampler.py`). The engines
record the log-probs of that truncated distribution (`processed_logprobs`); the learners compute
the same one here, so on fresh samples the ratio pi / pi_old is 1 token by token. Computed with the
full softmax instead, the ratio would be the nucleus mass Z <= 1, and every token with a negative
advantage would sit in the clipped branch whenever Z < 1 - eps.

The truncation set is a step function of the logits: no gradient flows through which tokens are
kept, only through the renormalised probabilities of the kept ones. The sampled token is always
kept, so a token the engine sampled never gets log-prob -inf here (float rounding between
engine and learner, or a later minibatch's moved weights, can push it just outside).

Per-prompt seeds: vLLM seeds sample j of a request `seed + j`, so one seed for every prompt of a
call would give sample j of each prompt the same random numbers; `prompt_seeds` gives each prompt
of each step its own.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from pipelines.algos.losses import entropy_from_logprobs, logprobs_from_logits, token_logprobs


@dataclass(frozen=True)
class SamplingSpec:
    """How the rollout samples: temperature, then top-k (0 = off), then top-p (1 = off)."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0

    @property
    def truncates(self) -> bool:
        return self.top_p < 1.0 or self.top_k > 0


def removed_tokens(
    logits: Tensor, spec: SamplingSpec, keep_ids: Tensor | None = None, chunk_elements: int = 1 << 24
) -> Tensor | None:
    """Where the sampler drops a token: `[..., V]` bool, True outside the top-k / top-p set of
    `logits` (already divided by the temperature); None when `spec` truncates nothing.

    vLLM's rule (its PyTorch path, the one CPU engines run): top-k keeps every token whose logit is
    at least the k-th largest; top-p then sorts the remaining probabilities ascending and drops
    each token whose cumulative mass, with all the smaller ones, is at most 1 - p in float32 (the
    largest is always kept). `keep_ids` `[...]` are kept too. Positions are cut into chunks of
    about `chunk_elements` logits, so the sort's copies stay small next to the logits.

    >>> logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    >>> removed_tokens(logits, SamplingSpec(top_p=0.75)).tolist()
    [False, False, True, True]
    >>> removed_tokens(logits, SamplingSpec(top_k=3, top_p=0.9), keep_ids=torch.tensor(3)).tolist()
    [False, False, False, False]
    """
    if not spec.truncates:
        return None
    vocab = logits.shape[-1]
    flat = logits.detach().reshape(-1, vocab)  # [..., V] -> [P, V]
    rows = max(1, chunk_elements // vocab)
    removed = torch.cat([_removed_rows(flat[i : i + rows], spec) for i in range(0, len(flat), rows)])
    removed = removed.reshape(logits.shape)
    if keep_ids is not None:
        removed.scatter_(-1, keep_ids.unsqueeze(-1), False)
    return removed


@torch.no_grad()
def _removed_rows(logits: Tensor, spec: SamplingSpec) -> Tensor:
    """`removed_tokens` for `[P, V]` logits."""
    logits = logits.float()
    removed = torch.zeros_like(logits, dtype=torch.bool)
    if 0 < spec.top_k < logits.shape[-1]:
        kth = logits.topk(spec.top_k, dim=-1).values[..., -1:]  # [P, 1]
        removed |= logits < kth
    if spec.top_p < 1.0:
        ascending, order = logits.masked_fill(removed, float("-inf")).sort(dim=-1)  # [P, V] each
        mass_below = ascending.softmax(dim=-1).cumsum(dim=-1)
        drop_sorted = mass_below <= 1 - torch.tensor(spec.top_p, dtype=torch.float32)  # vLLM's float32 threshold
        drop_sorted[..., -1] = False  # at least one token
        removed |= torch.zeros_like(removed).scatter(-1, order, drop_sorted)
    return removed


def sampled_log_softmax(logits: Tensor, spec: SamplingSpec, token_ids: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
    """Log-probs `[..., V]` of the sampling distribution for `logits` `[..., V]` (divided by the
    temperature already), -inf outside its top-k / top-p set (`token_ids` `[...]` always in it),
    and that removed-token mask (None without truncation)."""
    removed = removed_tokens(logits, spec, token_ids)
    logits = logits.float()
    if removed is not None:
        logits = logits.masked_fill(removed, float("-inf"))
    return torch.log_softmax(logits, dim=-1), removed


def needs_logits(spec: SamplingSpec, entropy_grad: bool) -> bool:
    """Whether `token_logprobs_and_entropy` needs the whole `[..., V]` logits' log-softmax: a
    truncated sampling distribution, or an entropy with a gradient (a loss term). Otherwise the
    log-probs are the full softmax's and the entropy only a value (`token_logprobs`, one pass).

    >>> needs_logits(SamplingSpec(), entropy_grad=False), needs_logits(SamplingSpec(top_k=5), entropy_grad=False)
    (False, True)
    """
    return spec.truncates or (entropy_grad and torch.is_grad_enabled())


def token_logprobs_and_entropy(
    logits: Tensor, token_ids: Tensor, spec: SamplingSpec, entropy_grad: bool = True
) -> tuple[Tensor, Tensor, Tensor]:
    """For `logits` `[B, T, V]` (temperature applied) and the sampled `token_ids` `[B, T]`, each
    `[B, T]`: the sampled token's log-prob under the sampling distribution (truncated as `spec`
    says: the policy's ratio), its log-prob under the full softmax (what a reference model, which
    is not truncated, is compared with in a KL term), and the sampling distribution's entropy.
    With `entropy_grad=False` the entropy is only a metric: computed without a graph, so its
    `[B, T, V]` intermediates are freed at once instead of kept for a backward that adds 0.

    >>> logits = torch.log(torch.tensor([[[0.5, 0.3, 0.15, 0.05]]]))
    >>> logp, full, entropy = token_logprobs_and_entropy(logits, torch.tensor([[1]]), SamplingSpec(top_p=0.75))
    >>> round(logp.exp().item(), 4), round(full.exp().item(), 4), round(entropy.item(), 4)  # 0.3 / 0.8 over {0, 1}
    (0.375, 0.3, 0.6616)
    """
    if not needs_logits(spec, entropy_grad):
        # untruncated, the sampling distribution is the full softmax
        token_logp, entropy = token_logprobs(logits, token_ids, with_entropy=True)
        return token_logp, token_logp, entropy
    logp, removed = sampled_log_softmax(logits, spec, token_ids)  # [B, T, V]
    token_logp = logp.gather(-1, token_ids.unsqueeze(-1)).squeeze(-1)  # [B, T, 1] -> [B, T]
    full_logp = token_logp if removed is None else logprobs_from_logits(logits, token_ids)  # [B, T]
    with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
        entropy = entropy_from_logprobs(logp)
    return token_logp, full_logp, entropy


ROLLOUT, EVALUATION = 0, 1  # the two uses of sampling seeds, each its own family of streams


def prompt_seeds(run_seed: int, step: int, prompts: int, purpose: int = ROLLOUT) -> list[int]:
    """One sampling seed per prompt of a step, derived from (run seed, purpose, step, prompt
    index) with `np.random.SeedSequence`: reproducible, and no two prompts or steps share a random stream
    (vLLM gives sample j of a prompt `seed + j`; 62-bit seeds make those ranges collide with
    probability ~ samples / 2**62).

    >>> a = prompt_seeds(0, 1, 3)
    >>> a == prompt_seeds(0, 1, 3), len(set(a + prompt_seeds(0, 2, 3) + prompt_seeds(1, 1, 3)))
    (True, 9)
    """
    entropy = [run_seed % 2**64, purpose, step]  # SeedSequence takes non-negative integers
    children = np.random.SeedSequence(entropy).spawn(prompts)
    return [int(child.generate_state(1, dtype=np.uint64)[0] >> np.uint64(2)) for child in children]
