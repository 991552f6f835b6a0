"""Recovery inside a run from updates that fail: the seeds' rule, a rollback to the last good
checkpoint with a lower learning rate after `training.rollback_after` (5) failed steps in a row,
and the run's update success rate (the seeds' target: above 99.9%)."""

from __future__ import annotations

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
        self.failed_in_a_row = 0 if ok else self.failed_in_a_row + 1

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
