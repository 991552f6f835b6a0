"""float32 linear layers through oneDNN's matmul, forward and backward, instead of torch's BLAS call,
on the processors where that is faster.

On CPU, `torch.nn.Linear` multiplies with MKL's sgemm. On AMD processors MKL takes its AVX2
path whatever the processor supports; oneDNN (torch's own `mkldnn` library, the one vLLM's CPU
backend uses for its linears) picks its kernels by instruction set, not vendor. On the 2-core
AMD EPYC (AVX-512) raypo is built on, oneDNN ran SmolLM2's and the tiny model's matmul shapes,
forward and both backward products, at 1.8-2.4x MKL's FLOP/s (bench/phases.py prints both
GEMMs). On Intel's processors MKL runs its own best kernels, and on a 2-core Intel Xeon (AVX10.1,
AMX) it was the faster one at every shape of both models: a layer's three products took
1.1-1.4x as long in oneDNN, and a SmolLM2 update 1.10-1.14x (in-process, two runs each). So layers
take oneDNN on other vendors' x86-64 processors only (`intel_cpu`). A choice timed at start-up
instead flipped from run to run: a learner starts while the engines beside it load, and those
timings swung by 2x. The results are float32 products either way: the same inputs, summed in
another order.

oneDNN builds (JIT-compiles) a kernel for each shape it meets and keeps the last 1,024 in a
cache (`ONEDNN_PRIMITIVE_CACHE_CAPACITY`). The rows change from batch to batch, so a step with
a new row count builds about 15 kernels for a decoder (each layer shape, forward, input gradient
and weight gradient): about 0.3-0.8 ms each, under 1% of a SmolLM2 update. Padding the rows to a
few sizes instead cost more: every input and gradient copied once more. A small layer's products
gain less from oneDNN than a new kernel costs (a 128 x 384 layer over 400 rows: forward and both
gradients 0.38 ms in oneDNN, 0.63 ms in MKL, ~2 ms more for a new row count in oneDNN, none in
MKL), so layers with fewer than `MIN_WEIGHT` weights stay with MKL: the tiny model's update was
~10% faster over its first 50 steps, where most row counts are new, and the same after.

`use_onednn(model)` switches a model's float32 `nn.Linear` layers in place where `switches`
says; a layer that meets another dtype or device at run time (a bf16 engine, CPU autocast, a
GPU) goes through `torch.nn.functional.linear` as before. It does nothing off x86-64, where
torch was built without oneDNN. `RAYPO_ONEDNN` in the environment sets the choice: `0` never
(MKL everywhere), `1` every layer of at least `MIN_WEIGHT` weights on any processor, unset or
`auto` on processors other than Intel's.

The weight gradient's product takes the output gradient transposed, which oneDNN copies
(`[out features, rows]`, as large as that layer's output gradient: for the LM head, the logits'
gradient). Where that copy would pass `WEIGHT_GRAD_COPY_LIMIT` elements, MKL computes it instead,
without a copy.
"""

from __future__ import annotations

import functools
import os
import platform
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.function import once_differentiable

WEIGHT_GRAD_COPY_LIMIT = 1 << 26  # elements (256 MB of float32) of the transposed gradient oneDNN would copy
MIN_WEIGHT = 1 << 16  # a layer's weights (256 x 256) below which its products stay with MKL (above)


def has_linear_op() -> bool:
    """Whether this torch has oneDNN and the linear op `matmul_t` calls (CPU builds do)."""
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def available() -> bool:
    """Whether oneDNN may be used: an x86-64 CPU build of torch with oneDNN enabled and its linear
    op, unless `RAYPO_ONEDNN=0`."""
    return (
        mode() != "0" and platform.machine().lower() in ("x86_64", "amd64") and torch.backends.mkldnn.enabled and has_linear_op()
    )


def mode() -> str:
    """`RAYPO_ONEDNN`: `0` (never), `1` (every layer of at least `MIN_WEIGHT` weights) or `auto`
    (those layers unless the processor is Intel's: `intel_cpu`; the default). Anything else raises."""
    value = os.environ.get("RAYPO_ONEDNN", "auto").strip().lower() or "auto"
    if value not in ("0", "1", "auto"):
        raise ValueError(f"RAYPO_ONEDNN={value!r}: use 0 (MKL everywhere), 1 (oneDNN for every large layer) or auto")
    return value


