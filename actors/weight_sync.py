"""Weight sync: how new learner weights reach the rollout engines, owned here alone.

Two transports behind one interface, `WeightSync.push(version)`, chosen by
`resource.weight_sync`:

- `ObjectStoreSync`: learner rank 0's full state dict goes into Ray's object store as numpy
  (every rank takes part: ZeRO-3 gathers); each engine loads it in place. The CPU default.
- `BroadcastSync`: learner rank 0 and every engine's worker form a process group of their
  own; rank 0 broadcasts one flat buffer per dtype (NCCL on GPUs, gloo on CPU).

The tensor side of both (flat buffers, groups, numpy -> tensors) is actors/core/weight_sync.py;
the learner and the generator only hold their model for it.
"""

from __future__ import annotations

from collections.abc import Sequence

import ray
from ray.actor import ActorHandle

from actors.learner import LearnerGroup


class WeightSync:
    """Pushes the learners' current weights to every rollout engine."""

    SENDS_FLOAT32 = True  # the weights travel as float32 numpy (else in the model's dtypes)
    WAITS_FOR_LOADS = False  # every push waits until each engine has loaded (else: with `wait=False`, it may not)

    def __init__(self, learners: LearnerGroup, rollouts: Sequence[ActorHandle]):
        self.learners, self.rollouts = learners, list(rollouts)
        self._push_bytes: int | None = None
        self.version = 0  # the weights version the engines serve (0: the starting weights)
        # The last push's calls when it did not wait for them: (the engine, or None for a learner's send; the ref).
        self.loading: list[tuple[ActorHandle | None, ray.ObjectRef]] = []

    def push(self, version: int, wait: bool = True) -> None:
        """Every engine serves the learners' weights as `version` when this returns; with
        `wait=False`, once it finishes the calls queued on it before. Raises RayActorError for an
        engine that died loading these weights, or (not waited for) the previous push's."""
        previous, self.version = self.loading, version  # `version` is what an engine restarted meanwhile is given, too
        self.loading = self._send(version)
        ray.get([ref for _, ref in previous])
        if wait:
            loading, self.loading = self.loading, []
            ray.get([ref for _, ref in loading])

    def push_bytes(self) -> int:
        """The bytes one push delivers: the full weights to each engine (asked of the learners once)."""
        if self._push_bytes is None:
            self._push_bytes = self.learners.run("weights_nbytes", self.SENDS_FLOAT32)[0] * len(self.rollouts)
        return self._push_bytes

    def _send(self, version: int) -> list[tuple[ActorHandle | None, ray.ObjectRef]]:
        """Start giving every engine the learners' current weights as `version`: (engine, ref) of each call."""
        raise NotImplementedError

    def restore(self, engines: Sequence[ActorHandle]) -> None:
        """Bring `engines`, restarted with the starting weights, to the current version."""
        raise NotImplementedError

    def rewire(self, learners: LearnerGroup) -> None:
        """Take weights from `learners` from now on (a group rebuilt after a rank died)."""
        self.learners, self.loading = learners, []  # a push not waited for may have died with the old group


class ObjectStoreSync(WeightSync):
    def restore(self, engines: Sequence[ActorHandle]) -> None:
        # A load not waited for on an engine that died has failed, and this one supersedes it.
        self.loading = [(engine, ref) for engine, ref in self.loading if engine not in engines]
        if self.version:
            ray.get([ref for _, ref in self._load(engines, self.version)])

    def _send(self, version: int) -> list[tuple[ActorHandle | None, ray.ObjectRef]]:
        return self._load(self.rollouts, version)

    def _load(self, engines: Sequence[ActorHandle], version: int) -> list[tuple[ActorHandle | None, ray.ObjectRef]]:
        weights = self.learners.state_dict_ref()
        return [(r, r.update_weights.remote(weights, version)) for r in engines]


class BroadcastSync(WeightSync):
    SENDS_FLOAT32 = False
    WAITS_FOR_LOADS = True

    def __init__(self, learners: LearnerGroup, rollouts: Sequence[ActorHandle], backend: str):
        """Form the weight-sync group: learner rank 0 (which hosts it) and every rollout engine."""
        super().__init__(learners, rollouts)
        self.backend = backend
        self._form_group()

    def _form_group(self) -> None:
        host, port = self.learners.address()
        world = 1 + len(self.rollouts)
        opened = self.learners.run_async("open_weight_sync", host, port, world, self.backend)
        joined = [r.open_weight_sync.remote(host, port, i + 1, world, self.backend) for i, r in enumerate(self.rollouts)]
        self.layout = ray.get(opened)[0]
        ray.get(joined)

    def push(self, version: int, wait: bool = True) -> None:
        """Always waited for: a broadcast not waited for, to an engine that died meanwhile, would
        hold learner rank 0 in the collective until its timeout, and every call queued behind it."""
        super().push(version, wait=True)

    def _send(self, version: int) -> list[tuple[ActorHandle | None, ray.ObjectRef]]:
        """Learner rank 0 broadcasts its weights; every engine receives and loads them."""
        sends = [(None, ref) for ref in self.learners.run_async("broadcast_weights")]
        return sends + [(r, r.receive_weights.remote(self.layout, version)) for r in self.rollouts]

    def restore(self, engines: Sequence[ActorHandle]) -> None:
        """A restarted engine left the group: form it again with every engine, and broadcast."""
        self.loading = []  # loads into the old group: the one that died fails, the others are superseded
        self._form_group()
        self.push(self.version)

    def rewire(self, learners: LearnerGroup) -> None:
        super().rewire(learners)
        self._form_group()


def transport(setting: str, use_gpu: bool) -> str:
    """The transport `resource.weight_sync` names; `auto` is a broadcast on GPUs.

    >>> transport("auto", use_gpu=False), transport("auto", use_gpu=True), transport("broadcast", use_gpu=False)
    ('object_store', 'broadcast', 'broadcast')
    """
    return setting if setting != "auto" else "broadcast" if use_gpu else "object_store"


def make_weight_sync(setting: str, learners: LearnerGroup, rollouts: Sequence[ActorHandle], use_gpu: bool) -> WeightSync:
    if transport(setting, use_gpu) == "broadcast":
        return BroadcastSync(learners, rollouts, backend="nccl" if use_gpu else "gloo")
    return ObjectStoreSync(learners, rollouts)
