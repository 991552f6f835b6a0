"""The LM head and the log-probs of the tokens it predicts, in one pass over the vocabulary, a
chunk of it at a time.

A learner reads one number per response position of the `[R, V]` logits: the log-prob of the token
sampled there (and the distribution's entropy: a metric, or with an entropy bonus a loss term). Made whole, the logits and their
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
    hidden: Tensor,
    head: nn.Linear,
    token_ids: Tensor,
    with_entropy: bool = False,
    entropy_grad: bool = False,
    chunk: int = CHUNK,
) -> tuple[Tensor, Tensor | None]:
    """The log-prob of each token `[R]` under the full softmax of `head(hidden)`, for `hidden`
    `[R, d]` (already divided by any sampling temperature) and `token_ids` `[R]`, with gradients
    for `hidden` and the head's weight; and (`with_entropy`) each softmax's entropy `[R]`, with a
    gradient too where `entropy_grad` (a loss term), else a value (None without `with_entropy`).
    `head` must pass `fuses`."""
    if not fuses(head):
        raise ValueError(f"the fused LM head takes a float32 nn.Linear without bias, not {head!r}")
    if not len(token_ids):  # nothing to score (oneDNN's product takes no empty input): [0] each
        return hidden.sum(dim=1) * 0, hidden.sum(dim=1) * 0 if with_entropy else None
    low, high, vocabulary = int(token_ids.min()), int(token_ids.max()), head.weight.shape[0]
    if low < 0 or high >= vocabulary:
        raise ValueError(f"token ids {low}..{high} outside the head's vocabulary of {vocabulary}")
    product = matmul_t if isinstance(head, OneDnnLinear) and hidden.device.type == "cpu" else _mm_t
    # A Function's forward cannot tell grad mode: without a graph it keeps nothing for a backward
    keep = torch.is_grad_enabled() and (hidden.requires_grad or head.weight.requires_grad)
    entropy_grad = with_entropy and entropy_grad and keep
    logp, entropy = _HeadLogprobs.apply(hidden, head.weight, token_ids, with_entropy, entropy_grad, keep, product, chunk)
    return logp, entropy if with_entropy else None


def _mm_t(x: Tensor, w: Tensor) -> Tensor:
    return x @ w.t()


class _HeadLogprobs(torch.autograd.Function):
    """`token_logprobs`' forward and backward. Each chunk's `exp(logits - its max)` is kept for the
    backward, which scales it into the softmax and the gradient in one pass, in place (three with
    the entropy's gradient): one backward per graph (`once_differentiable`; a second raises)."""

    @staticmethod
    def forward(
        ctx,
        hidden: Tensor,
        weight: Tensor,
        token_ids: Tensor,
        with_entropy: bool,
        entropy_grad: bool,
        keep: bool,
        product: Product,
        chunk: int,
    ):
        kept, tops, log_totals, dots = [], [], [], []
        chosen = hidden.new_empty(len(token_ids))  # [R]: the chosen token's logit, read off its chunk
        rows = torch.arange(len(token_ids), device=hidden.device)
        for start in range(0, weight.shape[0], chunk):
            logits = product(hidden, weight[start : start + chunk])  # [R, c]
            inside = (token_ids >= start) & (token_ids < start + logits.shape[1])
            chosen[inside] = logits[rows[inside], token_ids[inside] - start]
            top = logits.amax(dim=1)  # [R]
            shifted = logits.sub_(top[:, None])  # z - the chunk's max, <= 0
            # exp(z - the chunk's max): kept for the backward, where a scale per row makes it the softmax
            scaled = torch.exp(shifted) if with_entropy else shifted.exp_()
            total = scaled.sum(dim=1)  # [R]
            if with_entropy:  # the chunk's softmax-weighted mean of z - max_c (no cancellation against a large max)
                dots.append(torch.einsum("rv,rv->r", scaled, shifted) / total)
            tops.append(top)
            log_totals.append(total.log())
            if keep:
                kept.append(scaled)
        # all relative to the row's max T: lse = T + L, each chunk's log-sum-exp lse_c = T + relative_c
        tops_ = torch.stack(tops, dim=1)  # [R, chunks]
        top = tops_.amax(dim=1)  # [R]
        below = tops_ - top[:, None]  # max_c - T, <= 0
        relative = below + torch.stack(log_totals, dim=1)  # lse_c - T
        L = torch.logsumexp(relative, dim=1)  # lse - T, >= 0
        lse = top + L
        log_shares = below - L[:, None]  # max_c - lse: softmax = exp(z - max_c) * exp(max_c - lse)
        entropy = hidden.new_empty(0)
        if with_entropy:
            # H = lse - sum_v p_v z_v = sum_c w_c (lse - max_c - mean_c(z - max_c)), w_c = exp(lse_c - lse) the
            # chunk's share, lse - max_c = L - below_c: each term small, where lse - sum p z cancels two large numbers
            shares = torch.exp(relative - L[:, None])
            entropy = (shares * (L[:, None] - below - torch.stack(dots, dim=1))).sum(dim=1)
        if not entropy_grad:
            ctx.mark_non_differentiable(entropy)
        ctx.set_materialize_grads(False)  # a gradient not asked for comes as None: no pass for it
        ctx.save_for_backward(hidden, weight, token_ids, log_shares, entropy)
        ctx.kept, ctx.product, ctx.chunk = kept, product, chunk
        return chosen - lse, entropy

    @staticmethod
    @once_differentiable
    def backward(ctx, grad: Tensor | None, grad_entropy: Tensor | None):
        hidden, weight, token_ids, log_shares, entropy = ctx.saved_tensors
        if ctx.kept is None:
            raise RuntimeError("the fused LM head's backward ran twice: its saved softmax was overwritten by the first")
        wants_hidden, wants_weight = ctx.needs_input_grad[:2]
        # the onehot part of d hidden first (it starts the sum); of d weight last (it adds into rows)
        if wants_hidden:
            d_hidden = grad[:, None] * weight[token_ids] if grad is not None else torch.zeros_like(hidden)  # [R, d]
        else:
            d_hidden = None
        d_weight = torch.empty_like(weight) if wants_weight else None  # [V, d]
        # d logp / d z = onehot(token) - p; d H / d z = -p (log p + H). With p = e s (e = exp(z - max_c)
        # kept, s = exp(max_c - lse) per row and chunk), d z = -p (g + h (log s + H)) - h s e log e
        # + g onehot: `scale` e + `entropy_scale` xlogy(e, e), and the onehot part.
        g = grad if grad is not None else hidden.new_zeros(len(token_ids))
        shares, rate = log_shares.exp(), g[:, None]  # [R, chunks], [R, 1]
        if grad_entropy is not None:
            h = grad_entropy[:, None]
            rate = rate + h * (log_shares + entropy[:, None])
        scale, entropy_scale = -rate * shares, None if grad_entropy is None else -h * shares  # [R, chunks]
        hidden_t = hidden.t()
        # torch's BLAS reads d_logits transposed where it lies and adds or writes each product into
        # place; oneDNN takes its operands laid out as its kernel reads them (a copy of d_logits^T)
        in_place = ctx.product is _mm_t
        for i, kept in enumerate(ctx.kept):
            start, end = i * ctx.chunk, i * ctx.chunk + kept.shape[1]
            plogp = torch.xlogy(kept, kept) if entropy_scale is not None else None  # 0 where e underflowed to 0
            d_logits = kept.mul_(scale[:, i : i + 1])  # [R, c], in place
            if plogp is not None:
                d_logits.addcmul_(plogp, entropy_scale[:, i : i + 1])
            if wants_hidden and in_place:
                d_hidden.addmm_(d_logits, weight[start:end])  # [R, c] x [c, d]
            elif wants_hidden:
                d_hidden += ctx.product(d_logits, weight[start:end].t())
            if wants_weight and in_place:
                torch.mm(d_logits.t(), hidden, out=d_weight[start:end])  # [c, R] x [R, d]
            elif wants_weight:
                d_weight[start:end] = ctx.product(d_logits.t().contiguous(), hidden_t)
        ctx.kept = None
        if grad is not None and wants_weight:
            d_weight.index_add_(0, token_ids, grad[:, None] * hidden)
        return d_hidden, d_weight, None, None, None, None, None, None
