"""The Learner core in one process (DeepSpeed, gloo): updates follow the advantages, and a
non-finite loss is skipped without touching the weights."""

import copy
import dataclasses

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from actors.core import onednn
from actors.core.learner import Learner, LearnerSpec
from actors.core.minibatch import Shard, minibatches, shards
from actors.core.onednn import OneDnnLinear, available
from pipelines.algos.losses import LossSpec

pytestmark = pytest.mark.slow
# Measured (AVX2 and default kernels alike): MSE 1.0 at V = 0, 0.35 after 12 steps of lr 1e-3.
CRITIC_STEPS, CRITIC_MAX_MSE = 12, 0.6


def _whole(columns, size, seed=0) -> list[Shard]:
    """`columns` cut into minibatches of at most `size` rows, as a learner alone in its world gets them."""
    return [shards(mb, 1)[0] for mb in minibatches(columns, size, seed=seed)]


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
    metrics = learner.train_step(_whole(step, 8, seed=0), LossSpec(kl_coef=0.0, entropy_coef=0.0))
    return step, metrics, learner.logprobs(batch) - before


@pytest.fixture(scope="module", autouse=True)
def _gloo_world_ends_with_the_module():
    """The Learners here join one gloo world in this process: it is torn down when the module's
    tests are done, not left to the interpreter's exit (a CI run that passed every test once
    crashed there with a segmentation fault, a live process group being the likely cause)."""
    yield
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def _in_onednn(spec: LearnerSpec) -> Learner:
    """A learner whose every linear layer multiplies in oneDNN (actors/core/onednn.py), as a real
    model's decoder and LM head do: the tiny model's layers are all under `MIN_WEIGHT`, which keeps
    them with MKL. It joins the module's gloo world."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(onednn, "MIN_WEIGHT", 0)
        patch.setenv("RAYPO_ONEDNN", "1")  # on any processor, Intel's too (where MKL is the default)
        return Learner(spec, master_port=29611)


@pytest.fixture(scope="module")
def learner(tiny_model):
    return _in_onednn(LearnerSpec(str(tiny_model[0]), lr=1e-4))


def _switched_as_told(model: torch.nn.Module) -> bool:
    """Each linear layer is in oneDNN exactly when `onednn.switches` says: it has `MIN_WEIGHT`
    weights or more, oneDNN is on and the processor is not Intel's (or `RAYPO_ONEDNN=1`)."""
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    return bool(linears) and all(isinstance(m, OneDnnLinear) == onednn.switches(m.in_features, m.out_features) for m in linears)


def test_update_follows_the_advantages_and_skips_non_finite_losses(learner, monkeypatch):
    # a float32 CPU learner's linear layers multiply in oneDNN (actors/core/onednn.py), and these updates run through them
    monkeypatch.setenv("RAYPO_ONEDNN", "1")  # as `_in_onednn` built it, whatever the environment says
    assert available() == all(isinstance(m, OneDnnLinear) for m in learner.model.modules() if isinstance(m, torch.nn.Linear))
    step, metrics, change = _update_towards_first_half(learner)
    assert metrics["update_success"] == 1.0 and np.isfinite(metrics["grad_norm"])
    assert change[:4].sum() > 0 > change[4:].sum()

    weights = learner.state_dict()
    poisoned = {**step, "advantages": np.full_like(step["advantages"], np.nan)}
    metrics = learner.train_step(_whole(poisoned, 8, seed=0), LossSpec())
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
    assert _switched_as_told(critic.model)  # actors/core/onednn.py
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
        metrics = policy.dpo_step(_whole({**pairs, **reference}, 8, seed=0), DPOSpec(beta=0.1))
    end = policy.pair_logprobs(pairs)
    margin = (end["policy_chosen"] - reference["reference_chosen"]) - (end["policy_rejected"] - reference["reference_rejected"])
    assert metrics["update_success"] == 1.0 and np.isfinite(metrics["grad_norm"]) and metrics["loss"] < np.log(2)
    assert margin.mean() > 0 and (margin > 0).mean() >= 0.75, margin


