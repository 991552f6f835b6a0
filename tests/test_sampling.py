"""The sampling contract (pipelines/algos/sampling.py) checked against references computed another
way: a per-row loop over the sorted probabilities, vLLM's own top-k/top-p function, autograd
without the truncation; and per-prompt seeds."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pipelines.algos.sampling import (
    EVALUATION,
    SamplingSpec,
    prompt_seeds,
    removed_tokens,
    sampled_log_softmax,
    token_logprobs_and_entropy,
)


def _kept_by_hand(logits: list[float], top_k: int, top_p: float) -> set[int]:
    """The sampler's set for one row, written out: the k largest (ties with the k-th kept), then
    from the most likely down, tokens until the kept mass reaches p, plus any token whose mass
    with all smaller ones exceeds 1 - p."""
    order = sorted(range(len(logits)), key=lambda i: logits[i])  # ascending
    kept = set(order)
    if 0 < top_k < len(logits):
        kth = sorted(logits, reverse=True)[top_k - 1]
        kept = {i for i in kept if logits[i] >= kth}
    if top_p < 1.0:
        z = np.exp(np.array(logits) - max(logits))
        probs = {i: z[i] / sum(z[j] for j in kept) for i in kept}
        below, dropped = 0.0, set()
        for i in [i for i in order if i in kept][:-1]:  # the largest always stays
            below += probs[i]
            if below <= 1 - top_p:
                dropped.add(i)
        kept -= dropped
    return kept


@settings(max_examples=60, deadline=None, derandomize=True)
@given(
    st.lists(st.floats(-6, 6, allow_nan=False, width=32), min_size=2, max_size=12, unique=True),
    st.integers(0, 12),
    st.sampled_from([1.0, 0.95, 0.9, 0.7, 0.5, 0.1]),
)
def test_truncation_keeps_what_the_sampler_keeps(logits, top_k, top_p):
    spec = SamplingSpec(top_k=top_k, top_p=top_p)
    removed = removed_tokens(torch.tensor(logits), spec)
    kept = set(range(len(logits))) if removed is None else set(np.flatnonzero(~removed.numpy()).tolist())
    assert kept == _kept_by_hand(logits, top_k, top_p)


@pytest.mark.parametrize(("top_k", "top_p"), [(0, 0.9), (20, 1.0), (20, 0.9), (5, 0.5), (1, 1.0), (0, 0.3)])
def test_log_softmax_equals_vllms_processed_logprobs(top_k, top_p):
    """The learner's distribution is the one vLLM samples from and reports (`processed_logprobs`):
    its top-k/top-p function applied to the same logits, then log_softmax."""
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p_pytorch

    logits = torch.randn(64, 100, generator=torch.Generator().manual_seed(top_k)) * 3
    k = torch.full((64,), top_k if top_k else 100)
    p = torch.full((64,), top_p)
    expected = apply_top_k_top_p_pytorch(logits.clone(), k, p, allow_cpu_sync=True).log_softmax(dim=-1)
    ours, _ = sampled_log_softmax(logits, SamplingSpec(top_k=top_k, top_p=top_p))
    torch.testing.assert_close(ours, expected, rtol=0, atol=1e-6)


def test_the_mask_is_the_same_computed_in_chunks():
    """The learner cuts positions into chunks (memory); the mask does not depend on the cut."""
    logits = torch.randn(3, 5, 50, generator=torch.Generator().manual_seed(1)) * 2
    spec = SamplingSpec(top_k=10, top_p=0.8)
    whole = removed_tokens(logits, spec)
    assert torch.equal(removed_tokens(logits, spec, chunk_elements=120), whole)  # 2 positions per chunk
    assert torch.equal(removed_tokens(logits, spec, chunk_elements=1), whole)


def test_the_sampled_token_is_always_kept():
    """A token just outside the learner's nucleus (rounding, or weights moved by an earlier
    minibatch) keeps a finite log-prob: its renormalised probability over nucleus + itself."""
    logits = torch.log(torch.tensor([[[0.5, 0.3, 0.15, 0.05]]]))
    spec = SamplingSpec(top_p=0.75)
    logp, full, _ = token_logprobs_and_entropy(logits, torch.tensor([[3]]), spec)
    assert logp.item() == pytest.approx(np.log(0.05 / 0.85), abs=1e-6)
    assert full.item() == pytest.approx(np.log(0.05), abs=1e-6)


def test_truncated_entropy_and_its_gradient_are_those_of_the_renormalised_distribution():
    """Entropy over the kept set, with a finite gradient (no 0 * inf) equal to autograd's on the
    kept logits alone; the dropped logits get no gradient."""
    raw = torch.tensor([[[2.0, 1.0, 0.0, -1.0, -3.0]]], requires_grad=True)
    spec = SamplingSpec(top_k=3)
    logp, _, entropy = token_logprobs_and_entropy(raw, torch.tensor([[0]]), spec)
    (entropy.sum() + logp.sum()).backward()

    kept = raw.detach()[..., :3].clone().requires_grad_(True)
    p = kept.softmax(-1)
    reference = -(p * p.log()).sum() + kept.log_softmax(-1)[..., 0].sum()
    reference.backward()
    assert entropy.item() == pytest.approx(-(p * p.log()).sum().item(), abs=1e-6)
    torch.testing.assert_close(raw.grad[..., :3], kept.grad)
    assert torch.equal(raw.grad[..., 3:], torch.zeros(1, 1, 2))


def test_no_truncation_is_the_plain_softmax():
    logits = torch.randn(3, 4, 7)
    ids = torch.randint(0, 7, (3, 4))
    logp, full_logp, entropy = token_logprobs_and_entropy(logits, ids, SamplingSpec())
    full = logits.log_softmax(-1)
    torch.testing.assert_close(logp, full.gather(-1, ids[..., None])[..., 0])
    assert full_logp is logp
    torch.testing.assert_close(entropy, -(full.exp() * full).sum(-1))


def test_prompt_seeds_are_reproducible_and_never_shared():
    """Distinct per prompt, step, run seed and purpose; vLLM's child seeds seed + j of different
    prompts do not overlap either."""
    seeds = [prompt_seeds(run, step, 64, purpose) for run in (0, 1) for step in (0, 1, 2) for purpose in (0, EVALUATION)]
    flat = [s for group in seeds for s in group]
    assert len(set(flat)) == len(flat) and prompt_seeds(0, 1, 64) == seeds[2]
    children = {s + j for s in flat for j in range(16)}
    assert len(children) == 16 * len(flat)
    assert all(0 <= s < 2**62 for s in flat)
    assert prompt_seeds(-3, 0, 2) != prompt_seeds(3, 0, 2)  # negative run seeds work too
