"""The policy's response logits: only the positions that predict a response token go through the
LM head, and what comes out equals the full forward pass sliced by hand."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from actors.core.modeling import (
    along_response,
    packed_token_logprobs,
    response_logits,
    sequence_tensors,
    shares_prompts,
    takes_logits_to_keep,
)
from actors.core.onednn import use_onednn
from pipelines.algos.losses import logprobs_from_logits, token_logprobs
from pipelines.algos.sampling import SamplingSpec, token_logprobs_and_entropy


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=50,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        max_position_embeddings=32,
    )
    return LlamaForCausalLM(config).eval()


@pytest.fixture(scope="module")
def inputs():
    rng = np.random.default_rng(0)
    batch = {  # left-padded prompts of 2-4 tokens, right-padded responses of 1-3
        "prompt_ids": rng.integers(1, 50, (3, 4)),
        "prompt_mask": np.array([[1, 1, 1, 1], [0, 0, 1, 1], [0, 1, 1, 1]]),
        "response_ids": rng.integers(1, 50, (3, 3)),
        "response_mask": np.array([[1, 1, 1], [1, 0, 0], [1, 1, 0]]),
    }
    return sequence_tensors(batch, np.arange(3))


class NoLogitsToKeep(torch.nn.Module):
    """A causal LM whose forward has no `logits_to_keep` (older or custom models)."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, input_ids, attention_mask, position_ids):
        return self.inner(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_response_logits_equal_the_full_forward_sliced_by_hand(model, inputs, temperature):
    with torch.no_grad():
        full = model(
            input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"], position_ids=inputs["position_ids"]
        ).logits  # [3, 7, 50]
        expected = full[:, 3:6] / temperature  # prompt width 4: positions 3, 4, 5 predict response tokens 0, 1, 2
        assert takes_logits_to_keep(model) and not takes_logits_to_keep(NoLogitsToKeep(model))
        kept = response_logits(model, inputs, temperature)
        sliced = response_logits(NoLogitsToKeep(model), inputs, temperature)
    assert kept.shape == (3, 3, 50)
    torch.testing.assert_close(kept, expected, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(sliced, expected, rtol=1e-6, atol=1e-6)  # one column fewer than `full`: another GEMM shape


@pytest.mark.parametrize("spec", [SamplingSpec(), SamplingSpec(top_p=0.8), SamplingSpec(top_k=5, temperature=0.9)])
def test_an_entropy_without_a_graph_has_the_same_value_and_leaves_the_gradients_alone(model, inputs, spec):
    logits = response_logits(model, inputs, spec.temperature)
    ids = inputs["response_ids"]
    logp, full, entropy = token_logprobs_and_entropy(logits, ids, spec, entropy_grad=True)
    logp0, full0, entropy0 = token_logprobs_and_entropy(logits, ids, spec, entropy_grad=False)
    assert entropy.requires_grad and not entropy0.requires_grad
    # without truncation and without an entropy graph the log-probs come from `token_logprobs`
    # (fewer passes over the logits): the same numbers up to float32 rounding
    exact = {"rtol": 0, "atol": 0} if spec.truncates else {"rtol": 1e-6, "atol": 1e-6}
    torch.testing.assert_close(entropy0, entropy.detach(), **exact)
    torch.testing.assert_close(logp0, logp, **exact)
    # the policy-gradient term's gradient is the same whether or not an entropy graph was built
    (grad_with,) = torch.autograd.grad(logp.sum() + 0.0 * entropy.sum(), logits, retain_graph=True)
    (grad_without,) = torch.autograd.grad(logp0.sum(), logits)
    torch.testing.assert_close(grad_without, grad_with, **exact)


@pytest.mark.parametrize("widths", [(4, 3), (4, 1)])
def test_a_prompt_a_group_shares_runs_once_with_the_same_logits_and_gradients(model, widths):
    """Six samples of two prompts (one left-padded), interleaved, responses of 3 tokens and of 1:
    the prompt pass runs over the 2 distinct prompts and the response pass attends to their
    copied keys and values; logits and every parameter's gradient equal one full pass's."""
    P, T = widths
    rng = np.random.default_rng(1)
    prompt_ids, prompt_mask = rng.integers(1, 50, (2, P)), np.array([[0, 1, 1, 1], [1, 1, 1, 1]])
    rows = np.array([0, 1, 0, 1, 1, 0])
    response_mask = np.array([[1, 1, 1], [1, 0, 0], [1, 1, 0], [1, 1, 1], [1, 1, 0], [1, 0, 0]])[:, :T]
    batch = {
        "prompt_ids": prompt_ids[rows],
        "prompt_mask": prompt_mask[rows],
        "response_ids": rng.integers(1, 50, (6, T)),
        "response_mask": response_mask,
    }
    inputs = sequence_tensors(batch, np.arange(6))
    weights = torch.from_numpy(rng.standard_normal((6, T, 50))).float()
    passes, embedded = [], []  # the token shapes the model runs on and embeds, recorded by hooks that change nothing
    hooks = [
        model.model.layers[0].register_forward_hook(lambda _m, args, _out: passes.append(tuple(args[0].shape[:2]))),
        model.model.embed_tokens.register_forward_hook(lambda _m, args, _out: embedded.append(tuple(args[0].shape))),
    ]
    try:
        assert shares_prompts(model)
        shared = response_logits(model, inputs, 1.0)
    finally:
        for hook in hooks:
            hook.remove()
    # the response pass leaves out the last response token (it predicts nothing that is read);
    assert passes == ([(2, P), (6, T - 1)] if T > 1 else [(2, P)])
    assert embedded == passes
    full = model(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"], position_ids=inputs["position_ids"])
    expected = full.logits[:, P - 1 : P - 1 + T]
    torch.testing.assert_close(shared, expected, rtol=1e-5, atol=1e-5)
    params = [p for p in model.parameters()]
    got = torch.autograd.grad((shared * weights).sum(), params, allow_unused=True)
    want = torch.autograd.grad((expected * weights).sum(), params, allow_unused=True)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5)


class RenamedLlama(LlamaForCausalLM):
    """The same model under a name `PACKABLE_LMS` does not list: log-probs take the two passes."""


def _log_probs(model, inputs, temperature):
    return along_response(model, inputs, temperature, lambda logits, ids: (logprobs_from_logits(logits, ids),))[0]


def _three_prompts(T: int) -> dict:
    """8 rows of 3 prompts (2, 4 and 3 real tokens of 4; the last has one row), interleaved, with
    responses of 0 to 3 tokens of T."""
    rng = np.random.default_rng(2)
    prompt_ids, prompt_mask = rng.integers(1, 50, (3, 4)), np.array([[0, 0, 1, 1], [1, 1, 1, 1], [0, 1, 1, 1]])
    rows = np.array([0, 1, 0, 1, 1, 0, 0, 2])
    response_mask = np.array([[1, 1, 1], [1, 0, 0], [1, 1, 0], [1, 1, 1], [0, 0, 0], [1, 0, 0], [1, 1, 1], [1, 1, 0]])[:, :T]
    batch = {
        "prompt_ids": prompt_ids[rows],
        "prompt_mask": prompt_mask[rows],
        "response_ids": rng.integers(1, 50, (8, T)) * response_mask,
        "response_mask": response_mask,
    }
    return sequence_tensors(batch, np.arange(8))


@pytest.fixture(params=["one padded call", "a call per sequence"])
def attention_calls(request, monkeypatch):
    """The packed pass's two attention layouts: these tests' sequences (4-7 tokens) share one padded
    call under `PADDED_ATTENTION_LENGTH`; at 0 each sequence gets its own (as longer ones do)."""
    from actors.core import modeling

    if request.param == "a call per sequence":
        monkeypatch.setattr(modeling, "PADDED_ATTENTION_LENGTH", 0)
    return request.param


def _assert_attention_calls(model, inputs, attention_calls):
    from actors.core import modeling

    assert (modeling._packed_sequences(model, inputs).padded is not None) is (attention_calls == "one padded call")


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
@pytest.mark.parametrize(("T", "temperature"), [(3, 1.0), (3, 0.7), (1, 1.0)])
def test_packed_prompts_and_responses_give_the_full_passes_log_probs_and_gradients(
    model, attention, T, temperature, attention_calls
):
    """`along_response` on rows whose prompts repeat: each distinct prompt and the responses that
    share it run as one packed sequence (one pass, no padding), with a prompt of one row and an
    empty response among them; the log-probs of the real response tokens and every parameter's
    gradient equal one full pass per row, 0 at padding. A model outside `PACKABLE_LMS` takes the
    two passes and gets the same."""
    inputs = _three_prompts(T)
    packable = LlamaForCausalLM(LlamaConfig(**{**model.config.to_dict(), "attn_implementation": attention})).eval()
    packable.load_state_dict(model.state_dict())
    assert packable.config._attn_implementation == attention
    _assert_attention_calls(packable, inputs, attention_calls)
    renamed = RenamedLlama(model.config).eval()
    renamed.load_state_dict(model.state_dict())
    passes = []
    hook = packable.model.layers[0].register_forward_hook(lambda _m, args, _out: passes.append(tuple(args[0].shape[:2])))
    try:
        packed = _log_probs(packable, inputs, temperature)
    finally:
        hook.remove()
    # one pass over one row of 3 sequences, each a prompt and its responses but for their last tokens,
    # no padding: 2 + (2 + 1 + 2 + 0), 4 + (0 + 2 + 0), 3 + 1 tokens; the prompts alone (2 + 4 + 3) when T is 1
    assert passes == [(1, 17 if T == 3 else 9)]
    assert packable.config._attn_implementation == attention  # the packed attention was the pass's only
    two_passes = _log_probs(renamed, inputs, temperature)
    full = packable(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"], position_ids=inputs["position_ids"])
    expected = torch.log_softmax(full.logits[:, 3 : 3 + T] / temperature, dim=-1)  # prompt width 4
    expected = expected.gather(-1, inputs["response_ids"][..., None])[..., 0]
    mask = inputs["response_mask"].float()
    torch.testing.assert_close(packed * mask, expected * mask, rtol=1e-5, atol=1e-5)
    assert torch.all(packed[mask == 0] == 0)
    torch.testing.assert_close(two_passes * mask, expected * mask, rtol=1e-5, atol=1e-5)
    weights = torch.from_numpy(np.random.default_rng(3).standard_normal((8, T))).float() * mask
    got = torch.autograd.grad((packed * weights).sum(), list(packable.parameters()), allow_unused=True)
    want = torch.autograd.grad((expected * weights).sum(), list(packable.parameters()), allow_unused=True)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("fused", [False, True])
def test_packed_grouped_query_attention_gives_the_full_passes_log_probs_and_gradients(model, fused, attention_calls):
    """Grouped-query attention (4 query heads sharing 2 key-value heads, as SmolLM2's 9 share 3):
    the packed pass's attention takes the grouped heads as they are; the log-probs, on the logits
    path and through the fused LM head, and every parameter's gradient equal one full pass per row."""
    torch.manual_seed(11)
    config = LlamaConfig(**{**model.config.to_dict(), "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 4})
    packable = LlamaForCausalLM(config).eval()
    assert packable.model.layers[0].self_attn.num_key_value_groups == 2
    inputs = _three_prompts(3)
    _assert_attention_calls(packable, inputs, attention_calls)
    if fused:
        packed = packed_token_logprobs(packable, inputs, 1.0)[0]
    else:
        passes = []
        hook = packable.model.layers[0].register_forward_hook(lambda _m, args, _out: passes.append(tuple(args[0].shape[:2])))
        try:
            packed = _log_probs(packable, inputs, 1.0)
        finally:
            hook.remove()
        assert passes == [(1, 17)]  # the packed row
    full = packable(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"], position_ids=inputs["position_ids"])
    expected = torch.log_softmax(full.logits[:, 3:6], dim=-1).gather(-1, inputs["response_ids"][..., None])[..., 0]
    mask = inputs["response_mask"].float()
    torch.testing.assert_close(packed * mask, expected * mask, rtol=1e-5, atol=1e-5)
    weights = torch.from_numpy(np.random.default_rng(12).standard_normal((8, 3))).float() * mask
    got = torch.autograd.grad((packed * weights).sum(), list(packable.parameters()))
    want = torch.autograd.grad((expected * weights).sum(), list(packable.parameters()))
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5)


def test_rows_are_not_packed_where_it_would_not_fit_or_apply(model, monkeypatch):
    """No packing (None: the two passes run) when the masks would be too large, under a sliding
    window shorter than a packed sequence, with no response token at all, under gradient
    checkpointing with a graph (its backward would run the attention outside the packed pass's);
    packing where the window is long enough, and under checkpointing without a graph."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from actors.core import modeling

    inputs = _three_prompts(3)
    assert modeling._packed_response_logits(model, inputs, 1.0) is not None
    empty = {**inputs, "response_mask": torch.zeros_like(inputs["response_mask"])}
    assert modeling._packed_response_logits(model, empty, 1.0) is None
    small = {k: v for k, v in model.config.to_dict().items() if k in ("vocab_size", "hidden_size", "intermediate_size")}
    for window, packs in [(6, False), (7, True), (64, True)]:  # the longest sequence is 7 tokens (the row, 17)
        qwen = Qwen2ForCausalLM(
            Qwen2Config(
                **small,
                num_hidden_layers=1,
                num_attention_heads=2,
                num_key_value_heads=2,
                use_sliding_window=True,
                sliding_window=window,
            )
        )
        assert (modeling._packed_response_logits(qwen, inputs, 1.0) is not None) is packs
    checkpointing = LlamaForCausalLM(model.config)
    checkpointing.gradient_checkpointing_enable()
    assert modeling._packed_response_logits(checkpointing, inputs, 1.0) is None
    with torch.no_grad():
        assert modeling._packed_response_logits(checkpointing, inputs, 1.0) is not None
    monkeypatch.setattr(modeling, "PACKED_MASK_ELEMENTS", 7 * 7 + 6 * 6 + 4 * 4)  # the three sequences' masks
    assert modeling._packed_response_logits(model, inputs, 1.0) is not None
    monkeypatch.setattr(modeling, "PACKED_MASK_ELEMENTS", 7 * 7 + 6 * 6 + 4 * 4 - 1)
    assert modeling._packed_response_logits(model, inputs, 1.0) is None


@pytest.mark.parametrize("use", ["per position", "summed", "shared"])
def test_rows_taken_beside_the_logits_get_the_gradient_of_plain_indexing(use):
    """`_WithRows` (the packed path's logits and the rows that predict first tokens, one row taken
    several times) against autograd's own indexing: the same values and the same gradient, whether
    the logits' gradient comes as a tensor of its own (`per position`), expanded (`summed`), or as
    the one tensor an addition hands to both its inputs (`shared`: the other input's gradient stays
    its own)."""
    from actors.core.modeling import _WithRows

    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 5, 7, generator=gen, dtype=torch.float64, requires_grad=True)
    seqs, cols = torch.tensor([0, 0, 1, 0]), torch.tensor([1, 1, 3, 4])  # row (0, 1) taken twice
    weights = torch.randn(2, 5, 7, generator=gen, dtype=torch.float64)
    row_weights = torch.randn(4, 7, generator=gen, dtype=torch.float64)
    other = torch.randn(2, 5, 7, generator=gen, dtype=torch.float64, requires_grad=True)
    shifted = other * 1.0  # made before the Function: its backward runs after `_WithRows`'

    def loss(whole: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        per_position = {"per position": lambda: (whole * weights).sum(), "summed": whole.sum}
        per_position["shared"] = lambda: ((whole + shifted) * weights).sum()
        return per_position[use]() + (rows.exp() * row_weights).sum()

    alias, rows = _WithRows.apply(logits, seqs, cols)
    torch.testing.assert_close(rows, logits[seqs, cols])
    assert alias.data_ptr() == logits.data_ptr()
    got = torch.autograd.grad(loss(alias, rows), (logits, other), allow_unused=True, retain_graph=True)
    want = torch.autograd.grad(loss(logits, logits[seqs, cols]), (logits, other), allow_unused=True, retain_graph=True)
    torch.testing.assert_close(got[0], want[0], rtol=0, atol=1e-12)
    if use == "shared":
        torch.testing.assert_close(got[1], weights, rtol=0, atol=0)


@pytest.mark.parametrize("spec", [SamplingSpec(top_p=0.5), SamplingSpec(top_k=3, temperature=0.7), SamplingSpec()])
def test_packed_sampling_log_probs_and_a_graphed_entropy_equal_the_two_passes(model, spec, attention_calls):
    """The learner's `per_part` (pipelines/algos/sampling.py: truncated log-probs, the full
    softmax's, an entropy with a graph), which reads the logits more than once, on the packed
    path and on the two passes: the same three values at the response tokens and the same
    gradients of every parameter."""
    inputs = _three_prompts(3)
    packable = LlamaForCausalLM(model.config).eval()
    packable.load_state_dict(model.state_dict())
    renamed = RenamedLlama(model.config).eval()
    renamed.load_state_dict(model.state_dict())
    mask = inputs["response_mask"].float()
    weights = torch.from_numpy(np.random.default_rng(4).standard_normal((3, 8, 3))).float() * mask

    def run(m):
        out = along_response(m, inputs, spec.temperature, lambda logits, ids: token_logprobs_and_entropy(logits, ids, spec, True))
        loss = sum(((o * w).sum() for o, w in zip(out, weights, strict=True)), torch.zeros(()))
        return out, torch.autograd.grad(loss, list(m.parameters()), allow_unused=True)

    (packed, packed_grads), (two, two_grads) = run(packable), run(renamed)
    for got, want in zip(packed, two, strict=True):
        torch.testing.assert_close(got * mask, want * mask, rtol=1e-5, atol=1e-5)
    for got, want in zip(packed_grads, two_grads, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
@pytest.mark.parametrize(
    ("tied", "temperature", "product"),
    [(False, 1.0, "torch"), (True, 0.7, "torch"), (True, 1.0, "oneDNN"), (False, 0.7, "oneDNN")],
)
def test_the_fused_head_gives_the_packed_logits_log_probs_entropies_and_gradients(
    model, attention, tied, temperature, product, monkeypatch
):
    """`packed_token_logprobs` (the decoder's last hidden state through the fused LM head,
    actors/core/lm_head.py) against `along_response` with `token_logprobs` on the packed logits:
    the same log-probs and entropies at the response tokens, 0 at padding, and the same gradient
    of every parameter (a tied embedding's two uses summed), of the log-probs and, for an entropy
    bonus, of the entropies too. None where the rows would not pack
    and where the head has a bias."""
    torch.manual_seed(5)
    config = LlamaConfig(**{**model.config.to_dict(), "attn_implementation": attention, "tie_word_embeddings": tied})
    packable = LlamaForCausalLM(config).eval()
    assert (packable.lm_head.weight is packable.model.embed_tokens.weight) is tied
    if product == "oneDNN":
        monkeypatch.setenv("RAYPO_ONEDNN", "1")  # on any processor, Intel's too (where MKL is the default)
        switched = use_onednn(packable, min_weight=0)
        if not switched:
            pytest.skip("this torch has no oneDNN linear op")
    inputs = _three_prompts(3)
    mask = inputs["response_mask"].float()
    weights = torch.from_numpy(np.random.default_rng(6).standard_normal((8, 3))).float() * mask
    fused_logp, fused_entropy = packed_token_logprobs(packable, inputs, temperature, with_entropy=True)
    logp, entropy = along_response(packable, inputs, temperature, lambda logits, ids: token_logprobs(logits, ids, True))
    torch.testing.assert_close(fused_logp * mask, logp * mask, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(fused_entropy * mask, entropy * mask, rtol=1e-5, atol=1e-5)
    assert torch.all(fused_logp[mask == 0] == 0) and torch.all(fused_entropy[mask == 0] == 0)
    params = list(packable.parameters())
    got = torch.autograd.grad((fused_logp * weights).sum(), params, allow_unused=True)
    want = torch.autograd.grad((logp * weights).sum(), params, allow_unused=True)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5)
    # an entropy bonus: the entropies' gradient too, against the logits path's entropy with a graph
    bonus = torch.from_numpy(np.random.default_rng(7).standard_normal((8, 3))).float() * mask
    fused_logp, fused_entropy = packed_token_logprobs(packable, inputs, temperature, with_entropy=True, entropy_grad=True)
    sampling = SamplingSpec(temperature=temperature)
    logp, _, entropy = along_response(
        packable, inputs, temperature, lambda logits, ids: token_logprobs_and_entropy(logits, ids, sampling, True)
    )
    torch.testing.assert_close(fused_entropy * mask, entropy * mask, rtol=1e-5, atol=1e-5)
    got = torch.autograd.grad((fused_logp * weights + fused_entropy * bonus).sum(), params, allow_unused=True)
    want = torch.autograd.grad((logp * weights + entropy * bonus).sum(), params, allow_unused=True)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5)
    renamed = RenamedLlama(config).eval()
    assert packed_token_logprobs(renamed, inputs, temperature) is None
    packable.lm_head = torch.nn.Linear(config.hidden_size, config.vocab_size)
    assert packed_token_logprobs(packable, inputs, temperature) is None
