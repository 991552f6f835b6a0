"""Every actor's typed methods, on a real local Ray with real vLLM and DeepSpeed."""

import asyncio
import time

import numpy as np
import pytest
import ray
import torch
from conftest import decoded_after_and_by_the_engine, reloaded_two_ways
from safetensors.numpy import load_file

from actors.buffer import ExperienceBuffer, minibatch_refs
from actors.core.learner import LearnerSpec
from actors.learner import LearnerGroup
from actors.reference import ReferenceActor
from actors.reward import RewardActor
from actors.rollout import RolloutActor
from actors.weight_sync import BroadcastSync
from pipelines.algos.advantages import group_advantages
from pipelines.algos.losses import LossSpec
from pipelines.algos.sampling import SamplingSpec, prompt_seeds
from pipelines.data.evaluate import greedy_complete
from pipelines.data.tasks import Arithmetic, reward_fields

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def local_ray():
    ray.init(include_dashboard=False, log_to_driver=False)  # sized from this machine
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def rollout(local_ray, tiny_model):
    actor = RolloutActor.options(num_cpus=0.5).remote(str(tiny_model[0]))
    yield actor
    ray.kill(actor)


@pytest.fixture(scope="module")
def problems():
    return Arithmetic().sample(8, "train", seed=3)


@pytest.fixture(scope="module")
def batch_ref(rollout, problems):
    return rollout.generate.remote([p.prompt for p in problems], 4, SamplingSpec(), 8, list(range(7, 7 + len(problems))))


@pytest.fixture(scope="module")
def buffer(local_ray):
    actor = ExperienceBuffer.options(num_cpus=0.05).remote()
    yield actor
    ray.kill(actor)


def _train(group, buffer, batch_ref, targets, minibatch_size, step=0, loss: LossSpec | None = None):
    """One update the way a run makes it: the experience goes into the buffer actor, and the
    learners fetch the minibatches it serves."""
    rows = ray.get(buffer.add.remote(step, batch_ref, targets))["rows"]
    minibatches = minibatch_refs(buffer, batch_ref, targets, rows, minibatch_size, 0, ranks=len(group.actors))
    return group.update("train_step", minibatches, loss or LossSpec())


def _targets(batch, scores):
    adv = group_advantages(torch.from_numpy(scores).double(), 4, "grpo").float().numpy()
    return {"advantages": (adv[:, None] * batch["response_mask"]).astype(np.float32)}


def test_rollout_returns_grouped_samples_with_logprobs(batch_ref, problems):
    batch = ray.get(batch_ref)
    n = len(problems) * 4
    assert batch["response_ids"].shape[0] == n and batch["behaviour_logprobs"].shape == batch["response_ids"].shape
    assert list(batch["prompt_index"]) == [i for i in range(len(problems)) for _ in range(4)]
    assert (batch["behaviour_logprobs"][batch["response_mask"] == 1] <= 0).all()
    assert (batch["behaviour_logprobs"][batch["response_mask"] == 0] == 0).all()
    assert all(t == problems[i].prompt for t, i in zip(batch["prompt_text"], batch["prompt_index"], strict=True))


def test_reward_actor_scores_each_row_against_its_prompts_answer(local_ray, batch_ref, problems):
    reward = RewardActor.options(num_cpus=0.1).remote([("exact_match", 1.0)], False, (0.0, 1.0))
    scores = ray.get(reward.score.remote(batch_ref, reward_fields(problems)))
    batch = ray.get(batch_ref)
    expected = [
        float(t.strip() == problems[i].answer) for t, i in zip(batch["response_text"], batch["prompt_index"], strict=True)
    ]
    np.testing.assert_array_equal(scores, expected)


def test_reference_logprobs_match_the_rollout_engine(local_ray, tiny_model, batch_ref):
    reference = ReferenceActor.options(num_cpus=0.5).remote(str(tiny_model[0]))
    ref = ray.get(reference.logprobs.remote(batch_ref))
    np.testing.assert_allclose(ref, ray.get(batch_ref)["behaviour_logprobs"], atol=1e-4)
    ray.kill(reference)


