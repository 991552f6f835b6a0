"""Losses as pure functions: tensors in, `(loss, metrics)` out.

Shapes: B sequences, T response tokens, V vocabulary. `mask` is `[B, T]`, 1 on response
tokens. Every reduction over tokens or sequences goes through `masked_aggregate`, so a loss
computed on shards of a batch (one per learner) sums to the loss of the whole batch when
each shard is given the batch-wide `normalizer` (a learner passes `Normalizers`, and each
reduction takes the count of its own unit: tokens for a token mean, sequences otherwise).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from pipelines.registry import Registry

AGGREGATE_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum")
KL_KINDS = ("k1", "k2", "k3")

PolicyLossFn = Callable[..., tuple[Tensor, dict[str, float]]]
POLICY_LOSSES: Registry[PolicyLossFn] = Registry("policy loss")
register_policy_loss = POLICY_LOSSES.register


@dataclass(frozen=True)
class LossSpec:
    """The loss of one policy update: which policy loss, its clip range at this step, the
    reduction and the KL and entropy terms (built from `algo` config and the step's schedules)."""

    policy_loss: str = "ppo"
    clip_low: float = 0.2
    clip_high: float = 0.2
    aggregate: str = "token-mean"
    kl_coef: float = 0.001
    kl_kind: str = "k2"
    entropy_coef: float = 0.01
    # Off-policy rollout (`algo.off_policy_steps` > 0): decoupled PPO with importance weights
    # truncated at this (`decoupled_targets`); None: the ratio is taken against the behaviour policy.
    behaviour_weight_cap: float | None = None
    poisoned: bool = False  # fault injection (config `chaos.nan_loss_steps`): this update's loss is NaN, as a diverged one's


@dataclass(frozen=True)
class Normalizers:
    """The divisors of one minibatch's means for a learner holding a share of it: the whole
    minibatch's valid tokens and sequences, each divided by the number of learners (DeepSpeed
    averages the gradients over them). `masked_aggregate` takes the one its mode divides by."""

    tokens: float
    sequences: float

    @classmethod
    def of(cls, mask: Tensor, world_size: int = 1) -> Normalizers:
        """From the whole minibatch's `[B, T]` loss mask.

        >>> Normalizers.of(torch.tensor([[1, 1, 0], [1, 0, 0], [0, 0, 0]]), world_size=2)
        Normalizers(tokens=1.5, sequences=1.0)
        """
        tokens_per_seq = mask.sum(dim=-1)  # [B, T] -> [B]
        return cls(float(tokens_per_seq.sum()) / world_size, float((tokens_per_seq > 0).sum()) / world_size)

    def for_mode(self, mode: str) -> float:
        return self.tokens if mode == "token-mean" else self.sequences


def masked_aggregate(values: Tensor, mask: Tensor, mode: str, normalizer: float | Tensor | Normalizers | None = None) -> Tensor:
    """Reduce `values` `[B, T]` over the tokens where `mask` is 1 to a scalar.

    - token-mean: sum over all valid tokens / number of valid tokens
    - seq-mean-token-mean: mean over sequences of each sequence's token mean
    - seq-mean-token-sum: mean over sequences of each sequence's token sum

    `normalizer` is the divisor of the outer mean (valid tokens for token-mean, sequences with
    at least one valid token otherwise). Left as None it is this batch's own count; a learner
    that holds one shard passes the whole batch's count, so the shards' results add up to the
    unsharded result whatever the split. `Normalizers` give the count of this mode's unit.
    """
    if isinstance(normalizer, Normalizers):
        normalizer = normalizer.for_mode(mode)
    mask_f = mask.to(values.dtype)
    values = torch.where(mask.bool(), values, torch.zeros_like(values))  # NaN outside mask is ignored
    if mode == "token-mean":
        total = (values * mask_f).sum()
        count = mask_f.sum() if normalizer is None else normalizer
    elif mode in ("seq-mean-token-mean", "seq-mean-token-sum"):
        tokens = mask_f.sum(dim=-1)  # [B, T] -> [B]
        per_seq = (values * mask_f).sum(dim=-1)  # [B, T] -> [B]
        if mode == "seq-mean-token-mean":
            per_seq = per_seq / tokens.clamp(min=1)
        total = per_seq.sum()
        count = (tokens > 0).to(values.dtype).sum() if normalizer is None else normalizer
    else:
        raise ValueError(f"unknown aggregate mode {mode!r}; known: {AGGREGATE_MODES}")
    count = torch.as_tensor(count, dtype=values.dtype, device=values.device)
    # An empty batch (count 0) divides by 1; any other count is used as it is: a shard's share of
    # the batch-wide normalizer may be under 1 (fewer pairs than learners).
    return total / torch.where(count > 0, count, torch.ones_like(count))


def logprobs_from_logits(logits: Tensor, token_ids: Tensor) -> Tensor:
    """Log-probability of each chosen token: logits `[B, T, V]`, ids `[B, T]` -> `[B, T]`."""
    return token_logprobs(logits, token_ids)[0]


def token_logprobs(logits: Tensor, token_ids: Tensor, with_entropy: bool = False) -> tuple[Tensor, Tensor | None]:
    """The log-probability of each chosen token under the full softmax, `[..., V]` logits and
    `[...]` ids -> `[...]`, and (`with_entropy`) the distribution's entropy `[...]` as a value
    without a gradient (None otherwise).

    The numbers of `log_softmax` then `gather`, to float rounding (tests/test_losses.py), in fewer passes over
    the `[..., V]` logits: the log-sum-exp, one array of probabilities (the only `[..., V]` tensor
    kept for the backward, whose gradient `(onehot - p) * g` is written into it in place) and, for
    the entropy `lse - sum(p * logits)`, one dot product per position. `log_softmax` keeps its own
    `[..., V]` output, and the entropy from it (`entropy_from_logprobs`) three more passes; at
    SmolLM2's vocabulary of 49,152 that was most of a learner's time outside its matmuls. The
    entropy, a difference of two numbers near the largest logit, is exact to a few float32 ulps
    of that logit (1e-5 at logits of 20), not relative to a small entropy: it is a metric only.
    Entropies that come out non-finite (logits of -inf: 0 * inf) are taken again the long way."""
    logits = logits.float()  # a no-op for float32; bf16 logits are upcast once
    logp, entropy = _TokenLogprobs.apply(logits, token_ids, with_entropy)
    if not with_entropy:
        return logp, None
    if not torch.isfinite(entropy).all():
        with torch.no_grad():
            entropy = entropy_from_logprobs(torch.log_softmax(logits, dim=-1))
    return logp, entropy


class _TokenLogprobs(torch.autograd.Function):
    """`token_logprobs`' forward and backward. The backward overwrites the probabilities it saved:
    one backward per graph (a second, with `retain_graph`, fails autograd's version check), and no
    gradient of the gradient (`create_graph` raises: `once_differentiable`)."""

    @staticmethod
    def forward(ctx, logits: Tensor, token_ids: Tensor, with_entropy: bool) -> tuple[Tensor, Tensor]:
        lse = torch.logsumexp(logits, dim=-1, keepdim=True)  # [..., 1]
        logp = logits.gather(-1, token_ids.unsqueeze(-1)).sub_(lse).squeeze(-1)  # [...]
        probs = torch.sub(logits, lse).exp_() if with_entropy or ctx.needs_input_grad[0] else None  # [..., V]
        # H = -sum p (logits - lse) = lse - sum p logits: a dot product per position, no [..., V] product
        entropy = lse.squeeze(-1) - torch.einsum("...v,...v->...", probs, logits) if with_entropy else lse.new_empty(0)
        ctx.mark_non_differentiable(entropy)
        if ctx.needs_input_grad[0]:
            ctx.save_for_backward(probs, token_ids)
        return logp, entropy

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_logp: Tensor, _grad_entropy: Tensor) -> tuple[Tensor, None, None]:
        probs, token_ids = ctx.saved_tensors
        grad = probs.mul_(grad_logp.neg().unsqueeze(-1))  # d logp_i / d logits = onehot_i - p
        grad.scatter_add_(-1, token_ids.unsqueeze(-1), grad_logp.unsqueeze(-1))
        return grad, None, None


