import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from pipelines.algos.losses import (
    POLICY_LOSSES,
    bradley_terry_loss,
    decoupled_targets,
    dpo_loss,
    entropy_from_logprobs,
    kl_penalty,
    logprobs_from_logits,
    masked_aggregate,
    ppo_policy_loss,
    token_logprobs,
    value_loss,
)

MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum")


def test_masked_aggregate_hand_computed():
    values = torch.tensor([[1.0, 2.0, 3.0], [4.0, 100.0, float("nan")]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    assert masked_aggregate(values, mask, "token-mean").item() == pytest.approx((1 + 2 + 3 + 4) / 4)
    assert masked_aggregate(values, mask, "seq-mean-token-mean").item() == pytest.approx((2 + 4) / 2)
    assert masked_aggregate(values, mask, "seq-mean-token-sum").item() == pytest.approx((6 + 4) / 2)
    with pytest.raises(ValueError, match="unknown aggregate mode 'mean'"):
        masked_aggregate(values, mask, "mean")


def test_masked_aggregate_of_an_empty_mask_is_zero_not_nan():
    for mode in MODES:
        assert masked_aggregate(torch.ones(2, 3), torch.zeros(2, 3), mode).item() == 0.0


def _normalizer(mask, mode):
    return mask.sum() if mode == "token-mean" else (mask.sum(-1) > 0).sum()


@settings(max_examples=60, deadline=None)
@given(
    lengths=st.lists(st.integers(0, 7), min_size=2, max_size=9),
    cut_points=st.lists(st.integers(1, 8), max_size=3),
    mode=st.sampled_from(MODES),
    seed=st.integers(0, 1000),
)
def test_masked_aggregate_does_not_depend_on_sharding(lengths, cut_points, mode, seed):
    """Shards (one per learner) given the whole batch's normalizer add up to the unsharded result."""
    T = 7
    values = torch.randn(len(lengths), T, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    mask = torch.tensor([[1] * n + [0] * (T - n) for n in lengths])
    whole = masked_aggregate(values, mask, mode)
    cuts = sorted({c for c in cut_points if c < len(lengths)})
    bounds = [0, *cuts, len(lengths)]
    norm = _normalizer(mask, mode)
    summed = sum(
        masked_aggregate(values[a:b], mask[a:b], mode, normalizer=norm) for a, b in zip(bounds[:-1], bounds[1:], strict=True)
    )
    torch.testing.assert_close(summed, whole)


def test_kl_estimators_hand_computed():
    logp = torch.tensor([-1.0, -2.0])
    ref = torch.tensor([-1.5, -1.0])
    d = logp - ref  # [0.5, -1.0]
    torch.testing.assert_close(kl_penalty(logp, ref, "k1"), d)
    torch.testing.assert_close(kl_penalty(logp, ref, "k2"), 0.5 * d**2)
    torch.testing.assert_close(kl_penalty(logp, ref, "k3"), torch.exp(-d) + d - 1)
    with pytest.raises(ValueError, match="unknown KL estimator 'k4'"):
        kl_penalty(logp, ref, "k4")


@settings(max_examples=100, deadline=None)
@given(st.lists(st.floats(-5, 5), min_size=1, max_size=8), st.lists(st.floats(-5, 5), min_size=1, max_size=8))
def test_k2_k3_are_non_negative_and_zero_at_equality(a, b):
    n = min(len(a), len(b))
    logp, ref = torch.tensor(a[:n]), torch.tensor(b[:n])
    for kind in ("k2", "k3"):
        assert (kl_penalty(logp, ref, kind) >= -1e-6).all()
        assert kl_penalty(logp, logp, kind).abs().max() < 1e-6


def test_k_estimators_average_to_the_true_kl():
    """Monte-Carlo check: sampled from p, E[k1] = E[k3] = KL(p || q) for categoricals."""
    p = torch.tensor([0.6, 0.3, 0.1])
    q = torch.tensor([0.3, 0.3, 0.4])
    true_kl = (p * (p / q).log()).sum()
    samples = torch.multinomial(p, 200_000, replacement=True, generator=torch.Generator().manual_seed(0))
    logp, logq = p.log()[samples], q.log()[samples]
    for kind in ("k1", "k3"):
        assert kl_penalty(logp, logq, kind).mean().item() == pytest.approx(true_kl.item(), abs=0.01)


def test_ppo_token_loss_hand_computed():
    logp = torch.tensor([[math.log(1.5), math.log(0.5), math.log(1.1)]])
    behaviour = torch.zeros(1, 3)
    adv = torch.tensor([[1.0, 1.0, -2.0]])
    mask = torch.ones(1, 3)
    loss, metrics = ppo_policy_loss(logp, behaviour, adv, mask, clip_low=0.2, clip_high=0.2)
    # token 0: ratio 1.5 clipped to 1.2 (A>0) -> -1.2; token 1: ratio 0.5 (A>0, min keeps 0.5) -> -0.5;
    # token 2: ratio 1.1 within the clip -> +2.2
    assert loss.item() == pytest.approx((-1.2 - 0.5 + 2.2) / 3, rel=1e-5)
    assert metrics["clip_fraction"] == pytest.approx(1 / 3)
    assert metrics["approx_kl"] > 0
    # asymmetric clip: a high clip of 0.6 lets ratio 1.5 through
    loss_high, _ = ppo_policy_loss(logp, behaviour, adv, mask, clip_low=0.2, clip_high=0.6)
    assert loss_high.item() == pytest.approx((-1.5 - 0.5 + 2.2) / 3, rel=1e-5)


def test_ppo_gradient_matches_the_analytic_one():
    torch.manual_seed(0)
    logp = (torch.randn(3, 4) * 0.05).requires_grad_()
    behaviour = torch.zeros(3, 4)
    adv = torch.randn(3, 4)
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [1, 0, 0, 0]])
    loss, _ = ppo_policy_loss(logp, behaviour, adv, mask, clip_low=0.5, clip_high=0.5)  # nothing clipped
    loss.backward()
    # d/dlogp of -ratio * A / N = -ratio * A / N on valid tokens, 0 elsewhere
    expected = -torch.exp(logp.detach()) * adv * mask / mask.sum()
    torch.testing.assert_close(logp.grad, expected)


def test_clipped_tokens_get_no_gradient():
    logp = torch.tensor([[math.log(2.0)]], requires_grad=True)
    loss, _ = ppo_policy_loss(logp, torch.zeros(1, 1), torch.ones(1, 1), torch.ones(1, 1))
    loss.backward()
    assert logp.grad.item() == 0.0


def test_gspo_sequence_ratio_hand_computed():
    logp = torch.tensor([[0.1, 0.3, 9.0], [0.0, 0.0, 0.0]])
    behaviour = torch.zeros(2, 3)
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    adv = torch.tensor([1.0, -1.0])
    loss, metrics = ppo_policy_loss(logp, behaviour, adv, mask, level="sequence")
    s0 = math.exp((0.1 + 0.3) / 2)  # 1.2214, clipped to 1.2 for A > 0
    expected = (-min(s0 * 1.0, 1.2 * 1.0) + 1.0) / 2
    assert loss.item() == pytest.approx(expected, rel=1e-5)
    assert metrics["clip_fraction"] == pytest.approx(0.5)
    # [B, T] advantages constant over the response give the same loss
    loss_bt, _ = ppo_policy_loss(logp, behaviour, adv[:, None] * mask, mask, level="sequence")
    torch.testing.assert_close(loss_bt, loss)


def test_gspo_and_ppo_registry_entries_share_one_signature():
    logp, behaviour = torch.zeros(2, 3), torch.zeros(2, 3)
    adv, mask = torch.ones(2, 3), torch.ones(2, 3)
    for name in ("ppo", "gspo"):
        loss, metrics = POLICY_LOSSES.get(name)(logp, behaviour, adv, mask, clip_low=0.2, clip_high=0.2)
        assert loss.item() == pytest.approx(-1.0)
        assert {"clip_fraction", "approx_kl"} <= metrics.keys()
    with pytest.raises(ValueError, match="unknown policy loss level"):
        ppo_policy_loss(logp, behaviour, adv, mask, level="group")


def test_value_loss_hand_computed():
    values = torch.tensor([[1.0, 0.0]])
    old = torch.tensor([[0.0, 0.0]])
    returns = torch.tensor([[0.0, 2.0]])
    mask = torch.ones(1, 2)
    loss, metrics = value_loss(values, old, returns, mask, clip=0.5)
    # token 0: unclipped (1-0)^2=1, clipped (0.5-0)^2=0.25 -> 1; token 1: both (0-2)^2=4 -> 4
    assert loss.item() == pytest.approx(0.5 * (1 + 4) / 2)
    assert metrics["value_mse"] == pytest.approx((1 + 4) / 2)


def test_value_loss_clips_the_update_away_from_old_values():
    values = torch.tensor([[3.0]], requires_grad=True)
    loss, metrics = value_loss(values, torch.tensor([[0.0]]), torch.tensor([[5.0]]), torch.ones(1, 1), clip=0.5)
    loss.backward()
    # clipped value 0.5 is further from the return (error 4.5^2) than 3.0 is, so the max
    # picks the clipped term, whose gradient with respect to v is 0
    assert loss.item() == pytest.approx(0.5 * 4.5**2)
    assert values.grad.item() == 0.0
    assert metrics["value_clip_fraction"] == 1.0


def test_dpo_sigmoid_and_ipo_hand_computed():
    pc, pr = torch.tensor([-1.0, -2.0]), torch.tensor([-3.0, -1.0])
    rc, rr = torch.tensor([-1.5, -2.0]), torch.tensor([-2.5, -2.0])
    beta = 0.5
    delta = (pc - pr) - (rc - rr)  # [2 - 1, -1 - 0] = [1, -1]
    loss, metrics = dpo_loss(pc, pr, rc, rr, beta=beta)
    torch.testing.assert_close(loss, -F.logsigmoid(beta * delta).mean())
    assert metrics["reward_accuracy"] == 0.5
    assert metrics["reward_margin"] == pytest.approx((beta * delta).mean().item())
    smoothed, _ = dpo_loss(pc, pr, rc, rr, beta=beta, label_smoothing=0.1)
    torch.testing.assert_close(smoothed, (-0.9 * F.logsigmoid(beta * delta) - 0.1 * F.logsigmoid(-beta * delta)).mean())
    ipo, _ = dpo_loss(pc, pr, rc, rr, beta=beta, kind="ipo")
    torch.testing.assert_close(ipo, ((delta - 1 / (2 * beta)) ** 2).mean())
    with pytest.raises(ValueError, match="unknown DPO loss kind"):
        dpo_loss(pc, pr, rc, rr, kind="hinge2")


def test_dpo_gradient_raises_chosen_and_lowers_rejected():
    pc = torch.tensor([-2.0], requires_grad=True)
    pr = torch.tensor([-2.0], requires_grad=True)
    loss, _ = dpo_loss(pc, pr, torch.tensor([-2.0]), torch.tensor([-2.0]), beta=0.1)
    loss.backward()
    # at delta = 0: d/dpc = -beta * sigmoid(0) = -0.05
    assert pc.grad.item() == pytest.approx(-0.05)
    assert pr.grad.item() == pytest.approx(0.05)


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 1000), scale=st.floats(0.1, 50))
def test_entropy_matches_torch_distributions(seed, scale):
    logits = torch.randn(2, 3, 7, generator=torch.Generator().manual_seed(seed)) * scale
    expected = torch.distributions.Categorical(logits=logits).entropy()
    torch.testing.assert_close(entropy_from_logprobs(logits.log_softmax(-1)), expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(2, 3, 7), (4, 11), (1, 1, 2)])