TRUNCATED = SamplingSpec(temperature=1.0, top_p=0.9, top_k=20)
# bf16 keeps 8 significant bits (each weight off by up to 2^-9 of itself); on the tiny model's samples the
# log-probs came out at most 0.009 apart (avx2 and avx512 kernels alike, median 1e-5)
BF16_LOGPROB_ERROR = 0.05


def test_learner_ratio_is_one_on_fresh_samples_under_top_p_and_top_k(local_ray, tiny_model, rollout, problems):
    """The sampling contract: with top_p 0.9 and top_k 20, the learner's log-probs of fresh samples
    equal the engine's behaviour log-probs token by token (ratio 1), because both are of the
    truncated, renormalised distribution. The full softmax (what the learner computed before, and
    what the reference still scores) gives ratio Z, the nucleus mass, below 1 (0.91 at worst on
    the warm-started tiny model of one machine, 0.975 on another, whose warm start came out more
    confident; a less confident model's Z falls under 1 - eps, the clipped branch): off 1 by far
    more than the tolerance the truncated ratio meets."""
    prompts = [p.prompt for p in problems]
    batch = ray.get(rollout.generate.remote(prompts, 4, TRUNCATED, 8, prompt_seeds(0, 0, len(prompts))))
    group = LearnerGroup.on_own_placement(LearnerSpec(str(tiny_model[0]), lr=1e-3, sampling=TRUNCATED), 1, 0.5)
    learner = group.run("logprobs", batch)[0]
    group.shutdown()
    mask = batch["response_mask"] == 1
    ratio = np.exp(learner - batch["behaviour_logprobs"])[mask]
    np.testing.assert_allclose(ratio, 1.0, atol=2e-4)
    reference = ReferenceActor.options(num_cpus=0.5).remote(str(tiny_model[0]))
    full = ray.get(reference.logprobs.remote(batch))
    ray.kill(reference)
    full_ratio = np.exp(full - batch["behaviour_logprobs"])[mask]
    assert full_ratio.min() < 0.99 and (full_ratio < 1 - 10 * 2e-4).mean() > 0.05, np.quantile(full_ratio, [0, 0.1, 0.5])
    assert full_ratio.max() <= 1 + 1e-4


def test_a_bfloat16_engine_samples_from_the_float32_policy_rounded(local_ray, tiny_model, problems):
    """`inference.dtype: bfloat16` beside a float32 learner: the engine holds the policy's weights
    rounded to bf16, so the learner's log-probs of its samples are off the behaviour log-probs by
    that rounding alone, which the loss's ratio (to the behaviour log-probs) carries. Off by more
    than a float32 engine's 2e-4 (above: the engine is bf16), by less than BF16_LOGPROB_ERROR."""
    prompts = [p.prompt for p in problems]
    engine = RolloutActor.options(num_cpus=0.5).remote(str(tiny_model[0]), dtype="bfloat16")
    batch = ray.get(engine.generate.remote(prompts, 4, SamplingSpec(), 8, prompt_seeds(0, 0, len(prompts))))
    ray.kill(engine)
    group = LearnerGroup.on_own_placement(LearnerSpec(str(tiny_model[0]), lr=1e-3), 1, 0.5)
    learner = group.run("logprobs", batch)[0]
    group.shutdown()
    error = np.abs(learner - batch["behaviour_logprobs"])[batch["response_mask"] == 1]
    assert 2e-4 < error.max() < BF16_LOGPROB_ERROR, np.quantile(error, [0.5, 0.9, 1])


def _sample_streams(rollout, seeds: list[int]) -> np.ndarray:
    """`[prompts, 4]` completions of one prompt repeated len(seeds) times, at temperature 2 (the
    warm-started tiny model is nearly certain at 1)."""
    batch = ray.get(rollout.generate.remote(["5+"] * len(seeds), 4, SamplingSpec(temperature=2.0), 12, seeds))
    return np.array(batch["response_text"], dtype=object).reshape(len(seeds), 4)


