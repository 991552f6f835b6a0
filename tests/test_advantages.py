import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pipelines.algos.advantages import (
    ADVANTAGES,
    AdvantageBatch,
    AdvantageParams,
    compute_gae,
    group_advantages,
    register_advantage,
)


def test_gae_hand_computed():
    # One sequence of 3 response tokens and one padding position.
    rewards = torch.tensor([[0.0, 0.0, 1.0, 5.0]])
    values = torch.tensor([[0.5, 0.6, 0.7, 9.0]])
    mask = torch.tensor([[1, 1, 1, 0]])
    gamma, lam = 0.9, 0.8
    d2 = 1.0 - 0.7  # last token: V(after) = 0
    d1 = 0.0 + 0.9 * 0.7 - 0.6
    d0 = 0.0 + 0.9 * 0.6 - 0.5
    a2 = d2
    a1 = d1 + gamma * lam * a2
    a0 = d0 + gamma * lam * a1
    adv, ret = compute_gae(rewards, values, mask, gamma, lam)
    torch.testing.assert_close(adv, torch.tensor([[a0, a1, a2, 0.0]]))
    torch.testing.assert_close(ret, torch.tensor([[a0 + 0.5, a1 + 0.6, a2 + 0.7, 0.0]]))


def test_gae_ignores_everything_outside_the_mask():
    mask = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1]])
    rewards = torch.tensor([[0.0, 1.0, float("nan"), 3.0], [0.0, 0.0, 0.0, 1.0]])
    values = torch.tensor([[0.1, 0.2, float("inf"), 7.0], [0.1, 0.2, 0.3, 0.4]])
    adv, ret = compute_gae(rewards, values, mask, 0.99, 0.95)
    assert torch.isfinite(adv).all() and torch.isfinite(ret).all()
    assert (adv[0, 2:] == 0).all() and (ret[0, 2:] == 0).all()
    # The first row equals the same row computed on its own, without padding.
    adv_alone, _ = compute_gae(rewards[:1, :2], values[:1, :2], mask[:1, :2], 0.99, 0.95)
    torch.testing.assert_close(adv[0, :2], adv_alone[0])


@settings(max_examples=50, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 6), min_size=1, max_size=4),
    seed=st.integers(0, 10_000),
)
def test_gae_with_gamma_lambda_one_is_reward_to_go_minus_value(lengths, seed):
    g = torch.Generator().manual_seed(seed)
    T = max(lengths)
    mask = torch.tensor([[1] * n + [0] * (T - n) for n in lengths])
    rewards = torch.randn(len(lengths), T, generator=g)
    values = torch.randn(len(lengths), T, generator=g)
    adv, ret = compute_gae(rewards, values, mask, gamma=1.0, lam=1.0)
    masked_rewards = rewards * mask
    to_go = masked_rewards.flip(-1).cumsum(-1).flip(-1)
    torch.testing.assert_close(adv, (to_go - values) * mask, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ret, to_go * mask, atol=1e-5, rtol=1e-5)


def test_group_advantages_hand_computed():
    r = torch.tensor([1.0, 0.0, 0.0, 1.0, 2.0, 2.0, 2.0, 2.0])  # two groups of 4
    mean0, std0 = 0.5, math.sqrt(1 / 3)  # unbiased std of [1, 0, 0, 1]
    grpo = group_advantages(r, 4, "grpo", eps=1e-6)
    torch.testing.assert_close(grpo[:4], (r[:4] - mean0) / (std0 + 1e-6))
    torch.testing.assert_close(grpo[4:], torch.zeros(4))  # equal rewards: no signal, no NaN
    for method in ("dr_grpo", "reinforce_baseline"):
        torch.testing.assert_close(group_advantages(r, 4, method), torch.tensor([0.5, -0.5, -0.5, 0.5, 0, 0, 0, 0]))
    # rloo: r_i - mean of the other three
    torch.testing.assert_close(group_advantages(r, 4, "rloo")[:4], torch.tensor([1 - 1 / 3, -2 / 3, -2 / 3, 1 - 1 / 3]))


@settings(max_examples=50, deadline=None)
@given(groups=st.integers(1, 4), size=st.integers(2, 6), seed=st.integers(0, 10_000))
def test_rloo_is_leave_one_out_and_group_advantages_sum_to_zero(groups, size, seed):
    r = torch.randn(groups * size, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    rloo = group_advantages(r, size, "rloo").reshape(groups, size)
    grouped = r.reshape(groups, size)
    explicit = torch.stack([grouped[:, i] - torch.cat([grouped[:, :i], grouped[:, i + 1 :]], 1).mean(1) for i in range(size)], 1)
    torch.testing.assert_close(rloo, explicit)
    for method in ("grpo", "dr_grpo", "rloo"):
        sums = group_advantages(r, size, method).reshape(groups, size).sum(1)
        torch.testing.assert_close(sums, torch.zeros(groups, dtype=torch.float64), atol=1e-9, rtol=0)


def test_group_advantages_reject_bad_shapes_and_names():
    with pytest.raises(ValueError, match="groups of 3"):
        group_advantages(torch.zeros(8), 3, "grpo")
    with pytest.raises(ValueError, match="unknown group advantage method 'nope'"):
        group_advantages(torch.zeros(8), 4, "nope")
    with pytest.raises(ValueError, match="group_size >= 2"):
        group_advantages(torch.zeros(4), 1, "grpo")


def test_every_estimator_takes_the_same_batch():
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 0, 0], [1, 1, 1]])
    batch = AdvantageBatch(scores=torch.tensor([1.0, 0.0, 0.5, 0.2]), mask=mask, values=torch.rand(4, 3))
    params = AdvantageParams(group_size=2)
    assert set(ADVANTAGES.names()) == {"gae", "grpo", "dr_grpo", "rloo", "reinforce_baseline"}
    for name in ADVANTAGES.names():
        adv, ret = ADVANTAGES.get(name)(batch, params)
        assert adv.shape == ret.shape == mask.shape, name
        assert (adv[mask == 0] == 0).all(), name
    # group estimators broadcast one advantage over each response
    adv, _ = ADVANTAGES.get("grpo")(batch, params)
    expected = group_advantages(batch.scores, 2, "grpo")
    torch.testing.assert_close(adv[:, 0], expected)
    torch.testing.assert_close(adv[1], expected[1].expand(3))


def test_gae_estimator_puts_the_score_on_the_last_token():
    mask = torch.tensor([[1, 1, 0]])
    batch = AdvantageBatch(scores=torch.tensor([2.0]), mask=mask, values=torch.zeros(1, 3))
    adv, _ = ADVANTAGES.get("gae")(batch, AdvantageParams(gamma=1.0, lam=1.0))
    torch.testing.assert_close(adv, torch.tensor([[2.0, 2.0, 0.0]]))
    with pytest.raises(ValueError, match="needs critic values"):
        ADVANTAGES.get("gae")(AdvantageBatch(scores=torch.zeros(1), mask=mask), AdvantageParams())


def test_registering_a_name_twice_raises():
    with pytest.raises(ValueError, match="already registered"):
        register_advantage("grpo")(lambda batch, params: None)
    with pytest.raises(KeyError, match="unknown advantage estimator 'ppo2'"):
        ADVANTAGES.get("ppo2")