def test_token_logprobs_match_log_softmax_in_float64_values_entropy_and_gradients(shape, dtype):
    """`token_logprobs` (its own backward) against autograd through float64 `log_softmax`, with
    Categorical's entropy: wide logits (scale 8), any leading shape, float32 and bf16 inputs
    (upcast), a gradient of its own for each token's log-prob."""
    gen = torch.Generator().manual_seed(sum(shape))
    logits = (torch.randn(*shape, generator=gen) * 8).to(dtype)
    ids = torch.randint(0, shape[-1], shape[:-1], generator=gen)
    upstream = torch.randn(shape[:-1], generator=gen, dtype=torch.float64)
    reference = logits.double().requires_grad_()
    expected = torch.log_softmax(reference, -1).gather(-1, ids[..., None])[..., 0]
    (expected * upstream).sum().backward()
    mine = logits.detach().requires_grad_()
    logp, entropy = token_logprobs(mine, ids, with_entropy=True)
    (logp * upstream.float()).sum().backward()
    assert logp.dtype == torch.float32 and not entropy.requires_grad
    torch.testing.assert_close(logp.double(), expected.detach(), rtol=1e-5, atol=1e-5)
    # lse - sum(p * logits) cancels: its absolute error is a few float32 ulps of the largest logit (~20 here)
    expected_entropy = torch.distributions.Categorical(logits=reference.detach()).entropy()
    torch.testing.assert_close(entropy.double(), expected_entropy, rtol=0, atol=1e-4)
    torch.testing.assert_close(mine.grad.double(), reference.grad, rtol=1e-4, atol=1e-4 if dtype == torch.float32 else 1e-2)
    # without a graph and without the entropy: the same log-probs, and None for the entropy
    with torch.no_grad():
        plain, none = token_logprobs(logits, ids)
    assert none is None
    torch.testing.assert_close(plain, logp.detach(), rtol=0, atol=0)


