"""Loading new weights into a running vLLM model on CPU, in place, without vLLM's layerwise reload.

vLLM's `reload_weights` puts every layer back on the meta device, wraps each parameter's loader
to count what arrived, re-materializes the layer once it is whole, and re-runs its post-load
processing. On CPU that processing is the part that matters: each unquantized linear layer's
weight is packed for oneDNN (or the small-GEMM kernel) and the plain weight dropped
(`dispatch_cpu_unquantized_gemm`), and the LM head keeps a packed copy beside its weight. The
rest is bookkeeping, and on the tiny model it was most of a 20 ms reload, every step.

`load_in_place` does only what the processing needs: each linear layer gets its whole new
weight (the packed modules, q/k/v into qkv_proj and gate/up into gate_up_proj, concatenated in
vLLM's order) and is processed again by its own quant method; embeddings, the LM head and the
norms load through their parameters' own weight loaders (the vocabulary padding is theirs), and
an embedding-like layer whose weight changed is processed again (its packed copy). It takes
only what it fully understands: an unquantized Llama-architecture model (`ARCHITECTURES`) on CPU
whose every parameter the tensors name, each with its shape, with no LoRA; anything else returns
False before a weight is touched, and the caller uses vLLM's `reload_weights`.

Where each tensor goes is worked out once per model and set of tensor names and shapes (`_Routes`,
kept on the model), then reused: a run loads the same names every step, and on the tiny model
working it out was about a quarter of a load.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

# The architectures whose whole post-load processing is their linear and embedding layers' (no
# attention or model-level step that `load_in_place` would skip), checked against vLLM's reload in
# tests/test_actors.py. Any other falls back to vLLM's `reload_weights`.
ARCHITECTURES = frozenset({"LlamaForCausalLM"})


@dataclass
class _Linear:
    module: torch.nn.Module
    weights: list[torch.Tensor | None]  # one per packed shard (one for a plain layer)
    biases: list[torch.Tensor | None]


@dataclass
class _Plan:
    linears: dict[str, _Linear] = field(default_factory=dict)
    params: list[tuple[torch.nn.Parameter, torch.Tensor]] = field(default_factory=list)
    embeddings: list[torch.nn.Module] = field(default_factory=list)  # embedding-like modules whose weight loads
    routes: list[tuple] = field(default_factory=list)  # each tensor's, in order (`_Routes.to`)

    def add_param(self, module: torch.nn.Module, kind: str, tensor: torch.Tensor) -> None:
        """`tensor` loads into `module`'s parameter `kind` (looked up now), through its loader."""
        self.params.append((getattr(module, kind), tensor))
        self.routes.append(("param", module, kind))

    def add_shard(self, path: str, module: torch.nn.Module, size: int, index: int, kind: str, tensor: torch.Tensor) -> None:
        """`tensor` is shard `index` of the `size` shards of linear layer `path`'s weight or bias (`kind`)."""
        linear = self.linears.setdefault(path, _Linear(module, [None] * size, [None] * size))
        (linear.weights if kind == "weight" else linear.biases)[index] = tensor
        self.routes.append(("linear", path, module, size, index, kind))


@dataclass
class _Routes:
    """Where `_plan` put each tensor of a load, by position: `_Plan.add_shard`'s or `add_param`'s
    arguments but the tensor, after "linear" or "param"; and the embedding-like modules among
    those parameters' (whose packed copy is made again)."""

    key: tuple
    to: list[tuple]
    embeddings: list[torch.nn.Module]


def load_in_place(model: torch.nn.Module, tensors: Sequence[tuple[str, torch.Tensor]]) -> bool:
    """Load Hugging Face-named `tensors` into the vLLM `model` in place; False (and nothing
    changed) where this path does not apply (see the module docstring)."""
    plan = _cached_plan(model, tensors)
    if plan is None:
        return False
    from vllm.model_executor.model_loader.weight_utils import default_weight_loader

    with torch.no_grad():
        for param, tensor in plan.params:
            getattr(param, "weight_loader", default_weight_loader)(param, tensor)
        for linear in plan.linears.values():
            _reload_linear(linear)
        for module in plan.embeddings:
            module.quant_method.process_weights_after_loading(module)  # its packed copy for the LM head
    return True


def _cached_plan(model: torch.nn.Module, tensors: Sequence[tuple[str, torch.Tensor]]) -> _Plan | None:
    """`_plan`, from the routes of the model's last load of the same names and shapes where there
    are some. A parameter is looked up on its module again, in case something replaced it since
    (vLLM 0.32's own reload keeps the same parameter objects)."""
    key = (tuple((name, tuple(t.shape)) for name, t in tensors), sum(1 for _ in model.parameters()))
    routes: _Routes | None = getattr(model, "_raypo_load_routes", None)
    if routes is None or routes.key != key:
        try:
            plan = _plan(model, tensors)
        except Exception:  # planning touches nothing: what it cannot read is vLLM's reload's to load
            plan = None
        if plan is not None:
            model._raypo_load_routes = _Routes(key, plan.routes, plan.embeddings)
        return plan
    plan = _Plan(embeddings=routes.embeddings)
    for (_, tensor), (to, *where) in zip(tensors, routes.to, strict=True):
        (plan.add_param if to == "param" else plan.add_shard)(*where, tensor)
    return plan


