"""actors/core/onednn.py: linear layers whose products run in oneDNN equal torch's, forward and
backward, checked against float64 autograd."""

import copy

import pytest
import torch
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM

from actors.core import onednn
from actors.core.onednn import OneDnnLinear, available, use_onednn

pytestmark = pytest.mark.skipif(not available(), reason="this torch has no oneDNN")


@pytest.fixture(autouse=True)
def _every_large_layer(monkeypatch):
    """`RAYPO_ONEDNN=1`: the layers these tests switch take oneDNN on any processor, Intel's too
    (where by default they stay with MKL: tested on its own below)."""
    monkeypatch.setenv("RAYPO_ONEDNN", "1")


def _onednn_calls(fn) -> int:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
    return sum(e.count for e in prof.key_averages() if e.key == "mkldnn::_linear_pointwise")


def _ran_onednn(fn) -> bool:
    return _onednn_calls(fn) > 0


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("shape", [(3, 45, 64), (7, 64), (1, 64), (2, 1, 64)])
@pytest.mark.parametrize("strided", [False, True])
def test_linear_equals_float64_autograd(bias, shape, strided):
    torch.manual_seed(0)
    exact = nn.Linear(64, 48, bias=bias).double()
    fast = copy.deepcopy(exact).float()
    assert use_onednn(fast, min_weight=0) == 1 and type(fast) is OneDnnLinear
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


@pytest.mark.parametrize("wanted", ["input", "weight", "bias"])
def test_only_some_gradients_wanted(wanted):
    torch.manual_seed(0)
    exact = nn.Linear(16, 8).double()
    fast = copy.deepcopy(exact).float()
    use_onednn(fast, min_weight=0)
    x64 = torch.randn(5, 16, dtype=torch.float64, requires_grad=wanted == "input")
    x = x64.detach().float().requires_grad_(wanted == "input")
    for layer in (exact, fast):
        layer.weight.requires_grad_(wanted == "weight")
        layer.bias.requires_grad_(wanted == "bias")
    exact(x64).square().sum().backward()
    calls = _onednn_calls(lambda: fast(x).square().sum().backward())
    assert calls == (1 if wanted == "bias" else 2)  # the forward, and only the product asked for
    got, expected = {"input": (x, x64), "weight": (fast.weight, exact.weight), "bias": (fast.bias, exact.bias)}[wanted]
    torch.testing.assert_close(got.grad.double(), expected.grad, rtol=1e-5, atol=1e-5)
    others = [t for t in (x, fast.weight, fast.bias) if t is not got]
    assert all(t.grad is None for t in others)