def test_token_logprobs_entropy_with_minus_infinity_logits_and_one_backward_only():
    """Logits of -inf (a masked token) give p = 0 and add 0 to the entropy, which the dot product
    would make NaN (0 * -inf): such positions are taken again through `entropy_from_logprobs`.
    The backward writes into the probabilities it saved, so a second backward of the same graph
    fails loudly instead of computing from overwritten numbers, and so does a double backward."""
    logits = torch.tensor([[0.0, 1.0, float("-inf")], [2.0, 0.5, -1.0]], requires_grad=True)
    logp, entropy = token_logprobs(logits, torch.tensor([1, 0]), with_entropy=True)
    expected = torch.distributions.Categorical(logits=logits.detach()).entropy()
    torch.testing.assert_close(entropy, expected)
    logp.sum().backward(retain_graph=True)
    torch.testing.assert_close(logits.grad[0], torch.tensor([-0.2689, 0.2689, 0.0]), atol=1e-4, rtol=0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        logp.sum().backward()
    # nor a gradient of the gradient, which the in-place backward does not build
    fresh = logits.detach().requires_grad_()
    (grad,) = torch.autograd.grad(token_logprobs(fresh, torch.tensor([1, 0]))[0].square().sum(), fresh, create_graph=True)
    with pytest.raises(RuntimeError, match="once_differentiable"):
        grad.sum().backward()


def test_logprobs_from_logits_gather_the_chosen_tokens():
    logits = torch.randn(2, 3, 5)
    ids = torch.tensor([[0, 4, 2], [1, 1, 3]])
    expected = torch.log_softmax(logits, -1).gather(-1, ids[..., None])[..., 0]
    torch.testing.assert_close(logprobs_from_logits(logits, ids), expected)


def test_bradley_terry_hand_computed_and_sharded():
    chosen, rejected = torch.tensor([2.0, 0.0, 1.0]), torch.tensor([1.0, 1.0, 1.0])
    loss, metrics = bradley_terry_loss(chosen, rejected)
    torch.testing.assert_close(loss, -F.logsigmoid(torch.tensor([1.0, -1.0, 0.0])).mean())
    assert metrics["accuracy"] == pytest.approx(1 / 3) and metrics["margin"] == pytest.approx(0.0)
    # two shards, each normalised by the whole batch's 3 pairs, add up to the whole loss
    first, _ = bradley_terry_loss(chosen[:1], rejected[:1], normalizer=3)
    rest, _ = bradley_terry_loss(chosen[1:], rejected[1:], normalizer=3)
    torch.testing.assert_close(first + rest, loss)


def test_dpo_loss_on_shards_smaller_than_one_pair_adds_up():
    """Two learners, one pair: each rank's normalizer is 1 / 2 pair; the ranks' losses (each
    scaled by the world size, as DeepSpeed averages them) give the whole pair's loss."""
    pc, pr, rc, rr = torch.tensor([-1.0]), torch.tensor([-3.0]), torch.tensor([-2.0]), torch.tensor([-2.0])
    whole, metrics = dpo_loss(pc, pr, rc, rr, beta=0.5)
    mine, shard_metrics = dpo_loss(pc, pr, rc, rr, beta=0.5, normalizer=0.5)
    empty, _ = dpo_loss(pc[:0], pr[:0], rc[:0], rr[:0], beta=0.5, normalizer=0.5)
    torch.testing.assert_close((mine + empty) / 2, whole)
    assert shard_metrics["reward_accuracy"] / 2 == metrics["reward_accuracy"] == 1.0


# ----------------------------------------------------------------------------- KL in the loss
def _expected_gradient_of_estimator(kind: str, logits: torch.Tensor, ref_logits: torch.Tensor) -> torch.Tensor:
    """The gradient a KL estimator gives as a loss term, in expectation over samples of pi, exactly:
    sum_a pi(a) grad k(a) with pi(a) held fixed (the samples do not move with the weights), by
    autograd over the whole small vocabulary."""
    logits = logits.clone().requires_grad_(True)
    logp, ref = logits.log_softmax(-1), ref_logits.log_softmax(-1)
    (logp.exp().detach() * kl_penalty(logp, ref, kind)).sum().backward()
    return logits.grad


def _kl_gradient(logits: torch.Tensor, ref_logits: torch.Tensor, reverse: bool) -> torch.Tensor:
    """grad KL(pi || pi_ref) (reverse) or grad KL(pi_ref || pi), autograd on the full distributions."""
    logits = logits.clone().requires_grad_(True)
    logp, ref = logits.log_softmax(-1), ref_logits.log_softmax(-1)
    kl = (logp.exp() * (logp - ref)).sum() if reverse else (ref.exp() * (ref - logp)).sum()
    kl.backward()
    return logits.grad


@pytest.mark.parametrize("seed", range(5))
def test_each_kl_estimator_gives_the_gradient_the_docs_name(seed):
    """k1: zero (a no-op penalty); k2: grad KL(pi || pi_ref); k3: grad KL(pi_ref || pi). Six tokens,
    four positions, exact expectations (no sampling)."""
    g = torch.Generator().manual_seed(seed)
    logits, ref_logits = torch.randn(4, 6, generator=g), torch.randn(4, 6, generator=g)
    torch.testing.assert_close(_expected_gradient_of_estimator("k1", logits, ref_logits), torch.zeros(4, 6))
    torch.testing.assert_close(
        _expected_gradient_of_estimator("k2", logits, ref_logits), _kl_gradient(logits, ref_logits, reverse=True)
    )
    torch.testing.assert_close(
        _expected_gradient_of_estimator("k3", logits, ref_logits), _kl_gradient(logits, ref_logits, reverse=False)
    )
    # the two divergences' gradients differ here, so the checks above tell k2 from k3
    assert not torch.allclose(_kl_gradient(logits, ref_logits, True), _kl_gradient(logits, ref_logits, False), atol=1e-3)


def test_the_default_kl_estimator_pulls_towards_the_reference_along_kl_pi_ref():
    """The default `algo.kl_kind` (and LossSpec's) is the one whose gradient is that of
    KL(pi || pi_ref), the penalty README and the config describe."""
    from pipelines.algos.losses import LossSpec
    from pipelines.config import AlgoConfig

    logits, ref_logits = torch.randn(3, 5, generator=torch.Generator().manual_seed(7)), torch.zeros(3, 5)
    for kind in (AlgoConfig().kl_kind, LossSpec().kl_kind):
        torch.testing.assert_close(
            _expected_gradient_of_estimator(kind, logits, ref_logits), _kl_gradient(logits, ref_logits, reverse=True)
        )


# ----------------------------------------------------------------------------- GSPO's normalisation
@pytest.mark.parametrize("aggregate", MODES)
def test_gspo_is_a_mean_over_sequences_whatever_the_length_and_aggregate(aggregate):
    """Two sequences with the same per-token log-ratio c and advantage: GSPO's s_i = exp(c) is the
    same at any length, and so is the loss -s A (unclipped) when the learner's `Normalizers` are
    used, at 3 or 7 response tokens and with any padding. With the token count as the divisor (what
    the learner passed before) the 7-token loss was 3/7 of the 3-token one."""
    from pipelines.algos.losses import Normalizers

    c, adv = 0.1, 0.5
    for length, width in ((3, 3), (3, 9), (7, 7), (7, 12)):
        mask = torch.zeros(2, width)
        mask[:, :length] = 1
        logp = torch.full((2, width), c)
        loss, _ = POLICY_LOSSES.get("gspo")(
            logp, torch.zeros(2, width), torch.full((2, width), adv) * mask, mask,
            clip_low=0.5, clip_high=0.5, aggregate=aggregate, normalizer=Normalizers.of(mask),
        )  # fmt: skip
        assert loss.item() == pytest.approx(-math.exp(c) * adv, rel=1e-6), (length, width)


def test_normalizers_shard_to_the_whole_minibatch_for_gspo_too():
    """Two learners, each with half the sequences and `Normalizers.of(whole, 2)`: their GSPO losses
    add up (mean over ranks x world size) to the one-learner loss."""
    from pipelines.algos.losses import Normalizers

    torch.manual_seed(3)
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [1, 1, 1, 1], [1, 1, 0, 0]])
    logp, adv = torch.randn(4, 4) * 0.1, torch.randn(4)[:, None].expand(4, 4) * mask
    gspo = POLICY_LOSSES.get("gspo")
    whole, _ = gspo(logp, torch.zeros(4, 4), adv, mask, normalizer=Normalizers.of(mask))
    shards = [gspo(logp[r], torch.zeros(2, 4), adv[r], mask[r], normalizer=Normalizers.of(mask, 2))[0] for r in ([0, 2], [1, 3])]
    assert (sum(shards) / 2).item() == pytest.approx(whole.item(), rel=1e-6)


