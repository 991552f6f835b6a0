"""ActorGroup: actors that play one role together, and the one call that drives them all."""

from __future__ import annotations

from collections.abc import Sequence

import ray
from ray.actor import ActorHandle


class ActorGroup:
    """`run("save_checkpoint", path)` calls that typed method on every actor of the group and
    waits; `run_async` returns the refs instead (rank order), so a caller can overlap calls.
    `each=[...]`: one value per actor, its call's first argument (before `args`)."""

    def __init__(self, actors: Sequence[ActorHandle]):
        self.actors = list(actors)

    def run_async(self, method: str, *args, each: Sequence | None = None, **kwargs) -> list[ray.ObjectRef]:
        if each is None:
            return [getattr(actor, method).remote(*args, **kwargs) for actor in self.actors]
        return [getattr(actor, method).remote(own, *args, **kwargs) for actor, own in zip(self.actors, each, strict=True)]

    def run(self, method: str, *args, **kwargs) -> list:
        return ray.get(self.run_async(method, *args, **kwargs))

    def kill(self) -> None:
        for actor in self.actors:
            ray.kill(actor)
