"""Per-step monitoring: the seeds' alerts and the metric sinks (JSONL, TensorBoard, Ray metrics,
a reward-curve PNG). The console progress bar lives in the trainer."""

from __future__ import annotations

import json
import math
import re
from collections import deque
from collections.abc import Callable
from pathlib import Path

from ray.util.metrics import Gauge
from tensorboard.compat.proto.summary_pb2 import Summary
from torch.utils.tensorboard import SummaryWriter

from pipelines.config import MonitorConfig


class Alerts:
    """The seeds' alerts, evaluated on each step's metrics.

    - grad norm above `grad_norm_alert` (1.5) and KL to the reference above `kl_alert` (0.02);
    - reward falling: the step's reward is below the mean of the previous `reward_window` steps by
      more than `reward_drop` (10%) of the reward's range, on `reward_drop_steps` (5) steps in a row;
    - all rewards at the bottom of the range (the reward model may be broken: check its health);
    - a non-finite loss or gradient (the learner skipped that update), and the run's share of
      updates that succeeded below `update_success_alert` (the seeds' 99.9%);
    - a step whose every sample no reward scored (skipped: nothing to learn from).
    """

    def __init__(self, cfg: MonitorConfig, reward_span: float = 2.0):
        self.cfg = cfg
        self.reward_span = reward_span
        self.window: deque[float] = deque(maxlen=cfg.reward_window)
        self.falling_streak = 0
        self.last_printed: dict[str, int] = {}

    def check(self, m: dict) -> list[str]:
        cfg, alerts = self.cfg, []
        if m.get("grad_norm", 0.0) > cfg.grad_norm_alert:
            alerts.append(f"grad norm {m['grad_norm']:.3f} > {cfg.grad_norm_alert}")
        if m.get("kl", 0.0) > cfg.kl_alert:
            alerts.append(f"KL to reference {m['kl']:.4f} > {cfg.kl_alert}")
        if m.get("update_skipped"):
            alerts.append("unscored step: no reward scored any sample (every term returned None); the update was skipped")
        elif "reward_mean" in m:  # RL's reward (DPO, which samples nothing, has none)
            alerts += self._reward_trend(m["reward_mean"])
        if m.get("reward_all_zero"):
            alerts.append("every reward of the step is at the bottom of its range: check the reward model's health")
        if m.get("update_success", 1.0) < 1.0:
            alerts.append("non-finite loss or gradient: the update was skipped")
        if m.get("update_success_rate", 1.0) < cfg.update_success_alert:
            alerts.append(f"update success rate {m['update_success_rate']:.4f} < {cfg.update_success_alert}")
        return alerts

    def _reward_trend(self, reward: float) -> list[str]:
        cfg, alerts = self.cfg, []
        if self.window:
            mean = sum(self.window) / len(self.window)
            self.falling_streak = self.falling_streak + 1 if mean - reward > cfg.reward_drop * self.reward_span else 0
            if self.falling_streak >= cfg.reward_drop_steps:
                alerts.append(
                    f"reward fell more than {cfg.reward_drop:.0%} below its {len(self.window)}-step mean "
                    f"on {self.falling_streak} consecutive steps"
                )
        self.window.append(reward)
        return alerts

    def to_print(self, step: int, alerts: list[str]) -> list[str]:
        """The alerts worth a console line now: each kind at most once per `print_every` steps
        (every alert still lands in the metrics)."""
        out = []
        for alert in alerts:
            kind = " ".join(alert.split(" ", 2)[:2])  # "grad norm", "KL to", "reward fell", ...
            if step - self.last_printed.get(kind, -(10**9)) >= self.cfg.print_every:
                self.last_printed[kind] = step
                out.append(alert)
        return out


