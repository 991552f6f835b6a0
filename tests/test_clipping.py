"""Gradient clipping inside the fused optimizer step (actors/core/clipping.py) against torch's
`clip_grad_norm_` and a plain (not fused) optimizer step in float64, for each optimizer a learner
or critic can have."""

import math

import numpy as np
import pytest
import torch

from actors.core.clipping import clip_in_step, global_norm

SHAPES = [(64, 48), (48,), (200, 3), (1,)]


def _params(seed: int, dtype=torch.float32) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=gen).to(dtype)) for s in SHAPES]


def _optimizer(kind: str, params, fused: bool):
    if kind == "adam_l2":  # the learner with training.l2_coef: Adam's weight decay joins the gradient
        return torch.optim.Adam(params, lr=0.5, weight_decay=0.1, fused=fused or None)
    return torch.optim.AdamW(params, lr=0.5, weight_decay=0.0, fused=fused or None)  # the learner's and the critic's


@pytest.mark.parametrize("kind", ["adamw", "adam_l2"])
@pytest.mark.parametrize("grad_clip", [0.0, 0.5, 1e6])  # off, biting, not biting
def test_a_step_clipped_inside_equals_clip_grad_norm_then_a_plain_step(kind, grad_clip):
    fused, plain = _params(0), _params(0, torch.float64)
    fused_opt, plain_opt = _optimizer(kind, fused, True), _optimizer(kind, plain, False)
    gen = torch.Generator().manual_seed(1)
    norms = []
    for step in range(3):  # the state primed, then clipped steps on it
        grads = [torch.randn(s, generator=gen) * (step + 1) for s in SHAPES]
        for a, b, g in zip(fused, plain, grads, strict=True):
            a.grad, b.grad = g.clone(), g.double()
        with clip_in_step(fused_opt, fused, grad_clip) as norm:
            fused_opt.step()
        assert fused_opt.grad_scale is None
        expected = torch.nn.utils.get_total_norm([p.grad for p in plain]).item()
        if grad_clip:
            torch.nn.utils.clip_grad_norm_(plain, grad_clip)
        plain_opt.step()
        assert norm == pytest.approx(expected, rel=1e-6)
        norms.append(norm)
        for a, b in zip(fused, plain, strict=True):
            np.testing.assert_allclose(a.detach().numpy(), b.detach().numpy(), rtol=1e-5, atol=1e-6)
    assert (min(norms) > grad_clip > 0) == (grad_clip == 0.5)  # the middle case bites at every step


def test_the_norm_takes_each_float_dtype_and_a_non_finite_one_sets_no_scale():
    gen = torch.Generator().manual_seed(2)
    tensors = [torch.randn(s, generator=gen) for s in SHAPES] + [torch.randn(33, generator=gen).bfloat16()]
    tensors += [
        torch.randn(5, 7, generator=gen).t(),
        torch.randn(9, generator=gen).half(),
        torch.randn(11, generator=gen).double(),
    ]
    expected = math.sqrt(sum((t.double() ** 2).sum().item() for t in tensors))
    assert global_norm(tensors) == pytest.approx(expected, rel=1e-6)
    float64 = global_norm([torch.tensor([1e-3, 1e-3 + 1e-12], dtype=torch.float64)])
    assert float64 == pytest.approx(math.hypot(1e-3, 1e-3 + 1e-12), rel=1e-13)  # not rounded to float32
    assert global_norm([]) == 0.0
    params = _params(3)
    opt = _optimizer("adamw", params, True)
    for p in params:
        p.grad = torch.full(p.shape, float("inf"))
    with clip_in_step(opt, params, 1.0) as norm:
        assert math.isinf(norm) and getattr(opt, "grad_scale", None) is None  # the caller skips such a step


def test_an_optimizer_that_does_not_read_grad_scale_is_refused_by_name():
    params = _params(4)
    with pytest.raises(ValueError, match="fused torch optimizer.*SGD"):
        with clip_in_step(torch.optim.SGD(params, lr=0.1), params, 1.0):
            pass


def test_a_step_that_raises_leaves_no_scale_behind():
    params = _params(5)
    opt = _optimizer("adamw", params, True)
    for p in params:
        p.grad = torch.ones(p.shape)
    with pytest.raises(RuntimeError, match="the step failed"):
        with clip_in_step(opt, params, 0.1):
            assert opt.grad_scale is not None  # the clip bites
            raise RuntimeError("the step failed")
    assert opt.grad_scale is None
