"""actors/core/onednn.py: linear layers whose products run in oneDNN equal torch's, forward and
backward, checked against float64 autograd."""

import copy

import pytest
import torch
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM

from actors.core.onednn import OneDnnLinear, available, use_onednn

pytestmark = pytest.mark.skipif(not available(), reason="this torch has no oneDNN")


def _ran_onednn(fn) -> bool:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
    return any(e.key == "mkldnn::_linear_pointwise" for e in prof.key_averages())


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("shape", [(3, 45, 64), (7, 64), (1, 64), (2, 1, 64)])
@pytest.mark.parametrize("strided", [False, True])
def test_linear_equals_float64_autograd(bias, shape, strided):
    torch.manual_seed(0)
    exact = nn.Linear(64, 48, bias=bias).double()
    fast = copy.deepcopy(exact).float()
    assert use_onednn(fast) == 1 and type(fast) is OneDnnLinear
    x64 = torch.randn(*shape, dtype=torch.float64, requires_grad=True)
    x = x64.detach().float()
    if strided:  # every other column of a wider array, as a view
        x = torch.stack([x, torch.zeros_like(x)], -1).flatten(-2)[..., ::2]
        assert not x.is_contiguous() and torch.equal(x, x64.detach().float())
    x.requires_grad_(True)
    weights = torch.randn(*shape[:-1], 48, dtype=torch.float64)
    (exact(x64) * weights).sum().backward()
    y = fast(x)
    assert _ran_onednn(lambda: fast(x.detach()))
    (y * weights.float()).sum().backward()
    assert y.shape == (*shape[:-1], 48)
    # float32 products of 64 terms: ~1e-6 relative to the values' scale
    torch.testing.assert_close(y.double(), exact(x64).detach(), rtol=0, atol=2e-5)
    torch.testing.assert_close(x.grad.double(), x64.grad, rtol=0, atol=2e-5)
    torch.testing.assert_close(fast.weight.grad.double(), exact.weight.grad, rtol=1e-5, atol=1e-4)
    if bias:
        torch.testing.assert_close(fast.bias.grad.double(), exact.bias.grad, rtol=1e-5, atol=1e-4)


def test_only_the_input_or_only_the_weight_needs_a_gradient():
    torch.manual_seed(0)
    layer = nn.Linear(16, 8)
    exact = copy.deepcopy(layer)
    use_onednn(layer)
    x = torch.randn(5, 16, requires_grad=True)
    layer.requires_grad_(False)
    exact.requires_grad_(False)
    layer(x).sum().backward()
    expected = x.grad.clone()
    x.grad = None
    exact(x).sum().backward()
    torch.testing.assert_close(expected, x.grad)
    layer.requires_grad_(True)
    layer(x.detach()).square().sum().backward()  # no input gradient asked for
    assert layer.weight.grad is not None and layer.weight.grad.shape == (8, 16)


def test_other_dtypes_and_empty_inputs_go_through_torch():
    layer = nn.Linear(16, 8).bfloat16()
    use_onednn(layer)
    x = torch.randn(4, 16, dtype=torch.bfloat16)
    assert not _ran_onednn(lambda: layer(x))
    assert torch.equal(layer(x), nn.functional.linear(x, layer.weight, layer.bias))
    assert layer.float()(torch.randn(0, 16)).shape == (0, 8)


def test_a_switched_model_keeps_its_state_and_its_gradients():
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2
    )
    exact = LlamaForCausalLM(config).double()
    fast = copy.deepcopy(exact).float()
    linears = sum(type(m) is nn.Linear for m in fast.modules())
    assert use_onednn(fast) == linears == 2 * 7 + 1  # q k v o gate up down per layer, the LM head
    assert fast.state_dict().keys() == exact.state_dict().keys()
    ids = torch.randint(0, 50, (3, 11))
    weights = torch.randn(3, 11, 50, dtype=torch.float64)
    expected = exact(ids).logits  # float64 throughout
    (expected * weights).sum().backward()
    logits = fast(ids).logits
    (logits * weights.float()).sum().backward()
    torch.testing.assert_close(logits.double(), expected.detach(), rtol=0, atol=1e-5)
    for (name, p), q in zip(fast.named_parameters(), exact.parameters(), strict=True):
        torch.testing.assert_close(p.grad.double(), q.grad, rtol=1e-4, atol=1e-5, msg=name)