def _decoupled_loss(logp, behaviour, proximal, adv, mask, cap, **kwargs):
    base, weighted, metrics = decoupled_targets(behaviour, proximal, adv, mask, cap)
    loss, _ = ppo_policy_loss(logp, base, weighted, mask, **kwargs)
    return loss, metrics


def test_decoupled_ppo_hand_computed():
    """-w min(r A, clip(r) A), r = pi / pi_prox, w = min(pi_prox / pi_behav, cap), token by token."""
    logp = torch.tensor([[math.log(0.6), math.log(0.3), math.log(0.2), math.log(0.1)]])
    proximal = torch.tensor([[math.log(0.5), math.log(0.3), math.log(0.2), math.log(0.2)]])
    behaviour = torch.tensor([[math.log(0.5), math.log(0.1), math.log(0.4), math.log(0.2)]])
    adv = torch.tensor([[1.0, 1.0, -1.0, 2.0]])
    mask = torch.tensor([[1, 1, 1, 0]])
    loss, metrics = _decoupled_loss(logp, behaviour, proximal, adv, mask, cap=2.0, clip_low=0.1, clip_high=0.1)
    # token 0: w 1, r 1.2 clipped to 1.1 (A > 0) -> -1.1; token 1: w 3 capped to 2, r 1 -> -2;
    # token 2: w 0.5, r 1, A -1 -> +0.5; token 3 is masked out
    assert loss.item() == pytest.approx((-1.1 - 2.0 + 0.5) / 3, rel=1e-5)
    assert metrics == pytest.approx({"behaviour_weight_mean": (1 + 2 + 0.5) / 3, "behaviour_weight_capped": 1 / 3})


