"""The fused LM head (actors/core/lm_head.py) against the whole head's logits, `log_softmax` and
`gather` in float64 autograd: the same log-probs, entropies and gradients (of the log-probs, of
the entropies, of both), whatever the chunk size, for oneDNN's product and torch's."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from actors.core import lm_head, onednn

V, D, R = 50, 12, 9


def _head(kind: str) -> nn.Linear:
    torch.manual_seed(0)
    head = nn.Linear(D, V, bias=False)
    with torch.no_grad():
        head.weight.mul_(4.0)  # logits spread over several units, so the softmax is far from uniform
    if kind == "oneDNN":
        if not onednn.available():
            pytest.skip("this torch has no oneDNN linear op (or RAYPO_ONEDNN=0)")
        head.__class__ = onednn.OneDnnLinear
    return head


def _reference(
    hidden: torch.Tensor, weight: torch.Tensor, ids: torch.Tensor, grad: torch.Tensor, grad_entropy: torch.Tensor | None = None
) -> tuple[torch.Tensor, ...]:
    """In float64 from the whole logits: the log-probs of `ids`, the entropies, and the gradients
    of `sum(grad * logp) + sum(grad_entropy * entropy)` for the hidden states and the weight."""
    hidden, weight = (t.detach().double().requires_grad_() for t in (hidden, weight))
    logp = torch.log_softmax(hidden @ weight.t(), dim=-1)  # [R, V]
    chosen = logp.gather(-1, ids[:, None])[:, 0]  # [R]
    entropy = -(logp.exp() * logp).sum(-1)  # [R]
    loss = (chosen * grad.double()).sum()
    if grad_entropy is not None:
        loss = loss + (entropy * grad_entropy.double()).sum()
    return chosen.detach(), entropy.detach(), *torch.autograd.grad(loss, (hidden, weight))


@pytest.mark.parametrize("kind", ["torch", "oneDNN"])
@pytest.mark.parametrize("chunk", [7, 16, 50, 64])  # uneven, even, one chunk, larger than the vocabulary
def test_log_probs_entropies_and_gradients_equal_the_whole_logits(kind, chunk):
    head = _head(kind)
    gen = torch.Generator().manual_seed(1)
    hidden = torch.randn(R, D, generator=gen, requires_grad=True)
    ids = torch.tensor([3, 3, 0, 49, 17, 3, 48, 1, 17])  # repeated tokens, the vocabulary's first and last
    grad = torch.randn(R, generator=gen)
    logp, entropy = lm_head.token_logprobs(hidden, head, ids, with_entropy=True, chunk=chunk)
    want_logp, want_entropy, *want = _reference(hidden, head.weight, ids, grad)
    torch.testing.assert_close(logp.double(), want_logp, rtol=0, atol=2e-6)
    # the entropy is lse - sum p z, a difference of numbers near the largest logit (~12 here): a few of its float32 ulps
    torch.testing.assert_close(entropy.double(), want_entropy, rtol=0, atol=1e-5)
    assert not entropy.requires_grad
    got = torch.autograd.grad((logp * grad).sum(), (hidden, head.weight))
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g.double(), w, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kind", ["torch", "oneDNN"])
@pytest.mark.parametrize("chunk", [7, 16, 50, 64])
@pytest.mark.parametrize("terms", ["both", "entropy alone"])
def test_the_entropys_gradient_equals_the_whole_logits(kind, chunk, terms):
    """An entropy bonus: `entropy_grad` gives the entropies a gradient, `-p (log p + H)` through
    the logits, added to the log-probs' (or alone, where the loss reads only the entropies)."""
    head = _head(kind)
    gen = torch.Generator().manual_seed(7)
    hidden = torch.randn(R, D, generator=gen, requires_grad=True)
    ids = torch.tensor([3, 3, 0, 49, 17, 3, 48, 1, 17])
    grad, grad_entropy = torch.randn(R, generator=gen), torch.randn(R, generator=gen)
    grad = grad if terms == "both" else torch.zeros(R)
    logp, entropy = lm_head.token_logprobs(hidden, head, ids, with_entropy=True, entropy_grad=True, chunk=chunk)
    want_logp, want_entropy, *want = _reference(hidden, head.weight, ids, grad, grad_entropy)
    torch.testing.assert_close(logp.double(), want_logp, rtol=0, atol=2e-6)
    torch.testing.assert_close(entropy.double(), want_entropy, rtol=0, atol=1e-5)
    assert entropy.requires_grad
    loss = (entropy * grad_entropy).sum() + ((logp * grad).sum() if terms == "both" else 0)
    got = torch.autograd.grad(loss, (hidden, head.weight))
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g.double(), w, rtol=1e-5, atol=2e-6)


