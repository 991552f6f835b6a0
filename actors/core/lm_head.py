"""The LM head and the log-probs of the tokens it predicts, in one pass over the vocabulary, a
chunk of it at a time.

A learner reads one number per response position of the `[R, V]` logits: the log-prob of the token
sampled there (and, as a metric, the distribution's entropy). Made whole, the logits and their
gradient are tensors far larger than the cache (SmolLM2: `V` = 49,152, 112 MB for a 32-sample
minibatch's ~580 response positions), and the weight gradient's product takes that gradient
transposed, one more copy as large (actors/core/onednn.py). Here the head's product runs over
`CHUNK` vocabulary rows at a time, and each chunk's log-sum-exp (and entropy term) is taken while
its logits are still in cache; the backward turns each chunk into its gradient in place
(`-g * softmax`, one pass) and multiplies it at once, so only a chunk is ever transposed.
In-process, on 2 threads: SmolLM2's head with its log-probs and their backward over 570 rows
takes ~290-300 ms, the products ~210 ms of it (the whole head and `token_logprobs`: ~405-470
ms), and a 32-row SmolLM2 update (4 prompts x 8 responses) got 1.079-1.088x faster (two runs
of 10-12 paired updates against the whole logits, this checkout, native kernels). The tiny model's update did not move
(0.992, noise): its vocabulary is one chunk.

The results are those of `log_softmax` then `gather` over the whole head's logits, to float
rounding (tests/test_lm_head.py); the chosen token's logit is read off its chunk's product.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn
from torch.autograd.function import once_differentiable

from actors.core.onednn import OneDnnLinear, matmul_t

CHUNK = 2048  # vocabulary rows per product: 1,024-3,072 timed alike on SmolLM2 (4,096 and up slower)

Product = Callable[[Tensor, Tensor], Tensor]  # (x [m, k], w [n, k]) -> x w^T [m, n]


def fuses(head: nn.Module) -> bool:
    """Whether `head` is a plain float32 linear map without bias (what `token_logprobs` computes)."""
    return isinstance(head, nn.Linear) and head.bias is None and head.weight.dtype == torch.float32


def token_logprobs(
    hidden: Tensor, head: nn.Linear, token_ids: Tensor, with_entropy: bool = False, chunk: int = CHUNK
) -> tuple[Tensor, Tensor | None]:
    """The log-prob of each token `[R]` under the full softmax of `head(hidden)`, for `hidden`
    `[R, d]` (already divided by any sampling temperature) and `token_ids` `[R]`, with gradients
    for `hidden` and the head's weight; and (`with_entropy`) each softmax's entropy `[R]`, a value
    without a gradient (None otherwise). `head` must pass `fuses`."""
    if not fuses(head):
        raise ValueError(f"the fused LM head takes a float32 nn.Linear without bias, not {head!r}")
    if not len(token_ids):  # nothing to score (oneDNN's product takes no empty input): [0] each
        return hidden.sum(dim=1) * 0, hidden.new_zeros(0) if with_entropy else None
    low, high, vocabulary = int(token_ids.min()), int(token_ids.max()), head.weight.shape[0]
    if low < 0 or high >= vocabulary:
        raise ValueError(f"token ids {low}..{high} outside the head's vocabulary of {vocabulary}")
    product = matmul_t if isinstance(head, OneDnnLinear) and hidden.device.type == "cpu" else _mm_t
    # A Function's forward cannot tell grad mode: without a graph it keeps nothing for a backward
    keep = torch.is_grad_enabled() and (hidden.requires_grad or head.weight.requires_grad)
    logp, entropy = _HeadLogprobs.apply(hidden, head.weight, token_ids, with_entropy, keep, product, chunk)
    return logp, entropy if with_entropy else None


def _mm_t(x: Tensor, w: Tensor) -> Tensor:
    return x @ w.t()


class _HeadLogprobs(torch.autograd.Function):
    """`token_logprobs`' forward and backward. Each chunk's `exp(logits - its max)` is kept for the
    backward, which scales it into the softmax and the gradient in one pass, in place: one
    backward per graph (`once_differentiable`; a second raises)."""

    @staticmethod
    def forward(
        ctx, hidden: Tensor, weight: Tensor, token_ids: Tensor, with_entropy: bool, keep: bool, product: Product, chunk: int
    ):
        kept, tops, lses, dots = [], [], [], []
        chosen = hidden.new_empty(len(token_ids))  # [R]: the chosen token's logit, read off its chunk
        rows = torch.arange(len(token_ids), device=hidden.device)
        for start in range(0, weight.shape[0], chunk):
            logits = product(hidden, weight[start : start + chunk])  # [R, c]
            inside = (token_ids >= start) & (token_ids < start + logits.shape[1])
            chosen[inside] = logits[rows[inside], token_ids[inside] - start]
            top = logits.amax(dim=1)  # [R]
            # exp(z - the chunk's max): kept for the backward, where a scale per row makes it the softmax
            scaled = torch.sub(logits, top[:, None]) if with_entropy else logits.sub_(top[:, None])
            total = scaled.exp_().sum(dim=1)  # [R]
            if with_entropy:  # sum over the chunk of softmax_c * logits, combined across chunks below
                dots.append(torch.einsum("rv,rv->r", scaled, logits) / total)
            tops.append(top)
            lses.append(top + total.log())
            if keep:
                kept.append(scaled)
        per_chunk = torch.stack(lses, dim=1)  # [R, chunks]
        lse = torch.logsumexp(per_chunk, dim=1)  # [R]
        entropy = hidden.new_empty(0)
        if with_entropy:  # H = lse - sum_v p_v z_v, each chunk's sum weighted by its share exp(lse_c - lse)
            entropy = lse - (torch.exp(per_chunk - lse[:, None]) * torch.stack(dots, dim=1)).sum(dim=1)
        ctx.mark_non_differentiable(entropy)
        # softmax = exp(z - max_c) * exp(max_c - lse), the second factor one number per row and chunk
        ctx.save_for_backward(hidden, weight, token_ids, torch.exp(torch.stack(tops, dim=1) - lse[:, None]))
        ctx.kept, ctx.product, ctx.chunk = kept, product, chunk
        return chosen - lse, entropy

    @staticmethod
    @once_differentiable
    def backward(ctx, grad: Tensor, _grad_entropy: Tensor):
        hidden, weight, token_ids, shares = ctx.saved_tensors
        if ctx.kept is None:
            raise RuntimeError("the fused LM head's backward ran twice: its saved softmax was overwritten by the first")
        wants_hidden, wants_weight = ctx.needs_input_grad[:2]
        # d logp / d z = onehot(token) - softmax: the onehot part first, the softmax's chunk by chunk
        d_hidden = grad[:, None] * weight[token_ids] if wants_hidden else None  # [R, d]
        d_weight = torch.empty_like(weight) if wants_weight else None  # [V, d]
        hidden_t, scale = hidden.t(), -grad[:, None] * shares  # [R, chunks]
        for i, scaled in enumerate(ctx.kept):
            start, end = i * ctx.chunk, i * ctx.chunk + scaled.shape[1]
            d_logits = scaled.mul_(scale[:, i : i + 1])  # [R, c], in place: -g * softmax
            if wants_hidden:
                d_hidden += ctx.product(d_logits, weight[start:end].t())  # [R, c] x [c, d]
            if wants_weight:
                d_weight[start:end] = ctx.product(d_logits.t().contiguous(), hidden_t)  # [c, R] x [R, d]
        ctx.kept = None
        if wants_weight:
            d_weight.index_add_(0, token_ids, grad[:, None] * hidden)
        return d_hidden, d_weight, None, None, None, None, None