def test_samples_decoded_after_sampling_read_as_the_engine_decodes_them(tiny_model, problems):
    """The rollout decodes its samples after sampling, not vLLM as it samples: the same samples'
    texts are the engine's own, for those an EOS ended, those cut at `max_tokens`, and those a
    plain token (one the text would show) stopped, which the engine leaves out of the text."""
    texts = decoded_after_and_by_the_engine(tiny_model[0], [p.prompt for p in problems], 3, temperature=1.0)
    assert texts["ours"] == texts["engine"]
    assert any(texts["finished"]) and not all(texts["finished"]) and texts["stopped_on_plain"] > 0


def test_prompts_of_one_call_draw_independent_samples(rollout):
    """Eight copies of one prompt in one call: sample j of different copies agrees no more often
    than two different samples of the same copy do (both are independent draws of one
    distribution). One seed for every prompt, as raypo passed before, makes every copy's sample j
    identical; per-prompt seeds (`prompt_seeds`) do not."""

    def same_j_rate(streams):  # sample j of copy a == sample j of copy b, a != b
        return np.mean([streams[a, j] == streams[b, j] for a in range(8) for b in range(a) for j in range(4)])

    def within_rate(streams):  # sample i == sample j of one copy, i != j
        return np.mean([streams[a, i] == streams[a, j] for a in range(8) for i in range(4) for j in range(i)])

    shared = _sample_streams(rollout, [7] * 8)
    assert same_j_rate(shared) == 1.0  # the failure this guards against, shown with shared seeds
    independent = _sample_streams(rollout, prompt_seeds(0, 0, 8))
    # 112 cross-copy and 48 within-copy pairs; at temperature 2 two draws of 12 tokens rarely
    # coincide, so equal rates stay well inside this margin and shared noise (rate 1) is far outside it.
    assert same_j_rate(independent) <= within_rate(independent) + 0.25, (same_j_rate(independent), within_rate(independent))
    assert len(set(independent.ravel())) > 8