def gauge_name(key: str) -> str:
    """The Ray metric (Prometheus) name of the metric `key`: `raypo_` and the key, each character
    Prometheus does not take in a name as `_` (Ray discards a metric whose name has one, such as
    the `/` of `eval/accuracy`).

    >>> gauge_name("eval/reward_mean/exact_match"), gauge_name("step_time")
    ('raypo_eval_reward_mean_exact_match', 'raypo_step_time')
    """
    return "raypo_" + re.sub(r"[^a-zA-Z0-9_:]", "_", key)


class Sinks:
    """Writes each step's metrics to metrics.jsonl, TensorBoard and Ray metrics (Prometheus).
    Ray's gauges carry the tag `run` (the run's name), so runs sharing a cluster, such as the
    trials of a sweep, report separate series."""

    def __init__(self, out_dir: Path, resume_step: int = 0, run: str = ""):
        self.out_dir, self.run = out_dir, run or out_dir.name
        self.gauges: dict[str, Callable] = {}
        self._open(resume_step)

    def _open(self, from_step: int) -> None:
        # On resume, drop the lines of steps from the checkpoint's on: they will be run again.
        path = self.out_dir / "metrics.jsonl"
        kept = [ln for ln in path.read_text().splitlines() if json.loads(ln)["step"] < from_step] if path.exists() else []
        path.write_text("".join(ln + "\n" for ln in kept))
        self.history = [json.loads(ln) for ln in kept]
        self.jsonl = open(path, "a")
        self.tb = SummaryWriter(str(self.out_dir / "tensorboard"), purge_step=from_step)

    def rewind(self, step: int) -> None:
        """Drop the metrics of step `step` and after (the run trains them again, from a checkpoint)."""
        self.close()
        self._open(step)

    def write(self, metrics: dict) -> None:
        self.history.append(metrics)
        self.jsonl.write(json.dumps(metrics) + "\n")
        self.jsonl.flush()
        scalars = {
            key: float(value)
            for key, value in metrics.items()
            if isinstance(value, (int, float)) and not isinstance(value, bool) and key != "step" and math.isfinite(value)
        }
        # One TensorBoard event holds the step's every scalar: an event each (`add_scalar`) took
        # ~1.4 ms of the driver's CPU a step for ~46 metrics, on a tiny step of ~60 ms.
        summary = Summary(value=[Summary.Value(tag=key, simple_value=value) for key, value in scalars.items()])
        self.tb.file_writer.add_summary(summary, metrics["step"])
        for key, value in scalars.items():
            self._gauge(key, value)

    def _gauge(self, key: str, value: float) -> None:
        if key not in self.gauges:
            self.gauges[key] = Gauge(gauge_name(key), description=f"raypo training metric {key}", tag_keys=("run",))
        try:
            self.gauges[key].set(value, tags={"run": self.run})
        except Exception:  # Ray metrics need a connected worker; never let them break training
            pass

    def plot_rewards(self) -> Path:
        import matplotlib  # here: the backend must be chosen before pyplot loads, and only a run's end draws

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        # RL's mean reward; DPO's mean implicit reward margin (chosen minus rejected)
        key = "reward_mean" if "reward_mean" in self.history[0] else "reward_margin"
        scored = [m for m in self.history if m.get(key) is not None]  # a step no reward scored has none
        steps = [m["step"] for m in scored]
        rewards = [m[key] for m in scored]
        fig, ax = plt.subplots(figsize=(7, 4))
        ax.plot(steps, rewards, label=key.replace("_", " "), alpha=0.5)
        if len(rewards) >= 5:
            k = max(5, len(rewards) // 20)
            smooth = [
                sum(rewards[max(0, i - k + 1) : i + 1]) / len(rewards[max(0, i - k + 1) : i + 1]) for i in range(len(rewards))
            ]
            ax.plot(steps, smooth, label=f"{k}-step mean")
        ax.set_xlabel("step")
        ax.set_ylabel("reward")
        ax.legend()
        ax.grid(alpha=0.3)
        path = self.out_dir / "reward_curve.png"
        fig.savefig(path, dpi=100, bbox_inches="tight")
        plt.close(fig)
        return path

    def close(self) -> None:
        self.jsonl.close()
        self.tb.close()