def matmul_t(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`x @ weight.T (+ bias)`: `[m, k] x [n, k] -> [m, n]`; `weight` may be a strided view."""
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


def weight_grad(dy: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """`dy^T x`, `[m, n]` and `[m, k]` -> `[n, k]`: a linear layer's weight gradient. oneDNN copies
    `dy^T` first; past `WEIGHT_GRAD_COPY_LIMIT` elements MKL computes it instead, reading it in place."""
    return matmul_t(dy.t(), x.t()) if dy.numel() <= WEIGHT_GRAD_COPY_LIMIT else dy.t().mm(x)


class _Linear(torch.autograd.Function):
    """`y = x W^T + b` with every product in oneDNN: `dx = dy W`, `dW = dy^T x`, `db = sum dy`."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])  # [..., k] -> [m, k]
        y = matmul_t(flat, weight, bias)  # [m, n]
        wants_x, wants_w = ctx.needs_input_grad[:2]
        ctx.save_for_backward(flat if wants_w else None, weight if wants_x else None)
        ctx.x_shape = x.shape
        ctx.has_bias = bias is not None
        # detached: a plain tensor, not a view made inside a Function, so later in-place ops are legal
        return y.view(*x.shape[:-1], weight.shape[0]).detach()

    @staticmethod
    @once_differentiable
    def backward(ctx, grad: torch.Tensor):
        flat, weight = ctx.saved_tensors
        dy = grad.reshape(-1, grad.shape[-1])  # [m, n]
        dx = dw = db = None
        if ctx.needs_input_grad[0]:
            dx = matmul_t(dy, weight.t()).view(ctx.x_shape)  # [m, n] x [k, n]^T -> [m, k]
        if ctx.needs_input_grad[1]:
            dw = weight_grad(dy, flat)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            db = dy.sum(0)
        return dx, dw, db


class OneDnnLinear(nn.Linear):
    """An `nn.Linear` (same parameters, same state dict) whose float32 CPU products run in oneDNN."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight
        if (
            x.dtype != torch.float32
            or w.dtype != torch.float32
            or x.device.type != "cpu"
            or x.numel() == 0
            or torch.is_autocast_enabled("cpu")
        ):
            return F.linear(x, w, self.bias)
        return _Linear.apply(x, w, self.bias)


def switches(in_features: int, out_features: int, min_weight: int | None = None) -> bool:
    """Whether an `in_features -> out_features` linear layer multiplies in oneDNN: oneDNN is on
    (`available`), the layer has at least `min_weight` weights (default `MIN_WEIGHT`, read at the
    call), and, unless `RAYPO_ONEDNN=1`, torch's BLAS is not MKL on an Intel processor (`intel_cpu`),
    which runs its own kernels there."""
    if not available() or in_features * out_features < (MIN_WEIGHT if min_weight is None else min_weight):
        return False
    return mode() == "1" or not (intel_cpu() and torch.backends.mkl.is_available())


@functools.cache
def intel_cpu(cpuinfo: str = "/proc/cpuinfo") -> bool:
    """Whether this is an Intel processor (`vendor_id` GenuineIntel in `cpuinfo`, or Intel named by
    `platform.processor()` where there is no such file: not on macOS, which names none), where MKL
    picks its kernels by instruction set; on any other it takes its AVX2 path."""
    try:
        for line in Path(cpuinfo).read_text().splitlines():
            if line.startswith("vendor_id"):
                return line.split(":", 1)[1].strip() == "GenuineIntel"
    except OSError:
        pass
    return "intel" in platform.processor().lower()


def use_onednn(model: nn.Module, min_weight: int | None = None) -> int:
    """Switch `model`'s `nn.Linear` layers (exactly that class) that `switches` says to
    `OneDnnLinear` in place; the number switched."""
    switched = 0
    for module in model.modules():
        if type(module) is nn.Linear and switches(module.in_features, module.out_features, min_weight):
            module.__class__ = OneDnnLinear
            switched += 1
    return switched
