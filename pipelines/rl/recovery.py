"""Recovery inside a run. From updates that fail: the seeds' rule, a rollback to the last good
checkpoint with a lower learning rate after `training.rollback_after` (5) failed steps in a row,
and the run's update success rate (the seeds' target: above 99.9%). From roles whose process
dies: Ray restarts them (`resource.max_actor_restarts`) and re-runs their lost calls, except a
rollout engine's, which the driver re-issues once the engine has the current weights; the
`ActorWatch` tells which roles were restarted."""

from __future__ import annotations

import sys
import time

import ray
import ray.exceptions as rex
from ray.actor import ActorHandle

from pipelines.config import TrainingConfig


class UpdateGuard:
    """Counts a run's updates: the share of its steps whose updates all succeeded
    (`update_success_rate`) and the failed steps in a row (a non-finite loss or gradient made the
    learners skip an update); says when that streak calls for a rollback.

    >>> from pipelines.config import load_config
    >>> guard = UpdateGuard(load_config(overrides=["training.rollback_after=2"]).training, history=[])
    >>> [guard.record(m) for m in ({"update_success": 1.0}, {"update_success": 0.0}, {"update_success": 0.0})]
    [False, False, True]
    >>> guard.rate(), guard.failed_in_a_row, guard.rolled_back(), guard.failed_in_a_row
    (0.3333333333333333, 2, 0.5, 0)
    """

    def __init__(self, training: TrainingConfig, history: list[dict], lr_scale: float = 1.0):
        self.rollback_after, self.factor = training.rollback_after, training.rollback_lr_factor
        self.lr_scale = lr_scale
        self.succeeded: list[float] = []
        self.failed_in_a_row = 0
        for metrics in history:  # the steps before a resume
            self._count(metrics)

    def _count(self, metrics: dict) -> None:
        if "update_success" not in metrics:
            return  # no update was tried (a step no reward scored)
        ok = metrics["update_success"] >= 1.0
        self.succeeded.append(float(ok))
        self.failed_in_a_row = 0 if ok or "rollback_to" in metrics else self.failed_in_a_row + 1

    def rate(self) -> float:
        return sum(self.succeeded) / len(self.succeeded) if self.succeeded else 1.0

    def record(self, metrics: dict) -> bool:
        """Count the step's update and add `update_success_rate` and `failed_updates_in_a_row` to
        its `metrics`; True when the streak of failed steps calls for a rollback now."""
        self._count(metrics)
        metrics["update_success_rate"] = self.rate()
        metrics["failed_updates_in_a_row"] = self.failed_in_a_row
        return bool(self.rollback_after) and self.failed_in_a_row >= self.rollback_after

    def rolled_back(self) -> float:
        """Start a new streak after a rollback; returns the lowered learning-rate scale."""
        self.failed_in_a_row = 0
        self.lr_scale *= self.factor
        return self.lr_scale


class RecoveryError(RuntimeError):
    """A role could not be recovered in the run (past resource.max_actor_restarts); the message says which and why."""


RESTART_WAIT_S = 600  # a restarted role answers once its constructor ran (a vLLM engine: tens of seconds on CPU)


class ActorWatch:
    """The run's restartable roles (rollout engines, reward, reference, critic, buffer) and the
    process each runs in: tells which Ray restarted since it last looked, logs and counts them."""

    def __init__(self, actors: dict[str, ActorHandle], max_restarts: int):
        self.actors, self.max_restarts = actors, max_restarts
        self.pids = self._pids(list(actors), wait_s=None)  # the first start: as long as it takes
        self.restarts = dict.fromkeys(actors, 0)

    def _pids(self, roles: list[str], wait_s: float | None = RESTART_WAIT_S) -> dict[str, int]:
        refs = {role: self.actors[role].pid.remote() for role in roles}
        pids, deadline = {}, time.monotonic() + (wait_s or 0)
        for role, ref in refs.items():
            while role not in pids:
                try:
                    pids[role] = ray.get(ref, timeout=max(deadline - time.monotonic(), 0.001) if wait_s else None)
                except rex.ActorUnavailableError:  # restarting now: ask again once it is up
                    time.sleep(0.2)
                    ref = self.actors[role].pid.remote()
                except rex.GetTimeoutError:
                    raise RecoveryError(f"{role} did not come back within {RESTART_WAIT_S} s of its restart") from None
                except rex.RayActorError as err:
                    if "creation task" in str(err):
                        raise  # its constructor raised (at the start, or on a restart): the trainer names the root cause
                    raise RecoveryError(
                        f"{role} died and cannot be restarted (resource.max_actor_restarts={self.max_restarts} "
                        f"restarts used or 0): {str(err).splitlines()[0][:300]}"
                    ) from err
        return pids

    def restarted(self, roles: list[str] | None = None, cause: str = "") -> list[str]:
        """The roles among `roles` (None: all; none asked for an empty list) whose process Ray
        replaced since the last look, each logged with `cause` (else: its process exited) and counted."""
        now = self._pids(list(self.actors) if roles is None else roles)
        changed = [role for role, pid in now.items() if pid != self.pids[role]]
        for role in changed:
            self.restarts[role] += 1
            print(
                f"recovered: {role} lost its process (pid {self.pids[role]}: {cause or 'it exited'}); Ray restarted it "
                f"as pid {now[role]} (restart {self.restarts[role]} of {self.max_restarts}) and its lost work was re-issued",
                file=sys.stderr,
                flush=True,
            )
        self.pids.update(now)
        return changed

    def total(self) -> int:
        return sum(self.restarts.values())
