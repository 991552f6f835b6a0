"""A run's placement: one placement group whose bundles the roles take by name, so a run is
reserved as one gang and each role lands on the node type its bundle names."""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field

import ray
from ray.util.placement_group import PlacementGroup, placement_group, placement_group_table, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from actors.common import ResourceFitError
from pipelines.config import node_kind


@dataclass(frozen=True)
class Bundle:
    """One role's share of the run: its name (`learner-0`, `rollout-0`, `reward`, ...) and the
    resources its placement bundle reserves."""

    role: str
    resources: dict[str, float] = field(default_factory=dict)


class Placement:
    """The placement group of a run and which bundle each role takes.

    Made here from `bundles`, or, inside a Ray Tune trial, the trial's own group (`trial_group`:
    the trial driver's bundle, then `bundles` in order, as `raypo tune` reserved them)."""

    def __init__(self, bundles: list[Bundle], name: str, wait_s: float, trial_group: PlacementGroup | None = None):
        self.bundles = bundles
        self.index = {b.role: i for i, b in enumerate(bundles)}
        if trial_group is not None:
            # Tune leaves the driver's bundle out of the group when it is empty ({}), else it comes first
            extra = len(trial_group.bundle_specs) - len(bundles)
            if extra not in (0, 1):
                raise ResourceFitError(
                    f"the trial reserved {len(trial_group.bundle_specs)} bundles but the run needs {len(bundles)} "
                    f"({', '.join(self.index)}) after its driver's: reserve trials with raypo tune's trial_bundles(cfg)"
                )
            self.pg, self.offset, self.owned = trial_group, extra, False
        else:
            self.pg = placement_group([dict(b.resources) for b in bundles], strategy="PACK", name=name)
            self.offset, self.owned = 0, True
        try:
            self._wait(wait_s)
        except BaseException:  # a timeout, Ctrl-C or `ray job stop` while waiting: free what was reserved
            self.remove()
            raise

    def _wait(self, wait_s: float) -> None:
        deadline, ready = time.monotonic() + wait_s, self.pg.ready()
        while True:
            done, _ = ray.wait([ready], timeout=min(30.0, max(0.0, deadline - time.monotonic())))
            if done:
                return
            if time.monotonic() >= deadline:
                wanted = "; ".join(f"{b.role} {b.resources}" for b in self.bundles)
                raise ResourceFitError(
                    f"the run's placement group was not placed within {wait_s:g} s: no node offers {wanted} "
                    "(or the autoscaler did not add one); see `ray status` and resource.node_types"
                )
            print(f"waiting for the cluster to place the run's roles ({', '.join(self.index)})...", file=sys.stderr)

    def options(self, role: str, **extra) -> dict:
        """`.options(...)` for the actor or task playing `role`: its CPUs and GPUs from its bundle."""
        resources = self.bundles[self.index[role]].resources
        return {
            "num_cpus": resources.get("CPU", 0.0),
            "num_gpus": resources.get("GPU", 0.0),
            "scheduling_strategy": PlacementGroupSchedulingStrategy(
                self.pg, placement_group_bundle_index=self.offset + self.index[role]
            ),
            **extra,
        }

    def where(self) -> list[dict]:
        """Where each role was placed: role, node id, node IP and the node's cluster.yaml type
        (`head` for the head node, null for a node of no raypo type)."""
        on_node = placement_group_table(self.pg).get("bundles_to_node_id", {})
        nodes = {n["NodeID"]: n for n in ray.nodes()}
        out = []
        for bundle in self.bundles:
            node = nodes.get(on_node.get(self.offset + self.index[bundle.role]), {})
            out.append(
                {
                    "role": bundle.role,
                    "node_id": node.get("NodeID"),
                    "node_ip": node.get("NodeManagerAddress"),
                    "node_type": node_kind(node.get("Resources", {})),
                }
            )
        return out

    def remove(self) -> None:
        """Free the group if this run made it (a trial's group belongs to Tune)."""
        if self.owned:
            remove_placement_group(self.pg)
