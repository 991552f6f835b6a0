"""The pure batch functions between rollout and learning (pipelines/algos/experience.py), by hand."""

import numpy as np
import pytest

from pipelines.algos.experience import concat_batches, prepare_experience


def _batch(prompts, responses, prompt_index, finished=None):
    """A rollout batch of token ids, padded as the generator pads them (prompts left, responses right)."""
    P, T = max(map(len, prompts)), max(map(len, responses))
    out = {
        "prompt_ids": np.array([[0] * (P - len(p)) + p for p in prompts]),
        "prompt_mask": np.array([[0] * (P - len(p)) + [1] * len(p) for p in prompts]),
        "response_ids": np.array([r + [0] * (T - len(r)) for r in responses]),
        "response_mask": np.array([[1] * len(r) + [0] * (T - len(r)) for r in responses]),
        "prompt_index": np.array(prompt_index),
        "response_text": np.array([str(r) for r in responses], dtype=object),
    }
    out["finished"] = np.array(finished if finished is not None else [True] * len(prompts))
    return out


def test_concat_batches_pads_to_the_widest_and_offsets_prompt_indices():
    first = _batch([[1, 2]], [[5]], [0])
    second = _batch([[3], [4]], [[6, 7], [8]], [0, 1])
    both = concat_batches(first, second)
    np.testing.assert_array_equal(both["prompt_ids"], [[1, 2], [0, 3], [0, 4]])  # left-padded
    np.testing.assert_array_equal(both["prompt_mask"], [[1, 1], [0, 1], [0, 1]])
    np.testing.assert_array_equal(both["response_ids"], [[5, 0], [6, 7], [8, 0]])  # right-padded
    np.testing.assert_array_equal(both["response_mask"], [[1, 0], [1, 1], [1, 0]])
    np.testing.assert_array_equal(both["prompt_index"], [0, 1, 2])
    assert list(both["response_text"]) == ["[5]", "[6, 7]", "[8]"] and list(both["finished"]) == [True] * 3
    assert set(both) == set(first)


def _grpo_inputs():
    # two prompts x two samples; only the first sample of the first prompt is right
    batch = _batch([[1]] * 4, [[5, 6], [5], [7, 8], [7]], [0, 0, 1, 1], finished=[True, True, False, True])
    scores = np.array([1.0, 0.0, 0.0, 0.0], dtype=np.float32)
    return batch, scores


def test_prepare_experience_gives_group_advantages_and_step_stats():
    batch, scores = _grpo_inputs()
    reference = np.full((4, 2), -0.5, dtype=np.float32)
    targets, stats = prepare_experience(batch, scores, reference, None, "grpo", 2, 1.0, 1.0, reward_floor=-1.0)
    a = 0.5 / (np.sqrt(0.5) + 1e-6)  # (r - mean) / (unbiased std + eps) in the first group; 0 in the second
    np.testing.assert_allclose(targets["advantages"], [[a, a], [-a, 0], [0, 0], [0, 0]], rtol=1e-6)
    assert targets["advantages"].dtype == np.float32
    assert targets["reference_logprobs"] is reference
    assert "returns" not in targets and "old_values" not in targets
    assert stats == pytest.approx(
        {
            "reward_mean": 0.25,
            "reward_std": np.std([1.0, 0, 0, 0]),
            "advantage_mean": a / 6,  # over the 6 response tokens: a, a, -a, 0, 0, 0
            "advantage_std": np.std([a, a, -a, 0, 0, 0], ddof=1),
            "response_length": 1.5,
            "response_tokens": 6,
            "prompt_tokens": 4,  # one token per prompt
            "prompt_tokens_distinct": 2,  # two prompts, each shared by two samples
            "truncated_fraction": 0.25,
            "reward_all_zero": False,
            "reward_unscored": 0,
            "samples": 4,
        }
    )
    assert targets["scored"].tolist() == [True] * 4


@pytest.mark.parametrize("advantage", ["grpo", "dr_grpo", "rloo", "reinforce_baseline"])
def test_unscored_samples_are_left_out_of_the_group_statistics(advantage):
    """Groups of 4 where one sample is unscored (NaN): the others' advantages are those of the group
    of 3 scored samples alone, the unscored one gets 0 and `scored` False; the stats count it and
    average the scored rewards only. Before, NaN was not possible: None became 0, then the floor."""
    batch = _batch([[1]] * 8, [[5, 6]] * 8, [0, 0, 0, 0, 1, 1, 1, 1])
    scores = np.array([1.0, np.nan, -1.0, -1.0, 1.0, 1.0, np.nan, -1.0], dtype=np.float32)
    targets, stats = prepare_experience(batch, scores, None, None, advantage, 4, 1.0, 1.0, reward_floor=-1.0)
    for group in (slice(0, 4), slice(4, 8)):
        kept = ~np.isnan(scores[group])
        alone, _ = prepare_experience(
            _batch([[1]] * 3, [[5, 6]] * 3, [0, 0, 0]), scores[group][kept], None, None, advantage, 3, 1.0, 1.0, -1.0
        )
        np.testing.assert_allclose(targets["advantages"][group][kept], alone["advantages"], rtol=1e-6)
        assert not targets["advantages"][group][~kept].any()
    assert targets["scored"].tolist() == [True, False, True, True, True, True, False, True]
    assert stats["reward_unscored"] == 2 and stats["reward_mean"] == pytest.approx(0.0)


def test_unscored_samples_get_no_gae_reward():
    batch, _ = _grpo_inputs()
    values = np.zeros((4, 2), dtype=np.float32)
    scores = np.array([1.0, np.nan, 0.5, 0.0], dtype=np.float32)
    targets, _ = prepare_experience(batch, scores, None, values, "gae", 2, 1.0, 1.0, reward_floor=-1.0)
    np.testing.assert_array_equal(targets["advantages"], [[1, 1], [0, 0], [0.5, 0.5], [0, 0]])
    assert np.isfinite(targets["returns"]).all() and targets["scored"].tolist() == [True, False, True, True]


def test_prepare_experience_with_a_critic_gives_gae_returns():
    batch, scores = _grpo_inputs()
    values = np.zeros((4, 2), dtype=np.float32)
    targets, _ = prepare_experience(batch, scores, None, values, "gae", 2, 1.0, 1.0, reward_floor=-1.0)
    # gamma = lambda = 1 and V = 0: every token's advantage (and return) is the sequence's score
    np.testing.assert_array_equal(targets["advantages"], [[1, 1], [0, 0], [0, 0], [0, 0]])
    np.testing.assert_array_equal(targets["returns"], [[1, 1], [0, 0], [0, 0], [0, 0]])
    assert targets["old_values"] is values and "reference_logprobs" not in targets


def test_all_rewards_at_the_floor_are_flagged():
    batch, _ = _grpo_inputs()
    _, stats = prepare_experience(batch, np.full(4, -1.0, dtype=np.float32), None, None, "grpo", 2, 1.0, 1.0, -1.0)
    assert stats["reward_all_zero"] is True