def test_the_entropys_gradient_where_probabilities_underflow():
    """Logits ~200 apart: most of each row's `exp(z - max)` underflows to 0 in float32, where
    `p log p` must count 0 (not 0 * -inf): the gradients stay finite and equal float64's. The
    entropies too, near 0 here: taken as lse - sum p z they would cancel two numbers near the
    largest logit (~300) and be off by ~1e-3 (which, through their gradient, was 0.3% of d hidden)."""
    head = _head("torch")
    with torch.no_grad():
        head.weight.mul_(25.0)
    hidden = torch.randn(R, D, generator=torch.Generator().manual_seed(8), requires_grad=True)
    ids, grad, grad_entropy = torch.arange(R), torch.ones(R), torch.full((R,), 0.5)
    logp, entropy = lm_head.token_logprobs(hidden, head, ids, with_entropy=True, entropy_grad=True, chunk=16)
    assert (torch.exp(hidden @ head.weight.t() - (hidden @ head.weight.t()).amax(1, keepdim=True)) == 0).any()
    got = torch.autograd.grad((logp * grad + entropy * grad_entropy).sum(), (hidden, head.weight))
    _, want_entropy, *want = _reference(hidden, head.weight, ids, grad, grad_entropy)
    torch.testing.assert_close(entropy.double(), want_entropy, rtol=1e-3, atol=1e-6)
    for g, w in zip(got, want, strict=True):
        assert torch.isfinite(g).all()
        torch.testing.assert_close(g.double(), w, rtol=1e-4, atol=1e-4 * w.abs().max().item())


@pytest.mark.parametrize("kind", ["torch", "oneDNN"])
def test_one_gradient_alone_and_no_graph(kind):
    """Only the weight's gradient (a frozen input), only the input's (a frozen head), and no graph
    at all (a reference model's log-probs): the same values and gradients, and no entropy unasked."""
    head = _head(kind)
    hidden = torch.randn(R, D, generator=torch.Generator().manual_seed(2))
    ids, grad = torch.arange(R) * 5, torch.ones(R)
    want_logp, _, want_hidden, want_weight = _reference(hidden, head.weight, ids, grad)
    logp, entropy = lm_head.token_logprobs(hidden, head, ids, chunk=16)
    assert entropy is None
    (d_weight,) = torch.autograd.grad(logp.sum(), head.weight)
    torch.testing.assert_close(d_weight.double(), want_weight, rtol=1e-5, atol=1e-6)
    head.weight.requires_grad_(False)
    hidden.requires_grad_(True)
    logp, _ = lm_head.token_logprobs(hidden, head, ids, chunk=16)
    (d_hidden,) = torch.autograd.grad(logp.sum(), hidden)
    torch.testing.assert_close(d_hidden.double(), want_hidden, rtol=1e-5, atol=1e-6)
    with torch.no_grad():
        logp, _ = lm_head.token_logprobs(hidden, head, ids, chunk=16)
    torch.testing.assert_close(logp.double(), want_logp, rtol=0, atol=2e-6)


def test_a_second_backward_and_an_unfit_head_are_refused():
    """The backward overwrites the logits it kept, so a second one (`retain_graph`) raises instead
    of returning wrong gradients; a head with a bias or in bf16 is not fused."""
    head = _head("torch")
    hidden = torch.randn(R, D, requires_grad=True)
    logp, _ = lm_head.token_logprobs(hidden, head, torch.zeros(R, dtype=torch.long))
    logp.sum().backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="backward ran twice"):
        logp.sum().backward()
    assert lm_head.fuses(head)
    assert not lm_head.fuses(nn.Linear(D, V)) and not lm_head.fuses(nn.Linear(D, V, bias=False).bfloat16())
    with pytest.raises(ValueError, match="float32 nn.Linear without bias"):
        lm_head.token_logprobs(hidden, nn.Linear(D, V), torch.zeros(R, dtype=torch.long))


def test_without_a_graph_no_chunk_is_kept_and_bad_ids_or_no_rows_are_answered(monkeypatch):
    """Under `no_grad` (a reference model's or the proximal log-probs, whose weights still require
    gradients) each chunk's logits are freed before the next product, where a graph keeps them
    all for its backward; ids outside the vocabulary raise instead of reading memory nobody wrote;
    no rows give empty results."""
    import weakref

    head = _head("torch")
    made: list[weakref.ref] = []
    alive_at_each_product: list[int] = []

    def product(x, w):
        alive_at_each_product.append(sum(ref() is not None for ref in made))
        out = x @ w.t()
        made.append(weakref.ref(out))
        return out

    monkeypatch.setattr(lm_head, "_mm_t", product)
    hidden, ids = torch.randn(R, D), torch.arange(R)
    with torch.no_grad():
        lm_head.token_logprobs(hidden, head, ids, chunk=7)  # no entropy: what is kept is the product itself
    assert len(alive_at_each_product) == 8 and max(alive_at_each_product) <= 1  # 50 / 7: 8 chunks
    made.clear(), alive_at_each_product.clear()
    logp, _ = lm_head.token_logprobs(hidden, head, ids, chunk=7)
    assert alive_at_each_product == list(range(8))  # kept for the backward
    del logp
    for bad in (torch.tensor([0, V]), torch.tensor([-1, 3])):
        with pytest.raises(ValueError, match="outside the head's vocabulary of 50"):
            lm_head.token_logprobs(hidden[:2], head, bad)
    logp, entropy = lm_head.token_logprobs(hidden[:0].requires_grad_(), head, ids[:0], with_entropy=True)
    assert logp.shape == entropy.shape == (0,)