@pytest.mark.parametrize("cap", [1.5, 100.0])
@pytest.mark.parametrize("seed", range(3))
def test_decoupled_ppo_is_the_truncated_importance_weighted_policy_gradient(seed, cap):
    """On a full 6-token distribution, every token taken once and weighted by how often the stale
    behaviour policy mu samples it: at the proximal policy (the weights before the update) the
    loss's gradient is -sum_a mu(a) min(pi(a) / mu(a), cap) A(a) grad log pi(a), by autograd on the
    distribution; with no cap hit that is the on-policy gradient -grad sum_a pi(a) A(a)."""
    g = torch.Generator().manual_seed(seed)
    V = 6
    theta = torch.randn(V, generator=g).requires_grad_()
    mu = torch.softmax(torch.randn(V, generator=g), dim=0)
    A = torch.randn(V, generator=g)
    logp = torch.log_softmax(theta, dim=0)  # [V]: one row per token
    # token-mean over V one-token rows is (1 / V) sum_a: scaling A by V mu(a) makes it sum_a mu(a)
    loss, _ = _decoupled_loss(
        logp[:, None], torch.log(mu)[:, None], logp.detach()[:, None], (V * mu * A)[:, None], torch.ones(V, 1), cap=cap
    )
    (grad,) = torch.autograd.grad(loss, theta)
    pi = torch.softmax(theta.detach(), dim=0)
    truncated = -(mu * torch.clamp(pi / mu, max=cap) * A * torch.log_softmax(theta, dim=0)).sum()
    (expected,) = torch.autograd.grad(truncated, theta)
    torch.testing.assert_close(grad, expected)
    if cap > (pi / mu).max():
        (on_policy,) = torch.autograd.grad(-(torch.softmax(theta, dim=0) * A).sum(), theta)
        torch.testing.assert_close(grad, on_policy)


def test_decoupled_ppo_clips_around_the_proximal_policy_not_the_behaviour_one():
    """The policy has moved 1.5x past the proximal policy on a token whose behaviour probability it
    is still close to: decoupled PPO clips it (no gradient), the ratio to the behaviour does not."""
    logp = torch.tensor([[math.log(0.3)]], requires_grad=True)
    proximal, behaviour = torch.tensor([[math.log(0.2)]]), torch.tensor([[math.log(0.29)]])
    loss, _ = _decoupled_loss(logp, behaviour, proximal, torch.ones(1, 1), torch.ones(1, 1), cap=2.0)
    (grad,) = torch.autograd.grad(loss, logp)
    assert grad.item() == 0.0
    plain, _ = ppo_policy_loss(logp, behaviour, torch.ones(1, 1), torch.ones(1, 1))
    (grad,) = torch.autograd.grad(plain, logp)
    assert grad.item() < 0