def test_a_broadcast_gradient_an_in_place_op_and_a_vector_input():
    torch.manual_seed(0)
    exact = nn.Linear(16, 8).double()
    fast = copy.deepcopy(exact).float()
    use_onednn(fast, min_weight=0)
    x64 = torch.randn(2, 3, 16, dtype=torch.float64, requires_grad=True)
    x = x64.detach().float().requires_grad_(True)
    # y.sum(): the gradient arrives as an expanded (stride 0) tensor; add_ after: legal, as for nn.Linear
    exact(x64).add_(1.0).sum().backward()
    fast(x).add_(1.0).sum().backward()
    torch.testing.assert_close(x.grad.double(), x64.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(fast.weight.grad.double(), exact.weight.grad, rtol=1e-5, atol=1e-5)
    vector = torch.randn(16)
    torch.testing.assert_close(fast(vector).double(), exact(vector.double()), rtol=0, atol=1e-5)


def test_the_weight_gradient_over_the_copy_limit_goes_through_mkl(monkeypatch):
    torch.manual_seed(0)
    exact = nn.Linear(16, 8).double()
    fast = copy.deepcopy(exact).float()
    use_onednn(fast, min_weight=0)
    x = torch.randn(6, 16)
    exact(x.double()).square().sum().backward()
    monkeypatch.setattr(onednn, "WEIGHT_GRAD_COPY_LIMIT", 6 * 8 - 1)  # one element fewer than dy's
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fast(x).square().sum().backward()
    names = [e.key for e in prof.key_averages()]
    assert "aten::mm" in names and "mkldnn::_linear_pointwise" in names
    torch.testing.assert_close(fast.weight.grad.double(), exact.weight.grad, rtol=1e-5, atol=1e-5)


def test_small_layers_stay_with_torch(monkeypatch):
    """Layers under `MIN_WEIGHT` weights keep `nn.Linear` (MKL): a new row count costs a small
    layer more in oneDNN's kernel build than its product gains. The threshold is read at the call."""
    model = nn.Sequential(nn.Linear(256, 256), nn.Linear(256, 255), nn.Linear(64, 8))
    assert onednn.MIN_WEIGHT == 256 * 256
    assert use_onednn(model) == 1 and [type(m) for m in model] == [OneDnnLinear, nn.Linear, nn.Linear]
    monkeypatch.setattr(onednn, "MIN_WEIGHT", 64 * 8)
    assert use_onednn(model) == 2 and [type(m) for m in model] == [OneDnnLinear] * 3
    x = torch.randn(5, 64)
    assert _ran_onednn(lambda: model[2](x))


def test_the_switch_is_off_with_raypo_onednn_0(monkeypatch):
    monkeypatch.setenv("RAYPO_ONEDNN", "0")
    layer = nn.Linear(4, 2)
    assert not available() and use_onednn(layer, min_weight=0) == 0 and type(layer) is nn.Linear


def test_a_bad_raypo_onednn_names_the_choices(monkeypatch):
    monkeypatch.setenv("RAYPO_ONEDNN", "yes")
    with pytest.raises(ValueError, match=r"RAYPO_ONEDNN='yes'.*0 \(MKL everywhere\), 1 .* or auto"):
        use_onednn(nn.Linear(4, 2))


@pytest.mark.parametrize("intel", [True, False])
def test_by_default_large_layers_take_onednn_off_intel(monkeypatch, intel):
    """Unset (`auto`), a large layer takes oneDNN unless the processor is Intel's, where MKL runs its
    own kernels (on this session's Intel Xeon, 1.1-1.4x faster a layer). The vendor is replaced:
    which processor runs the test is not the test's to choose."""
    monkeypatch.delenv("RAYPO_ONEDNN")
    monkeypatch.setattr(onednn, "intel_cpu", lambda: intel)

    def model():
        return nn.Sequential(nn.Linear(256, 256), nn.Linear(256, 256), nn.Linear(64, 8))

    by_default, forced = model(), model()
    large = [OneDnnLinear] * 2 + [nn.Linear]
    assert use_onednn(by_default) == (0 if intel else 2)
    assert [type(m) for m in by_default] == ([nn.Linear] * 3 if intel else large)
    monkeypatch.setenv("RAYPO_ONEDNN", "1")
    assert use_onednn(forced) == 2 and [type(m) for m in forced] == large, "RAYPO_ONEDNN=1: oneDNN on any processor"


@pytest.mark.parametrize("vendor", ["GenuineIntel", "AuthenticAMD", "HygonGenuine"])
def test_the_vendor_is_read_off_cpuinfo(tmp_path, vendor):
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text(f"processor\t: 0\nvendor_id\t: {vendor}\ncpu family\t: 6\n")
    assert onednn.intel_cpu(str(cpuinfo)) == (vendor == "GenuineIntel")


def test_other_dtypes_and_empty_inputs_go_through_torch():
    layer = nn.Linear(16, 8).bfloat16()
    assert use_onednn(layer, min_weight=0) == 1
    x = torch.randn(4, 16, dtype=torch.bfloat16)
    assert not _ran_onednn(lambda: layer(x))
    assert torch.equal(layer(x), nn.functional.linear(x, layer.weight, layer.bias))
    assert layer.float()(torch.randn(0, 16)).shape == (0, 8)
    x = torch.randn(4, 16)
    with torch.autocast("cpu", dtype=torch.bfloat16):  # as nn.Linear: bf16 under autocast
        assert not _ran_onednn(lambda: layer(x)) and layer(x).dtype == torch.bfloat16


def test_a_switched_model_keeps_its_state_and_its_gradients():
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2
    )
    exact = LlamaForCausalLM(config).double()
    fast = copy.deepcopy(exact).float()
    linears = sum(type(m) is nn.Linear for m in fast.modules())
    assert use_onednn(fast, min_weight=0) == linears == 2 * 7 + 1  # q k v o gate up down per layer, the LM head
    assert fast.state_dict().keys() == exact.state_dict().keys()
    ids = torch.randint(0, 50, (3, 11))
    weights = torch.randn(3, 11, 50, dtype=torch.float64)
    expected = exact(ids).logits  # float64 throughout
    (expected * weights).sum().backward()
    fast.gradient_checkpointing_enable()  # the layers' forward runs again in the backward
    fast.train()
    logits = fast(ids).logits
    (logits * weights.float()).sum().backward()
    torch.testing.assert_close(logits.double(), expected.detach(), rtol=0, atol=1e-5)
    for (name, p), q in zip(fast.named_parameters(), exact.parameters(), strict=True):
        torch.testing.assert_close(p.grad.double(), q.grad, rtol=1e-4, atol=1e-5, msg=name)