def entropy_from_logprobs(logp: Tensor) -> Tensor:
    """Entropy of the categorical distribution at each position from its log-probs (a
    `log_softmax`): `[B, T, V]` -> `[B, T]`, H = -sum p log p.

    Tokens with log-prob -inf (outside a top-k / top-p set) have p = 0 and add 0; their log-prob
    is replaced by 0 in the product so that neither the value nor the gradient meets 0 * inf.
    """
    finite_logp = logp.masked_fill(logp == float("-inf"), 0.0)
    return -(logp.exp() * finite_logp).sum(dim=-1)  # [B, T, V] -> [B, T]


def kl_penalty(logprobs: Tensor, ref_logprobs: Tensor, kind: str = "k2") -> Tensor:
    """Per-token KL estimators on samples of pi (Schulman, "Approximating KL Divergence", 2020),
    shapes kept: k1 = logp - ref, k2 = (logp - ref)^2 / 2, k3 = r - 1 - log r with r = pi_ref / pi.

    As values, k1 and k3 are unbiased estimates of KL(pi || pi_ref) (k3 is also non-negative); k2
    is biased. As loss terms (gradient through logp, samples held fixed) they differ, which is
    what a KL penalty in the loss uses:
    - k1: E[grad logp] = 0, no gradient in expectation (the config refuses it as a penalty);
    - k2: E[(logp - ref) grad logp] = grad KL(pi || pi_ref), the reverse KL the penalty names;
    - k3: E[(1 - r) grad logp] = grad KL(pi_ref || pi), the forward KL (GRPO's choice).
    tests/test_losses.py checks each against autograd on a full distribution.
    """
    log_ratio = logprobs - ref_logprobs
    if kind == "k1":
        return log_ratio
    if kind == "k2":
        return 0.5 * log_ratio.square()
    if kind == "k3":
        return torch.exp(-log_ratio) + log_ratio - 1
    raise ValueError(f"unknown KL estimator {kind!r}; known: {KL_KINDS}")


