"""The tensor side of weight sync, for both transports (actors/weight_sync.py drives them).

Object store: the learner's state dict travels as numpy arrays; `tensors_from_arrays` turns
them into the (name, tensor) pairs vLLM's `reload_weights` takes, without copying.

Broadcast: learner rank 0 sends to the rollout engines over a group of their own.

The group (rank 0 = learner, ranks 1.. = rollout engines) is built straight from a TCPStore,
not through torch.distributed's default group, so the learners' training world is untouched.
Backend: NCCL on GPUs (tensors go device to device), gloo on CPU (TCP). Every tensor of one
dtype travels in one flat buffer per update: one collective per dtype, not per parameter.

Both sides call their half at the same time (the driver launches both, then waits):
`send(group, state)` on the learner, `receive(group, layout, device)` on each engine, which
returns the named tensors to load with vLLM's `reload_weights`.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator, Mapping
from datetime import timedelta

import numpy as np
import torch

Layout = list[tuple[str, tuple[int, ...], str]]  # (name, shape, dtype name), in send order


def tensors_from_arrays(state: Mapping[str, np.ndarray]) -> list[tuple[str, torch.Tensor]]:
    """(name, tensor) views of a state dict that came through the object store as numpy."""
    with warnings.catch_warnings():
        # Arrays from the object store are read-only; vLLM copies them into its own
        # parameters and never writes through these views.
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        return [(name, torch.from_numpy(np.asarray(value))) for name, value in state.items()]


def open_group(host: str, port: int, rank: int, world_size: int, backend: str, timeout_s: float = 300.0):
    """Join the weight-sync group; rank 0 hosts the store. Blocks until all ranks joined."""
    timeout = timedelta(seconds=timeout_s)
    store = torch.distributed.TCPStore(host, port, world_size, is_master=rank == 0, timeout=timeout)
    if backend == "gloo":
        return torch.distributed.ProcessGroupGloo(store, rank, world_size, timeout)
    if backend == "nccl":
        return torch.distributed.ProcessGroupNCCL(store, rank, world_size)
    raise ValueError(f"weight-sync backend must be gloo or nccl, got {backend!r}")


def layout_of(state: Mapping[str, torch.Tensor]) -> Layout:
    """What the receivers need to know to rebuild `state` from the flat buffers."""
    return [(name, tuple(t.shape), str(t.dtype).removeprefix("torch.")) for name, t in state.items()]


def _broadcast(group, tensor: torch.Tensor) -> None:
    options = torch.distributed.BroadcastOptions()
    options.rootRank = 0
    group.broadcast([tensor], options).wait()


def _dtypes(layout: Layout) -> list[str]:
    return sorted({dtype for _, _, dtype in layout})


def send(group, state: Mapping[str, torch.Tensor]) -> Layout:
    """Rank 0: broadcast `state` (one flat buffer per dtype). Returns its layout."""
    layout = layout_of(state)
    for dtype in _dtypes(layout):
        flat = torch.cat([state[name].detach().reshape(-1) for name, _, d in layout if d == dtype])
        _broadcast(group, flat.contiguous())
    return layout


def receive(group, layout: Layout, device: str | torch.device = "cpu") -> Iterator[tuple[str, torch.Tensor]]:
    """Ranks 1..: receive the buffers rank 0 sends for `layout`; yields (name, tensor) views."""
    named: dict[str, torch.Tensor] = {}
    for dtype in _dtypes(layout):
        entries = [(name, shape) for name, shape, d in layout if d == dtype]
        sizes = [int(torch.Size(shape).numel()) for _, shape in entries]
        flat = torch.empty(sum(sizes), dtype=getattr(torch, dtype), device=device)
        _broadcast(group, flat)
        for (name, shape), part in zip(entries, flat.split(sizes), strict=True):
            named[name] = part.view(shape)
    return ((name, named[name]) for name, _, _ in layout)