def _reload_linear(linear: _Linear) -> None:
    module = linear.module
    dtype = module.params_dtype if hasattr(module, "params_dtype") else torch.get_default_dtype()
    parts = linear.weights
    whole = torch.cat([w.to(dtype) for w in parts]) if len(parts) > 1 else parts[0].to(dtype, copy=True)
    module.weight = torch.nn.Parameter(whole.contiguous(), requires_grad=False)
    if any(b is not None for b in linear.biases):
        module.bias.data.copy_(torch.cat(linear.biases))
    module.quant_method.process_weights_after_loading(module)  # packs the weight, as at load


def _is_linear_method(method) -> bool:
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod

    return type(method) is UnquantizedLinearMethod


def _is_embedding_method(method) -> bool:
    from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod

    return type(method) is UnquantizedEmbeddingMethod


def _plan(model: torch.nn.Module, tensors: Sequence[tuple[str, torch.Tensor]]) -> _Plan | None:
    """Where each tensor goes, or None where this path does not apply."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu() or type(model).__name__ not in ARCHITECTURES:
        return None
    if any("LoRA" in type(m).__name__ or getattr(m, "_cpu_skip_gemm_dispatch", False) for m in model.modules()):
        return None
    packed_modules = getattr(model, "packed_modules_mapping", {})
    shard_of = {part: (packed, i) for packed, parts in packed_modules.items() for i, part in enumerate(parts)}
    plan, loaded = _Plan(), set()
    for name, tensor in tensors:
        target = _place(plan, model, shard_of, name, tensor)
        if target is None:
            return None
        loaded.add(id(target))
    if not all(_linear_whole(linear) for linear in plan.linears.values()) or not _covers(model, loaded):
        return None
    changed = {id(param) for param, _ in plan.params}
    plan.embeddings = [
        module
        for module in model.modules()
        if _is_embedding_method(getattr(module, "quant_method", None)) and id(getattr(module, "weight", None)) in changed
    ]
    return plan


def _place(plan: _Plan, model: torch.nn.Module, shard_of: dict, name: str, tensor: torch.Tensor):
    """Add the tensor named `name` to `plan`, and its route; the linear module or parameter it loads, or None."""
    module_path, _, kind = name.rpartition(".")
    parent, _, last = module_path.rpartition(".")
    packed, index = shard_of.get(last, (last, 0))
    try:
        module = model.get_submodule(f"{parent}.{packed}" if parent else packed)
    except AttributeError:
        return None
    method = getattr(module, "quant_method", None)
    if _is_linear_method(method) and kind in ("weight", "bias"):
        return module if _place_shard(plan, module, f"{parent}.{packed}", kind, index, tensor, last != packed) else None
    param = getattr(module, kind, None)
    if not isinstance(param, torch.nn.Parameter) or last != packed:
        return None
    if method is not None and not _is_embedding_method(method):
        return None  # quantized or otherwise processed: vLLM's own reload
    # checked before anything loads: a plain copy would broadcast, a loader would fail halfway
    expected = (module.org_vocab_size, param.shape[1]) if _is_embedding_method(method) else tuple(param.shape)
    if tuple(tensor.shape) != expected:
        return None
    plan.add_param(module, kind, tensor)
    return param


def _covers(model: torch.nn.Module, loaded: set[int]) -> bool:
    """Every linear layer and every other parameter gets new weights: none is left stale."""
    for module in model.modules():
        if _is_linear_method(getattr(module, "quant_method", None)):
            if id(module) not in loaded:
                return False
        elif any(id(param) not in loaded for param in module.parameters(recurse=False)):
            return False
    return True


def _linear_whole(linear: _Linear) -> bool:
    """Every shard of the layer's weight arrived, and its bias's where it has one."""
    has_bias = getattr(linear.module, "bias", None) is not None
    return all(w is not None for w in linear.weights) and (
        all(b is not None for b in linear.biases) if has_bias else not any(b is not None for b in linear.biases)
    )


def _place_shard(plan: _Plan, module, path: str, kind: str, index: int, tensor: torch.Tensor, packed: bool) -> bool:
    if not hasattr(module, "input_size_per_partition"):
        return False  # a replicated layer (a MoE gate, ...): vLLM's own reload
    sizes = list(getattr(module, "output_partition_sizes", None) or [module.output_size_per_partition])
    if packed != (len(sizes) > 1) or index >= len(sizes):
        return False
    rows = sizes[index] if packed else sum(sizes)
    shape = (rows, module.input_size_per_partition) if kind == "weight" else (rows,)
    if tuple(tensor.shape) != shape:
        return False
    plan.add_shard(path, module, len(sizes), index, kind, tensor)
    return True