@pytest.fixture(scope="module")
def frozen(tiny_model):
    """A learner with learning rate 0: its losses can be compared call after call (the weights
    never move)."""
    return Learner(LearnerSpec(str(tiny_model[0]), lr=0.0), master_port=29611)  # joins the module's gloo world


def _long_batch(n=8):
    """`_batch()` with 6-token responses ("4545" + EOS twice as long)."""
    batch = _batch(n)
    batch["response_ids"] = np.array([[25, 26, 25, 26, 25, 2]] * (n // 2) + [[27, 28, 27, 28, 27, 2]] * (n - n // 2))
    batch["response_mask"] = np.ones((n, 6), dtype=np.int64)
    return batch


def test_gspo_loss_through_the_learner_does_not_depend_on_response_length(frozen):
    """Every token's log-ratio c and every advantage A: GSPO's loss is -exp(c) A (a mean over
    sequences) for 3- and 6-token responses alike, whatever `algo.aggregate` is. The learner used to
    divide GSPO's sum over sequences by the minibatch's token count (3x or 6x smaller)."""
    assert _switched_as_told(frozen.model)  # a learner as built by default: the tiny model's layers stay with MKL
    c, adv = 0.1, 0.5
    for batch in (_batch(), _long_batch()):
        for aggregate in ("token-mean", "seq-mean-token-mean"):
            step = {
                **batch,
                "behaviour_logprobs": frozen.logprobs(batch) - c,
                "advantages": (adv * batch["response_mask"]).astype(np.float32),
            }
            spec = LossSpec(policy_loss="gspo", clip_low=0.5, clip_high=0.5, aggregate=aggregate, kl_coef=0.0, entropy_coef=0.0)
            metrics = frozen.train_step(_whole(step, 8, seed=0), spec)
            assert metrics["pg_loss"] == pytest.approx(-np.exp(c) * adv, rel=1e-4), (batch["response_ids"].shape, aggregate)


def test_unscored_samples_stay_out_of_the_loss(frozen):
    """Samples no reward scored (`scored` False) count in no loss term or normalizer: the step's
    losses equal those of the scored rows alone, though the unscored rows carry huge advantages."""
    batch = _batch()
    scored = np.array([True, True, False, True, False, True, False, False])
    adv = np.where(scored, 1.0, 1e3)[:, None] * batch["response_mask"]
    reference = np.tile(frozen.logprobs(batch)[:1] - 0.3, (8, 1))
    step = {**batch, "behaviour_logprobs": frozen.logprobs(batch), "advantages": adv.astype(np.float32)}
    step["reference_logprobs"] = reference.astype(np.float32)
    with_mask = frozen.train_step(_whole({**step, "scored": scored}, 8, seed=0), LossSpec())
    alone = frozen.train_step(_whole({k: v[scored] for k, v in step.items()}, 8, seed=0), LossSpec())
    for key in ("loss", "pg_loss", "entropy", "kl", "kl_loss"):
        assert with_mask[key] == pytest.approx(alone[key], rel=1e-5, abs=1e-7), key
    with pytest.raises(ValueError, match="all unscored"):
        frozen.train_step(_whole({**step, "scored": np.zeros(8, dtype=bool)}, 8, seed=0), LossSpec())


def test_a_bf16_learner_and_its_reference_start_at_zero_dpo_margin(tiny_model):
    """The reference model runs in the learner's dtype: under a bf16 learner, policy and reference
    log-probs of the same pairs agree at step 0, so DPO's implicit rewards and margin start at 0. A
    float32 reference beside the bf16 policy (what raypo did) starts off by bf16's rounding."""
    from transformers import AutoTokenizer

    from actors.core.reference import ReferenceScorer
    from pipelines.algos.losses import dpo_loss
    from pipelines.data.preferences import encode_pairs, pair_of
    from pipelines.data.tasks import Arithmetic

    problems = Arithmetic(operators="+").sample(16, "train", 1)
    pairs = encode_pairs(AutoTokenizer.from_pretrained(tiny_model[0]), [pair_of(p) for p in problems])
    half = Learner(LearnerSpec(str(tiny_model[0]), lr=0.0, bf16=True), master_port=29611)
    policy = {k: torch.from_numpy(v).float() for k, v in half.pair_logprobs(pairs).items()}

    def start(dtype: str) -> tuple[float, float]:
        """DPO's implicit-reward margin at step 0 and the largest policy - reference log-prob gap."""
        scorer = ReferenceScorer(str(tiny_model[0]), dtype=dtype)
        ref = {k: torch.from_numpy(v).float() for k, v in scorer.pair_logprobs(pairs).items()}
        _, metrics = dpo_loss(
            policy["policy_chosen"], policy["policy_rejected"], ref["reference_chosen"], ref["reference_rejected"]
        )
        gap = max((policy[f"policy_{s}"] - ref[f"reference_{s}"]).abs().max().item() for s in ("chosen", "rejected"))
        return metrics["reward_margin"], gap

    (margin, gap), (_, float32_gap) = start("bfloat16"), start("float32")
    assert margin == 0.0 and gap == 0.0, (margin, gap)
    assert float32_gap > 1e-3, float32_gap  # the mismatch this fixes is visible


def test_kl_to_the_reference_is_zero_at_step_0_under_top_k_and_top_p(tiny_model):
    """The reference is the initial policy, never truncated: the KL term compares it with the
    policy's full softmax, so at step 0 the penalty and the `kl` metric are 0 under top-k/top-p too
    (compared with the truncated log-probs, every token would show log 1/Z > 0)."""
    from actors.core.reference import ReferenceScorer
    from pipelines.algos.sampling import SamplingSpec

    sampling = SamplingSpec(top_k=3, top_p=0.9)
    learner = Learner(LearnerSpec(str(tiny_model[0]), lr=0.0, sampling=sampling), master_port=29611)
    batch = _batch()
    truncated = learner.logprobs(batch)
    scorer = ReferenceScorer(str(tiny_model[0]))
    assert _switched_as_told(scorer.model)  # actors/core/onednn.py, as the learner's
    reference = scorer.logprobs(batch)
    assert (truncated - reference).max() > 1e-3  # the truncation matters for this batch
    step = {**batch, "behaviour_logprobs": truncated, "reference_logprobs": reference}
    step["advantages"] = np.where(np.arange(8)[:, None] < 4, 1.0, -1.0).astype(np.float32) * batch["response_mask"]
    for kind in ("k2", "k3"):
        metrics = learner.train_step(_whole(step, 8, seed=0), LossSpec(kl_kind=kind, kl_coef=0.1))
        assert abs(metrics["kl"]) < 1e-6 and abs(metrics["kl_loss"]) < 1e-6, (kind, metrics)
        assert metrics["approx_kl"] == pytest.approx(0.0, abs=1e-6)  # ratio 1: the sampling contract


def test_the_entropy_bonus_is_a_loss_term_only_when_its_coefficient_is_set(learner):
    """With zero advantages the policy-gradient term has no gradient: at entropy_coef 0 the
    gradient is zero (the entropy is then only a metric, computed without a graph); at 0.5 the
    bonus alone gives one. The entropy is reported either way."""
    batch = _batch()
    step = {**batch, "behaviour_logprobs": learner.logprobs(batch), "advantages": np.zeros((8, 3), dtype=np.float32)}
    without = learner.train_step(_whole(step, 8, seed=0), LossSpec(kl_coef=0.0, entropy_coef=0.0))
    bonus = learner.train_step(_whole(step, 8, seed=0), LossSpec(kl_coef=0.0, entropy_coef=0.5))
    assert without["grad_norm"] == 0.0 and bonus["grad_norm"] > 0.01
    assert without["entropy"] > 0 and bonus["entropy"] > 0


@pytest.mark.parametrize("minibatch", [8, 4])
def test_decoupled_ppo_with_nothing_stale_is_the_synchronous_update(tiny_model, minibatch):
    """Samples whose behaviour log-probs are the learner's own (nothing stale): every importance
    weight is 1 and the proximal policy is the behaviour one, so the off-policy loss
    (behaviour_weight_cap set) updates the weights exactly as the synchronous loss does, in one
    minibatch (the proximal log-probs read off the loss's own forward pass) and in two (each
    minibatch's proximal log-probs computed before the first update moves the weights)."""
    batch = _batch()
    weights = {}
    for cap in (None, 2.0):
        learner = Learner(LearnerSpec(str(tiny_model[0]), lr=1e-2), master_port=29611)  # joins the module's gloo world
        adv = np.where(np.arange(8)[:, None] < 4, 1.0, -1.0).astype(np.float32) * batch["response_mask"]
        step = {**batch, "behaviour_logprobs": learner.logprobs(batch), "advantages": adv}
        spec = LossSpec(kl_coef=0.0, entropy_coef=0.0, clip_low=0.05, clip_high=0.05, behaviour_weight_cap=cap)
        metrics = learner.train_step(_whole(step, minibatch, seed=0), spec)
        assert metrics["update_success"] == 1.0
        if cap is not None:
            assert metrics["behaviour_weight_mean"] == pytest.approx(1.0, abs=1e-5) and metrics["behaviour_weight_capped"] == 0
        weights[cap] = learner.state_dict()
    # Adam's first step moves each weight by about lr (1e-2); the proximal and behaviour log-probs come
    # from passes over different rows (packed differently), equal to float rounding (~1e-7)
    for name, value in weights[None].items():
        np.testing.assert_allclose(weights[2.0][name], value, rtol=0, atol=1e-5, err_msg=name)


def test_the_proximal_log_probs_are_the_weights_before_the_step(learner):
    """With several minibatches, each gets the log-probs of its rows under the weights the step
    starts from, before any of its updates."""
    batch = _batch()
    step = {**batch, "behaviour_logprobs": np.zeros((8, 3), dtype=np.float32), "advantages": np.zeros((8, 3), dtype=np.float32)}
    parts = _whole(step, 4)
    for part in learner._with_proximal(parts):
        np.testing.assert_allclose(part.columns["proximal_logprobs"], learner.logprobs(part.columns), rtol=0, atol=1e-6)
    assert learner._with_proximal(parts[:1]) == parts[:1]  # one minibatch reads them off its own forward pass


@pytest.mark.parametrize("grad_clip", [0.0, 0.05, 1e6])
def test_gradients_are_clipped_to_grad_clip_and_the_metric_is_their_norm_before(learner, grad_clip):
    """Without ZeRO in float32 the learner clips (DeepSpeed's clipping is off there), inside its
    optimizer step: an update (`_update`, on a loss whose gradients are random) against the norm
    computed apart in float64, and against the same optimizer, from the same weights and state, on
    the gradients scaled apart as torch's `clip_grad_norm_` scales them; for no clipping (0), a
    clip that bites, and one that does not. The optimizer's state is primed by an unclipped step
    first: Adam's first step barely depends on the gradients' scale."""
    assert learner.clips_here and learner.engine.gradient_clipping() == 0.0
    params = list(learner.model.parameters())
    start = [p.detach().clone() for p in params], copy.deepcopy(learner.optimizer.state_dict())
    spec, learner.spec = learner.spec, dataclasses.replace(learner.spec, grad_clip=grad_clip)
    gen = torch.Generator().manual_seed(0)

    def update_on_random_gradients() -> tuple[dict[str, float], list[torch.Tensor]]:
        grads = [torch.randn(p.shape, generator=gen) * 1e-3 for p in params]
        learner.engine.zero_grad()
        loss = sum((p * g).sum() for p, g in zip(params, grads, strict=True))  # its gradients are `grads`
        return learner._update(loss, {}), [g.double() for g in grads]

    try:
        learner.spec = dataclasses.replace(learner.spec, grad_clip=1e6)
        update_on_random_gradients()  # unclipped: the norm is ~0.9
        learner.spec = dataclasses.replace(learner.spec, grad_clip=grad_clip)
        weights, state = [p.detach().clone() for p in params], copy.deepcopy(learner.optimizer.state_dict())
        out, grads = update_on_random_gradients()
        norm = sum((g**2).sum() for g in grads).sqrt().item()
        scale = min(1.0, grad_clip / (norm + 1e-6)) if grad_clip else 1.0
        assert out["update_success"] == 1.0 and out["grad_norm"] == pytest.approx(norm, rel=1e-6)
        assert learner.optimizer.grad_scale is None  # the next step is not clipped
        stepped = [p.detach().clone() for p in params]
        for p, w, g in zip(params, weights, grads, strict=True):
            p.data.copy_(w)
            p.grad = (g * scale).float()
        learner.optimizer.load_state_dict(state)
        learner.optimizer.step()
        for p, w, got in zip(params, weights, stepped, strict=True):
            np.testing.assert_allclose(got.numpy(), p.detach().numpy(), rtol=1e-6, atol=1e-9)
            assert not torch.equal(got, w)
        assert (scale < 0.5) == (grad_clip == 0.05)  # the middle case does clip
    finally:
        learner.spec = spec
        learner.engine.zero_grad()
        for p, w in zip(params, start[0], strict=True):
            p.data.copy_(w)
        learner.optimizer.load_state_dict(start[1])


def test_micro_batches_add_up_to_the_whole_minibatchs_update(tiny_model):
    """8 rows in micro-batches of at most 3 (3 + 3 + 2), with the entropy and KL terms on: the
    same weights and metrics as the whole minibatch in one pass (the losses add up, the per-token
    means are weighted by tokens)."""
    batch = _batch()
    results = {}
    for micro in (0, 3):
        learner = Learner(LearnerSpec(str(tiny_model[0]), lr=1e-2, micro_batch_size=micro), master_port=29611)
        adv = np.where(np.arange(8)[:, None] < 4, 1.0, -1.0).astype(np.float32) * batch["response_mask"]
        behaviour = learner.logprobs(batch) - 0.1 * np.arange(8, dtype=np.float32)[:, None]  # ratios off 1, some clipped
        step = {**batch, "behaviour_logprobs": behaviour, "advantages": adv, "reference_logprobs": behaviour + 0.05}
        spec = LossSpec(kl_coef=0.1, entropy_coef=0.01, clip_low=0.2, clip_high=0.2)
        passes, loss_of = [], learner._policy_loss  # records the rows of each forward pass, computes as before
        learner._policy_loss = lambda batch, rows, *rest, passes=passes, loss_of=loss_of: (
            passes.append(len(rows)) or loss_of(batch, rows, *rest)
        )
        results[micro] = (learner.train_step(_whole(step, 8, seed=0), spec), learner.state_dict())
        assert passes == ([8] if micro == 0 else [3, 3, 2]), passes
    (whole, w0), (micro, w3) = results[0], results[3]
    assert 0 < whole["clip_fraction"] < 1
    for key in ("loss", "pg_loss", "entropy", "kl", "kl_loss", "clip_fraction", "approx_kl", "grad_norm"):
        assert micro[key] == pytest.approx(whole[key], rel=1e-5, abs=1e-7), key
    # Adam's first step is lr * g / (|g| + eps), about lr * sign(g): where a gradient is within a
    # few eps (1e-8) of 0, summing it in parts moves the step (by up to 4e-5 in 48 elements of 16k
    # on one machine, 2 on another; with the entropy's gradient through the fused LM head, 6e-4 in
    # 28 of the head's 12.8k, rows of tokens the batch barely touches). So: none further apart than
    # two steps of lr, and almost every weight that took a full step (> 0.9 lr) within lr / 100. A
    # wrong gradient flips the signs of many (and the metrics above differ).
    start, full_steps = load_file(str(tiny_model[0] / "model.safetensors")), 0
    for name, value in w0.items():
        diff, full = np.abs(w3[name] - value), np.abs(value - start[name].numpy()) > 0.9e-2
        assert diff.max() <= 2e-2 and (diff[full] > 1e-4).mean() < 1e-3, (name, diff.max(), (diff[full] > 1e-4).sum())
        full_steps += full.sum()
    assert full_steps > 0.5 * sum(w.size for w in w0.values())  # most weights took a full step: the bound has teeth


def test_under_zero3_each_row_runs_its_prompt_itself(learner, tiny_model):
    """ZeRO-3 gathers the weights at every forward pass, so every rank must make as many: a
    group's prompt is not run apart there (ranks could share differently), elsewhere it is."""
    from actors.core.modeling import shares_prompts

    sharded = _in_onednn(LearnerSpec(str(tiny_model[0]), lr=1e-3, zero_stage=3))  # were it not ZeRO-3
    assert shares_prompts(learner.engine) and not shares_prompts(sharded.engine)
    assert not any(isinstance(m, OneDnnLinear) for m in sharded.model.modules())  # ZeRO-3 keeps torch's linear
    assert np.isfinite(sharded.logprobs(_batch())).all()  # the one pass runs under ZeRO-3


def test_the_learner_takes_the_fused_head_where_it_applies_with_the_logits_paths_numbers(learner, monkeypatch):
    """`_policy` under untruncated sampling goes through the fused LM head (rows that share a
    prompt pack), with or without an entropy gradient; its log-probs, entropies and gradients are
    those of the logits path (`along_response`), which a truncated sampling still takes."""
    from actors.core import learner as learner_module
    from actors.core.modeling import sequence_tensors

    inputs = sequence_tensors(_batch(), np.arange(8))
    fused_calls = []
    fused = learner_module.packed_token_logprobs
    monkeypatch.setattr(learner_module, "packed_token_logprobs", lambda *a, **k: fused_calls.append(1) or fused(*a, **k))
    weights = torch.from_numpy(np.random.default_rng(9).random(inputs["response_mask"].shape)).float()

    def policy_and_grads(entropy_grad=False):
        learner.engine.zero_grad()
        logp, full, entropy = learner._policy(inputs, entropy_grad=entropy_grad)
        mask = inputs["response_mask"]
        loss = (logp * mask).sum() + ((entropy * weights * mask).sum() if entropy_grad else 0)
        learner.engine.backward(loss)  # through its hooks, as an update
        return logp, full, entropy, [p.grad.clone() for p in learner.model.parameters()]

    got = {grad: policy_and_grads(grad) for grad in (False, True)}
    assert fused_calls == [1, 1] and got[False][0] is got[False][1] and got[True][2].requires_grad
    top_p = dataclasses.replace(learner.spec.sampling, top_p=0.9)
    monkeypatch.setattr(learner, "spec", dataclasses.replace(learner.spec, sampling=top_p))
    policy_and_grads()  # a truncated sampling needs the logits
    assert fused_calls == [1, 1]
    monkeypatch.undo()
    monkeypatch.setattr(learner_module, "packed_token_logprobs", lambda *a, **k: None)
    for entropy_grad in (False, True):
        fused_run, want = got[entropy_grad], policy_and_grads(entropy_grad)
        torch.testing.assert_close(fused_run[0], want[0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(fused_run[1], want[1], rtol=1e-5, atol=1e-5)
        # the entropy is lse - sum p z: exact to a few float32 ulps of the largest logit (~20 here), not of itself
        torch.testing.assert_close(fused_run[2], want[2], rtol=0, atol=2e-5)
        for g, w in zip(fused_run[3], want[3], strict=True):  # float32 sums in other orders: to 1e-4 of each largest
            torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4 * float(w.abs().max()))
    learner.engine.zero_grad()