def ppo_policy_loss(
    logprobs: Tensor,
    behaviour_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    level: str = "token",
    aggregate: str = "token-mean",
    normalizer: float | Tensor | Normalizers | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """Clipped surrogate objective.

    level="token": PPO (Schulman et al. 2017, Eq. 7), per token
    -min(r A, clip(r, 1 - clip_low, 1 + clip_high) A) with r = exp(logp - behaviour),
    reduced by `aggregate`. Asymmetric clip (clip_high > clip_low) is DAPO's clip-higher.
    level="sequence": GSPO (Zheng et al. 2025, Eq. 5-7), s_i = exp(mean over the response of
    logp - behaviour) and the loss is the mean over sequences of -min(s_i A_i, clip(s_i) A_i),
    A_i the sequence's advantage (`[B]`, or `[B, T]` constant over the response). GSPO's objective
    is a mean over sequences whatever `aggregate` says (which reduces token-level losses only), so
    its weight against the entropy and KL terms does not change with response length.

    logprobs, behaviour_logprobs, mask: `[B, T]`; advantages `[B, T]` (or `[B]` for sequence).
    """
    mask_f = mask.to(logprobs.dtype)
    log_ratio = torch.where(mask.bool(), logprobs - behaviour_logprobs, torch.zeros_like(logprobs))
    if level == "token":
        unit_log_ratio, unit_adv, unit_mask, mode = log_ratio, advantages, mask, aggregate
    elif level == "sequence":
        tokens = mask_f.sum(dim=-1)  # [B, T] -> [B]
        seq_log_ratio = (log_ratio * mask_f).sum(dim=-1) / tokens.clamp(min=1)  # [B]
        seq_adv = advantages if advantages.dim() == 1 else masked_row_mean(advantages, mask)
        # Each sequence is one unit: [B] -> [B, 1], reduced as a mean over sequences.
        unit_log_ratio, unit_adv = seq_log_ratio[:, None], seq_adv[:, None]
        # "seq-mean-token-sum" over one-token rows: the sum over sequences / sequences
        unit_mask, mode = (tokens > 0)[:, None], "seq-mean-token-sum"
    else:
        raise ValueError(f"unknown policy loss level {level!r}; known: token, sequence")

    ratio = torch.exp(unit_log_ratio)
    unclipped = -ratio * unit_adv
    clipped = -torch.clamp(ratio, 1 - clip_low, 1 + clip_high) * unit_adv
    per_unit = torch.maximum(unclipped, clipped)
    loss = masked_aggregate(per_unit, unit_mask, mode, normalizer)
    with torch.no_grad():
        metrics = {
            "clip_fraction": masked_aggregate((clipped > unclipped).to(ratio.dtype), unit_mask, "token-mean").item(),
            # k3 estimate of KL(behaviour || current) over the tokens of the batch
            "approx_kl": masked_aggregate(kl_penalty(behaviour_logprobs, logprobs, "k3"), mask, "token-mean").item(),
            "ratio_mean": masked_aggregate(ratio, unit_mask, "token-mean").item(),
        }
    return loss, metrics


def decoupled_targets(
    behaviour_logprobs: Tensor, proximal_logprobs: Tensor, advantages: Tensor, mask: Tensor, cap: float
) -> tuple[Tensor, Tensor, dict[str, float]]:
    """Decoupled PPO (Hilton et al. 2022, "Batch size-invariance for policy optimization", Eq. 2;
    AReaL, Fu et al. 2025, Eq. 5) for samples drawn by a stale behaviour policy: the clipped
    surrogate is taken around the proximal policy (the learner's weights at the start of the
    update), and each token is weighted by w = pi_prox / pi_behav, truncated at `cap` (as veRL's
    truncated importance sampling; AReaL drops the tokens past its cap instead):

        loss = -w * min(r A, clip(r) A),  r = pi / pi_prox,  w = min(exp(prox - behav), cap)

    Since w >= 0 it folds into the advantage: a policy loss given `proximal_logprobs` as its
    base and `w * A` as the advantages computes exactly this. All inputs `[B, T]`; returns
    (the ratio's base, the weighted advantages, metrics: the weights' mean and the share capped).

    >>> base, adv, m = decoupled_targets(torch.tensor([[0.0, -1.0]]), torch.tensor([[0.0, 0.0]]),
    ...                                  torch.tensor([[1.0, 1.0]]), torch.tensor([[1, 1]]), cap=2.0)
    >>> adv.tolist(), m
    ([[1.0, 2.0]], {'behaviour_weight_mean': 1.5, 'behaviour_weight_capped': 0.5})
    """
    log_weight = torch.where(mask.bool(), proximal_logprobs - behaviour_logprobs, torch.zeros_like(proximal_logprobs))
    weight = torch.exp(log_weight).clamp(max=cap).detach()
    with torch.no_grad():
        metrics = {
            "behaviour_weight_mean": masked_aggregate(weight, mask, "token-mean").item(),
            "behaviour_weight_capped": masked_aggregate((log_weight > math.log(cap)).to(weight.dtype), mask, "token-mean").item(),
        }
    return proximal_logprobs.detach(), advantages * weight, metrics


def masked_row_mean(values: Tensor, mask: Tensor) -> Tensor:
    """Mean of each row over its valid tokens: `[B, T]` -> `[B]` (0 for an empty row)."""
    mask_f = mask.to(values.dtype)
    values = torch.where(mask.bool(), values, torch.zeros_like(values))
    return (values * mask_f).sum(dim=-1) / mask_f.sum(dim=-1).clamp(min=1)


@register_policy_loss("ppo")
def _ppo(logprobs, behaviour_logprobs, advantages, mask, **kwargs):
    return ppo_policy_loss(logprobs, behaviour_logprobs, advantages, mask, level="token", **kwargs)


@register_policy_loss("gspo")
def _gspo(logprobs, behaviour_logprobs, advantages, mask, **kwargs):
    return ppo_policy_loss(logprobs, behaviour_logprobs, advantages, mask, level="sequence", **kwargs)


def value_loss(
    values: Tensor,
    old_values: Tensor,
    returns: Tensor,
    mask: Tensor,
    clip: float = 0.5,
    normalizer: float | Tensor | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """Clipped value loss (PPO2 baselines / OpenAI "Implementation Matters", Eq. 4):
    0.5 * max((v - R)^2, (clip(v, v_old - c, v_old + c) - R)^2), token-mean. All `[B, T]`."""
    clipped_values = old_values + torch.clamp(values - old_values, -clip, clip)
    unclipped_err = (values - returns).square()
    clipped_err = (clipped_values - returns).square()
    loss = 0.5 * masked_aggregate(torch.maximum(unclipped_err, clipped_err), mask, "token-mean", normalizer)
    with torch.no_grad():
        metrics = {
            "value_mse": masked_aggregate(unclipped_err, mask, "token-mean").item(),
            "value_clip_fraction": masked_aggregate((clipped_err > unclipped_err).to(values.dtype), mask, "token-mean").item(),
        }
    return loss, metrics


def pair_mean(values: Tensor, normalizer: float | Tensor | None = None) -> Tensor:
    """Mean over preference pairs, `[B]` -> scalar: `masked_aggregate` with each pair one unit
    (`[B]` -> `[B, 1]`), dividing by `normalizer` pairs (None: B)."""
    return masked_aggregate(values[:, None], torch.ones_like(values)[:, None], "token-mean", normalizer)


@dataclass(frozen=True)
class DPOSpec:
    """The loss of one DPO update (from `algo.dpo_*`)."""

    beta: float = 0.1
    kind: str = "sigmoid"
    label_smoothing: float = 0.0
    nll_coef: float = 0.0


def dpo_loss(
    policy_chosen: Tensor,
    policy_rejected: Tensor,
    ref_chosen: Tensor,
    ref_rejected: Tensor,
    beta: float = 0.1,
    kind: str = "sigmoid",
    label_smoothing: float = 0.0,
    normalizer: float | Tensor | None = None,
    nll_coef: float = 0.0,
    chosen_tokens: Tensor | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """Direct Preference Optimization. Inputs are `[B]` summed sequence log-probs.

    With d = (policy_chosen - policy_rejected) - (ref_chosen - ref_rejected):
    - sigmoid (Rafailov et al. 2023, Eq. 7; conservative DPO with label smoothing):
      mean(-(1 - ls) log sigmoid(beta d) - ls log sigmoid(-beta d))
    - ipo (Azar et al. 2023, Eq. 17): mean((d - 1 / (2 beta))^2)
    plus `nll_coef` times the chosen completions' negative log-likelihood per token,
    mean(-policy_chosen / chosen_tokens) (RPO, Pang et al. 2024, Eq. 1; TRL's `rpo_alpha`), which
    keeps DPO from lowering the chosen completions along with the rejected ones.

    The mean, and the metrics' means, divide by `normalizer` pairs (None: this batch's B), so a
    learner holding a shard of the pairs passes the whole batch's count (as `masked_aggregate`).
    """
    delta = (policy_chosen - policy_rejected) - (ref_chosen - ref_rejected)  # [B]
    if kind == "sigmoid":
        per_pair = -(1 - label_smoothing) * F.logsigmoid(beta * delta) - label_smoothing * F.logsigmoid(-beta * delta)
    elif kind == "ipo":
        per_pair = (delta - 1 / (2 * beta)).square()
    else:
        raise ValueError(f"unknown DPO loss kind {kind!r}; known: sigmoid, ipo")

    def mean(values: Tensor) -> Tensor:
        return pair_mean(values, normalizer)

    loss = mean(per_pair)
    nll = -policy_chosen / (chosen_tokens.clamp(min=1) if chosen_tokens is not None else 1.0)  # [B]
    if nll_coef:
        loss = loss + nll_coef * mean(nll)
    with torch.no_grad():
        chosen_reward = beta * (policy_chosen - ref_chosen)  # [B]
        rejected_reward = beta * (policy_rejected - ref_rejected)  # [B]
        metrics = {
            "reward_accuracy": mean((chosen_reward > rejected_reward).to(delta.dtype)).item(),
            "reward_margin": mean(chosen_reward - rejected_reward).item(),
            "chosen_reward": mean(chosen_reward).item(),
            "rejected_reward": mean(rejected_reward).item(),
            "chosen_nll": mean(nll).item(),
        }
    return loss, metrics


def bradley_terry_loss(
    chosen_scores: Tensor, rejected_scores: Tensor, normalizer: float | Tensor | None = None
) -> tuple[Tensor, dict[str, float]]:
    """Reward-model loss on preference pairs (Bradley & Terry 1952; Ouyang et al. 2022, Eq. 1):
    mean(-log sigmoid(r_chosen - r_rejected)). Inputs `[B]` scores; the mean divides by
    `normalizer` pairs (None: B), as `dpo_loss`."""
    margin = chosen_scores - rejected_scores  # [B]

    def mean(values: Tensor) -> Tensor:
        return pair_mean(values, normalizer)

    loss = mean(-F.logsigmoid(margin))
    with torch.no_grad():
        metrics = {"accuracy": mean((margin > 0).to(margin.dtype)).item(), "margin": mean(margin).item()}
    return loss, metrics
