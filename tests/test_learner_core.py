"""The Learner core in one process (DeepSpeed, gloo): updates follow the advantages, and a
non-finite loss is skipped without touching the weights."""

import numpy as np
import pytest

from actors.core.learner import Learner, LearnerSpec
from actors.core.minibatch import minibatches
from pipelines.algos.losses import LossSpec

pytestmark = pytest.mark.slow
# Measured (AVX2 and default kernels alike): MSE 1.0 at V = 0, 0.35 after 12 steps of lr 1e-3.
CRITIC_STEPS, CRITIC_MAX_MSE = 12, 0.6


def _batch(n=8):
    # The first half answers "45", the second half "67", to the same prompt "12+3=".
    responses = [[25, 26, 2]] * (n // 2) + [[27, 28, 2]] * (n - n // 2)
    return {
        "prompt_ids": np.tile([[0, 1, 21, 22, 15, 23, 33]], (n, 1)),
        "prompt_mask": np.tile([[0, 1, 1, 1, 1, 1, 1]], (n, 1)),
        "response_ids": np.array(responses),
        "response_mask": np.ones((n, 3), dtype=np.int64),
    }


def _update_towards_first_half(learner):
    """One update with advantage +1 on the first half of `_batch()`, -1 on the second; returns
    the step fed in, its metrics, and the change of each row's log-probs."""
    batch = _batch()
    before = learner.logprobs(batch)
    adv = np.where(np.arange(8)[:, None] < 4, 1.0, -1.0) * batch["response_mask"]
    step = {**batch, "behaviour_logprobs": before, "advantages": adv.astype(np.float32)}
    metrics = learner.train_step(minibatches(step, 8, seed=0), LossSpec(kl_coef=0.0, entropy_coef=0.0))
    return step, metrics, learner.logprobs(batch) - before


@pytest.fixture(scope="module")
def learner(tiny_model):
    return Learner(LearnerSpec(str(tiny_model[0]), lr=1e-4), master_port=29611)


def test_update_follows_the_advantages_and_skips_non_finite_losses(learner):
    step, metrics, change = _update_towards_first_half(learner)
    assert metrics["update_success"] == 1.0 and np.isfinite(metrics["grad_norm"])
    assert change[:4].sum() > 0 > change[4:].sum()

    weights = learner.state_dict()
    poisoned = {**step, "advantages": np.full_like(step["advantages"], np.nan)}
    metrics = learner.train_step(minibatches(poisoned, 8, seed=0), LossSpec())
    assert metrics["update_success"] == 0.0 and np.isnan(metrics["loss"])
    assert all(np.array_equal(weights[k], v) for k, v in learner.state_dict().items())


def test_bf16_with_gradient_checkpointing_trains(learner, tiny_model):
    """The options a GPU run turns on, on CPU: bf16 weights under DeepSpeed's bf16 mode and
    recomputed activations. The update runs and follows the advantages."""
    import torch

    spec = LearnerSpec(str(tiny_model[0]), lr=1e-3, bf16=True, gradient_checkpointing=True)
    half = Learner(spec, master_port=29611)  # joins the module's one-rank gloo world
    assert next(half.model.parameters()).dtype == torch.bfloat16 and half.model.is_gradient_checkpointing
    _, metrics, change = _update_towards_first_half(half)
    assert metrics["update_success"] == 1.0 and np.isfinite(metrics["grad_norm"])
    assert change[:4].sum() > change[4:].sum()


def test_critic_fits_the_returns(tiny_model):
    """The value model starts at V = 0 and, refit each step around its last values (as PPO does),
    predicts +1 for the first half of `_batch()` and -1 for the second."""
    from actors.core.critic import Critic

    batch = _batch()
    returns = (np.where(np.arange(8)[:, None] < 4, 1.0, -1.0) * batch["response_mask"]).astype(np.float32)
    critic = Critic(str(tiny_model[0]), lr=1e-3)
    assert not critic.values(batch).any(), "the critic must start at V = 0"
    for _ in range(CRITIC_STEPS):
        metrics = critic.train_step(minibatches({**batch, "old_values": critic.values(batch), "returns": returns}, 8, seed=0))
    values = critic.values(batch)
    assert np.isfinite(metrics["value_loss"])
    assert float(((values - returns) ** 2).mean()) < CRITIC_MAX_MSE, values
    assert values[:4].mean() > 0.3 > -0.3 > values[4:].mean(), values


def test_dpo_update_raises_the_chosen_over_the_rejected(tiny_model):
    """Built-in preference pairs (right answer over the warm start's slip): the policy starts equal
    to the reference, and three DPO updates give the chosen completions the higher implicit
    reward on most pairs."""
    from transformers import AutoTokenizer

    from actors.core.reference import ReferenceScorer
    from pipelines.algos.losses import DPOSpec
    from pipelines.data.preferences import encode_pairs, pair_of
    from pipelines.data.tasks import Arithmetic

    problems = Arithmetic(operators="+").sample(16, "train", 0)
    pairs = encode_pairs(AutoTokenizer.from_pretrained(tiny_model[0]), [pair_of(p) for p in problems])
    reference = ReferenceScorer(str(tiny_model[0])).pair_logprobs(pairs)
    policy = Learner(LearnerSpec(str(tiny_model[0]), lr=1e-3), master_port=29611)  # joins the module's gloo world
    start = policy.pair_logprobs(pairs)
    for side in ("chosen", "rejected"):
        np.testing.assert_allclose(start[f"policy_{side}"], reference[f"reference_{side}"], rtol=1e-5, atol=1e-5)
    for _ in range(3):
        metrics = policy.dpo_step(minibatches({**pairs, **reference}, 8, seed=0), DPOSpec(beta=0.1))
    end = policy.pair_logprobs(pairs)
    margin = (end["policy_chosen"] - reference["reference_chosen"]) - (end["policy_rejected"] - reference["reference_rejected"])
    assert metrics["update_success"] == 1.0 and np.isfinite(metrics["grad_norm"]) and metrics["loss"] < np.log(2)
    assert margin.mean() > 0 and (margin > 0).mean() >= 0.75, margin