def test_buffer_serves_the_steps_minibatches_as_object_refs_the_caller_owns(buffer, batch_ref):
    batch = ray.get(batch_ref)
    n = len(batch["response_ids"])
    targets = {"advantages": np.arange(n, dtype=np.float32)[:, None] * batch["response_mask"]}
    assert ray.get(buffer.add.remote(5, batch_ref, targets))["rows"] == n
    assert ray.get(buffer.add.remote(5, batch_ref, targets))["rows"] == n  # a retried add replaces the step
    (refs,) = minibatch_refs(buffer, batch_ref, targets, n, 12, 0, 2)
    assert all(isinstance(r, ray.ObjectRef) for r in refs) and len(refs) == 2 * -(-n // 12)
    assert refs[len(refs) // 2 :] == refs[: len(refs) // 2]  # the second pass is the same objects, not copies
    parts = ray.get(refs[: len(refs) // 2])
    rows = np.concatenate([p.columns["advantages"][:, 0] for p in parts]).astype(int)
    assert sorted(rows) == list(range(n)) and list(rows) != list(range(n))  # one shuffled pass
    assert all(set(p.columns) == {*batch, "advantages"} and p.owned == p.rows for p in parts)
    assert [len(r) for r in minibatch_refs(buffer, batch_ref, targets, n, n, 0)] == [1]
    # three learner ranks: each gets a third of each minibatch's rows, consecutive ones, and the whole minibatch's counts
    per_rank = minibatch_refs(buffer, batch_ref, targets, n, 12, 0, ranks=3)
    assert [len(r) for r in per_rank] == [-(-n // 12)] * 3
    for shards in zip(*[ray.get(r) for r in per_rank], strict=True):
        mb = np.concatenate([s.columns["advantages"][:, 0] for s in shards]).astype(int)
        assert [s.owned for s in shards] == [len(part) for part in np.array_split(mb, 3)] and len(set(mb)) == len(mb)
        tokens = batch["response_mask"][mb].sum()
        assert all(s.rows == len(mb) and s.tokens == tokens for s in shards)
    # the caller owns the minibatches: they outlive the buffer that cut them
    short_lived = ExperienceBuffer.options(num_cpus=0.05).remote()
    (refs,) = minibatch_refs(short_lived, batch_ref, targets, n, 12, 0)
    ray.wait(refs, num_returns=len(refs), fetch_local=False)
    ray.kill(short_lived)
    assert sum(p.owned for p in ray.get(refs)) == n


def test_weight_sync_makes_rollout_greedy_equal_the_learner_model(local_ray, tiny_model, rollout, batch_ref, buffer):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    batch = ray.get(batch_ref)
    targets = _targets(batch, np.linspace(0, 1, len(batch["response_ids"])).astype(np.float32))
    group = LearnerGroup.on_own_placement(LearnerSpec(str(tiny_model[0]), lr=1e-3), 1, 0.5)
    before = ray.get(group.state_dict_ref())
    for _ in range(3):
        _train(group, buffer, batch_ref, targets, 16)
    weights_ref = group.state_dict_ref()
    after = ray.get(weights_ref)
    assert any(not np.array_equal(before[k], after[k]) for k in before), "the learner's parameters did not move"

    assert ray.get(rollout.update_weights.remote(weights_ref, 3)) == 3
    prompts = [p.prompt for p in Arithmetic().sample(32, "heldout", seed=11)]
    served = ray.get(rollout.greedy.remote(prompts, 8))
    model = AutoModelForCausalLM.from_pretrained(tiny_model[0])
    model.load_state_dict({k: torch.from_numpy(v) for k, v in after.items()})
    assert served == greedy_complete(model, AutoTokenizer.from_pretrained(tiny_model[0]), prompts, 8)
    group.shutdown()


@ray.remote(num_cpus=0)
class Gate:
    """Calls to `wait` return once `open` is called: work the test finishes when it chooses."""

    def __init__(self):
        self.opened = asyncio.Event()

    async def wait(self) -> None:
        await self.opened.wait()

    async def open(self) -> None:
        self.opened.set()


@ray.remote(num_cpus=0)
def _after(_done, value):
    return value  # Ray runs this once `_done` is: `value`, ready then


def test_an_update_beside_a_busy_engine_keeps_its_threads_and_takes_more_once_it_is_idle(
    local_ray, tiny_model, batch_ref, buffer
):
    """actors/learner.py:Widening: `beside` stands for calls queued behind the engines beside the
    learner (sampling ahead). Pending throughout, the update keeps its 1 thread; done before it
    starts, it has 2 from (about) the start; done between its two minibatches (the second is held back
    until the test opens the gate, which finishes `beside` too), the first trains on 1 and the
    second on 2. The metric is the update's threads averaged over its wall time."""
    batch = ray.get(batch_ref)
    targets = _targets(batch, np.linspace(0, 1, len(batch["response_ids"])).astype(np.float32))
    rows = ray.get(buffer.add.remote(0, batch_ref, targets))["rows"]
    first, second = minibatch_refs(buffer, batch_ref, targets, rows, rows // 2, 0)[0]
    group = LearnerGroup.on_own_placement(LearnerSpec(str(tiny_model[0]), lr=1e-3), 1, 0.5, threads=(1, 2))

    def update(minibatches, beside):
        refs = group.run_async("train_step", LossSpec(), beside, each=[minibatches])
        return refs[0]

    try:
        busy = Gate.remote()
        assert ray.get(update([first], [busy.wait.remote()]))["learner_threads"] == 1.0
        # done already, it may still read as pending at the update's first look (the rank asks the
        # ref's owner): then it widens at the first layer, after the shard's fetch
        assert ray.get(update([first], [ray.put(None)]))["learner_threads"] > 1.8
        engine_done = busy.wait.remote()
        running = update([first, _after.remote(engine_done, second)], [engine_done])
        time.sleep(1.0)  # the first minibatch trains (on 1 thread), then the update waits for the second
        ray.get(busy.open.remote())
        assert 1.0 < ray.get(running)["learner_threads"] < 2.0
    finally:
        group.shutdown()


def test_broadcast_weight_sync_from_a_zero3_world_reaches_two_engines(local_ray, tiny_model, batch_ref, buffer):
    """The collective path (NCCL on GPUs) run with gloo: learner rank 0 of a 2-rank ZeRO-3
    world broadcasts gathered weights; both engines then answer as the learner's model does."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    engines = [RolloutActor.options(num_cpus=0.1).remote(str(tiny_model[0])) for _ in range(2)]
    group = LearnerGroup.on_own_placement(LearnerSpec(str(tiny_model[0]), lr=1e-3, zero_stage=3), 2, 0.5)
    sync = BroadcastSync(group, engines, backend="gloo")
    batch = ray.get(batch_ref)
    targets = _targets(batch, np.linspace(0, 1, len(batch["response_ids"])).astype(np.float32))
    for _ in range(3):
        _train(group, buffer, batch_ref, targets, 16)
    sync.push(version=3)
    trained = ray.get(group.state_dict_ref())
    model = AutoModelForCausalLM.from_pretrained(tiny_model[0])
    start = {k: v.clone() for k, v in model.state_dict().items()}
    assert any(not torch.equal(start[k], torch.from_numpy(v)) for k, v in trained.items()), "weights did not move"
    model.load_state_dict({k: torch.from_numpy(v) for k, v in trained.items()})
    prompts = [p.prompt for p in Arithmetic().sample(32, "heldout", seed=12)]
    expected = greedy_complete(model, AutoTokenizer.from_pretrained(tiny_model[0]), prompts, 8)
    assert ray.get([e.weights_version.remote() for e in engines]) == [3, 3]
    assert ray.get([e.greedy.remote(prompts, 8) for e in engines]) == [expected, expected]
    group.shutdown()
    for engine in engines:
        ray.kill(engine)


@pytest.mark.parametrize("entropy_coef", [0.01, 0.0])
def test_two_learner_zero2_world_gives_the_same_update_as_one_learner(local_ray, tiny_model, batch_ref, buffer, entropy_coef):
    """Also with each rank's 16 rows cut into micro-batches of at most 7 (6 + 5 + 5): ZeRO-2
    reduces the gradients at each backward, and they add up to the same update. With an entropy
    bonus and without: the learner's log-probs take the fused LM head (actors/core/lm_head.py) in
    both (tests/test_learner_core.py checks that `_policy` does), with the entropy's gradient in one."""
    batch = ray.get(batch_ref)
    scores = (np.arange(len(batch["response_ids"])) % 3 == 0).astype(np.float32)
    targets = _targets(batch, scores)
    results = {}
    for world, stage, micro in ((1, 0, 0), (2, 2, 0), (2, 2, 7)):
        spec = LearnerSpec(str(tiny_model[0]), lr=1e-3, zero_stage=stage, micro_batch_size=micro)
        group = LearnerGroup.on_own_placement(spec, world, 0.5)
        metrics = _train(group, buffer, batch_ref, targets, 32, loss=LossSpec(entropy_coef=entropy_coef))
        results[world, micro] = (metrics, ray.get(group.state_dict_ref()))
        group.shutdown()
    m1, w1 = results[1, 0]
    w0 = load_file(str(tiny_model[0] / "model.safetensors"))
    for m2, w2 in (results[2, 0], results[2, 7]):
        assert m2["fetch_bytes"] == m1["fetch_bytes"] > 0  # each rank fetched its own rows only, not the whole minibatch
        assert m1["loss"] == pytest.approx(m2["loss"], rel=1e-4, abs=1e-6)
        assert m1["grad_norm"] == pytest.approx(m2["grad_norm"], rel=1e-3)
        # Adam's first step moves each weight by lr * g / (|g| + eps): about lr * sign(g), unless the
        # gradient is near eps (1e-8), where the two worlds' reduction orders move the step (a few
        # percent at |g| ~ eps; one embedding row of the tiny model without the entropy term) or
        # flip its sign (one element in 49k on one CI machine). So: none further apart than two
        # steps of lr, and almost every weight that took a full step within 1e-5.
        full_steps = 0
        for k in w1:
            diff, full = np.abs(w1[k] - w2[k]), np.abs(w1[k] - w0[k]) > 0.9e-3
            assert diff.max() <= 2e-3 and (diff[full] > 1e-5).mean() < 1e-3, (k, diff.max(), (diff[full] > 1e-5).sum())
            full_steps += full.sum()
        assert full_steps > 0.5 * sum(w.size for w in w1.values())  # most weights took a full step: the bound has teeth


def test_a_placement_the_cluster_cannot_give_is_named_and_freed(local_ray):
    from actors.common import ResourceFitError
    from actors.placement import Bundle, Placement

    before = set(ray.util.placement_group_table())
    with pytest.raises(ResourceFitError, match=r"not placed within 2 s: no node offers learner-0 \{'CPU': 64.0\}"):
        Placement([Bundle("learner-0", {"CPU": 64.0})], name="raypo:too-big", wait_s=2)
    made = {k: v for k, v in ray.util.placement_group_table().items() if k not in before}
    assert made and all(v["state"] == "REMOVED" for v in made.values()), made


@pytest.mark.parametrize("model, dtype", [("tiny", "float32"), ("smollm2", "float32"), ("tiny", "bfloat16")])
def test_in_place_reload_samples_as_vllms_own_reload(model, dtype, request):
    """`load_in_place` (CPU, without vLLM's layerwise machinery) against vLLM's `reload_weights` of
    the same weights into the same engine: the same seeded samples and log-probs, different from
    those before. The tiny model has its own LM head; SmolLM2 ties it to the embeddings and
    shares key/value heads. A load that leaves a layer out is refused and changes nothing. Loaded
    again after vLLM's reload, from the routes its first load worked out, it samples as before
    with the starting weights and as vLLM's reload with the moved ones. The engine samples with
    log-probs without compiling anything (pipelines/models/vllm_engine.py: `_rank_eagerly`;
    vLLM's compiled rank count took ~3 s at the first request). A bfloat16 engine (`inference.dtype`)
    takes the learner's float32 weights rounded, as vLLM's reload rounds them."""
    model_dir = request.getfixturevalue("tiny_model" if model == "tiny" else "smollm2")[0]
    prompts = [p.prompt for p in Arithmetic().sample(6, "heldout", seed=3)]
    got = reloaded_two_ways(model_dir, prompts, dtype)
    assert got["fast"] is True and got["partial"] is False and got["again"] is True and got["same_routes"] is True
    for reloaded in ("after_fast", "after_again"):  # the later in-place loads reuse the first's routes
        assert got[reloaded][0] == got["after_vllm"][0]
        np.testing.assert_allclose(got[reloaded][1], got["after_vllm"][1], rtol=0, atol=1e-5)
    assert got["back"][0] == got["before"][0]  # the starting weights, back through the same routes
    np.testing.assert_allclose(got["back"][1], got["before"][1], rtol=0, atol=1e-5)
    assert got["unchanged"] == got["after_fast"]
    assert got["before"][1] != got["after_fast"][1]
    assert got["compiled"] == 0


def test_in_place_reload_refuses_what_it_does_not_know_and_touches_nothing():
    """A replicated linear layer (a MoE gate's kind), a tensor of the wrong shape, or another
    architecture: `load_in_place` returns False with the weights as they were (vLLM's reload runs)."""
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod

    from pipelines.models.vllm_reload import load_in_place

    class LlamaForCausalLM(torch.nn.Module):  # the name is what load_in_place checks first
        def __init__(self):
            super().__init__()
            self.norm = torch.nn.LayerNorm(4, bias=False)
            # A stand-in with ReplicatedLinear's attributes (no input_size_per_partition): the real
            # layer needs vLLM's tensor-parallel group, which only an engine sets up.
            self.gate = torch.nn.Linear(4, 8, bias=False)
            self.gate.quant_method, self.gate.output_partition_sizes = UnquantizedLinearMethod(), [8]

    model = LlamaForCausalLM()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    assert not load_in_place(model, [("norm.weight", torch.full((4,), 2.0)), ("gate.weight", torch.ones(8, 4))])
    model.gate = torch.nn.Identity()
    assert not load_in_place(model, [("norm.weight", torch.full((5,), 2.0))])  # a copy would not broadcast it in
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert load_in_place(model, [("norm.weight", torch.full((4,), 2.0))])  # all it has, the right shape: loaded
    assert torch.equal(model.norm.weight, torch.full((4,), 2.0))

    class Other(LlamaForCausalLM):
        pass

    assert not load_in_place(Other(), [("norm.weight", torch.full((4,), 2.0))])
