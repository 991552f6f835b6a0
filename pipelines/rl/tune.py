"""`raypo tune -c configs/tune_grpo_tiny.yaml`: a Ray Tune sweep over any config keys of a preset.

Optuna's TPE (ray.tune.search.optuna) proposes each trial's values; ASHA stops trials whose
held-out metric, reported every `report_every` steps, falls behind. Each trial is a whole raypo
run (`train()`) reserved as one gang: an empty bundle for the trial's driver, then the run's own
resource plan. Trials run side by side as far as the cluster fits them (computed from the plan).
The sweep's state lives in <storage_path>/<name>, so an interrupted sweep resumes with --resume
(Tune's own restore); at the end a results table is printed and saved, and the best config is
written as a preset that `raypo train -c` takes.
"""

from __future__ import annotations

import csv
import io
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import ray
import yaml
from pydantic import Field, field_validator
from ray import tune
from ray.tune.schedulers import ASHAScheduler
from ray.tune.search.optuna import OptunaSearch
from ray.util.placement_group import get_current_placement_group
from rich.console import Console
from rich.table import Table

from pipelines.cluster import connect_ray
from pipelines.config import ConfigError, RaypoConfig, Strict, config_from_dict, load_config, set_dotted
from pipelines.data import storage
from pipelines.rl.roles import pins_node_types, resource_plan
from pipelines.rl.trainer import TrainingError, root_cause, train

# A search dimension: {uniform: [lo, hi]}, {loguniform: [lo, hi]}, {randint: [lo, hi]} (hi
# excluded), {choice: [a, b, ...]}.
# The key of a trial's last report, after its whole run (Tune's own `done` is set for stopped trials too).
FINISHED = "run_finished"
DISTRIBUTIONS = {"uniform": tune.uniform, "loguniform": tune.loguniform, "randint": tune.randint, "choice": tune.choice}
# The key of a trial's last report, after its whole run (Tune's own `done` is set for stopped trials too).
FINISHED = "run_finished"


class AshaConfig(Strict):
    grace_steps: int = Field(20, ge=1, description="steps every trial runs before ASHA may stop it")
    reduction_factor: float = Field(2, gt=1, description="ASHA keeps the best 1/reduction_factor of trials at each rung")


class SweepConfig(Strict):
    """A sweep file (configs/tune_grpo_tiny.yaml)."""

    name: str = Field("tune", description="sweep name; its state and results go to <storage_path>/<name>")
    base: str = Field(..., description="the preset every trial starts from (relative to the working dir or this file)")
    overrides: dict[str, Any] = Field(default_factory=dict, description="config keys fixed for every trial")
    space: dict[str, dict[str, list]] = Field(..., description="config key -> {uniform|loguniform|randint|choice: [...]}")
    metric: Literal["accuracy", "pass_rate", "reward_mean", "pass_at_k", "sampled_pass_rate"] = Field(
        "accuracy", description="held-out evaluation metric ASHA and the search optimise"
    )
    mode: Literal["max", "min"] = Field("max", description="whether the metric is better higher or lower")
    num_samples: int = Field(12, ge=1, description="trials")
    report_every: int = Field(10, ge=1, description="steps between held-out evaluations reported to Tune")
    asha: AshaConfig = Field(default_factory=AshaConfig, description="ASHA early stopping, in training steps")
    max_concurrent_trials: int | None = Field(None, ge=1, description="most trials at once (default: as many as fit)")
    storage_path: str = Field("runs", description="a directory or URI for the sweep's state, trials and results")
    seed: int = Field(0, description="seed of the TPE sampler")

    @field_validator("space")
    @classmethod
    def _distributions(cls, space: dict[str, dict[str, list]]) -> dict[str, dict[str, list]]:
        for key, spec in space.items():
            if len(spec) != 1 or next(iter(spec)) not in DISTRIBUTIONS:
                raise ValueError(
                    f"space.{key}: give exactly one of {', '.join(DISTRIBUTIONS)}, e.g. {{loguniform: [1e-5, 1e-3]}}"
                )
            kind, args = next(iter(spec.items()))
            if kind != "choice" and (len(args) != 2 or not args[0] < args[1]):
                raise ValueError(f"space.{key}: {kind} takes [low, high] with low < high, got {args}")
            if kind == "choice" and not args:
                raise ValueError(f"space.{key}: choice needs at least one value")
        return space


def load_sweep(path: str | Path, overrides: list[str] = ()) -> tuple[SweepConfig, Path]:
    """The sweep file at `path` with `key=value` overrides, and its base preset's path; every key
    of its space and overrides is checked against the config now, before any trial starts."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"sweep file {str(path)!r} does not exist")
    data = yaml.safe_load(path.read_text()) or {}
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep:
            raise ConfigError(f"override {item!r} is not of the form key=value")
        if key.strip().split(".")[0] in ("space", "overrides") and "." in key:  # space.training.lr: one dimension
            section, _, inner = key.strip().partition(".")
            data.setdefault(section, {})[inner] = yaml.safe_load(raw)
        else:
            set_dotted(data, key.strip(), yaml.safe_load(raw))
    try:
        sweep = SweepConfig.model_validate(data)
    except ValueError as err:
        raise ConfigError(f"invalid sweep file {str(path)!r}:\n{err}") from None
    base = Path(sweep.base)
    if not base.is_file() and (path.parent / base).is_file():
        base = path.parent / base
    base = base.resolve()  # absolute: Tune runs each trial in its own directory
    for params in (_corner(sweep, 0), _corner(sweep, -1)):  # both ends of every dimension
        trial_config(sweep, base, params, name="check", output_dir="runs")
    return sweep, base


def _corner(sweep: SweepConfig, end: int) -> dict:
    return {
        key: next(iter(spec.values()))[end] - (1 if "randint" in spec and end == -1 else 0) for key, spec in sweep.space.items()
    }


def trial_config(sweep: SweepConfig, base: Path, params: dict, name: str, output_dir: str) -> RaypoConfig:
    """The raypo config of one trial: the base preset, the sweep's overrides, the trial's values,
    held-out evaluation every `report_every` steps, outputs under the trial's own directory."""
    data = load_config(base).model_dump(mode="json")
    fixed = {"name": name, "output_dir": output_dir, "eval.every": sweep.report_every, "training.storage_path": None}
    for key, value in {**sweep.overrides, **params, **fixed}.items():
        node = data
        *parents, leaf = key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value.item() if hasattr(value, "item") else value  # numpy scalars from the searcher
    return config_from_dict(data, source=f"sweep trial {params}")


def _probe(cfg: SweepConfig, base: Path, params: dict | None = None) -> RaypoConfig:
    """A trial's config for planning (its name and outputs do not matter)."""
    return trial_config(cfg, base, params or {}, name="probe", output_dir="runs")


def trial_bundles(cfg: RaypoConfig, by_node_type: bool) -> list[dict[str, float]]:
    """What a trial reserves as one gang: an empty bundle for its driver, then the run's plan."""
    return [{}] + [dict(b.resources) for b in resource_plan(cfg, by_node_type)]


def run_trial(params: dict, sweep: SweepConfig, base: str) -> None:
    """One trial (a Tune function trainable): a whole raypo run in the trial's placement group,
    reporting the held-out metric every `report_every` steps and at the end."""
    context = tune.get_context()
    # named by trial: its outputs go to <trial dir>/<id>, its Ray metrics carry run=<id>
    cfg = trial_config(sweep, Path(base), params, name=f"trial_{context.get_trial_id()}", output_dir=context.get_trial_dir())

    def report(metrics: dict) -> None:
        key = f"eval/{sweep.metric}"
        if key in metrics:  # an evaluation of the weights after `eval/step` steps, reported with the next step's metrics
            tune.report({"step": metrics["eval/step"], sweep.metric: metrics[key], "reward_mean": metrics.get("reward_mean")})

    summary = train(cfg, on_metrics=report, trial_group=get_current_placement_group())
    tune.report({"step": summary["steps"], sweep.metric: summary["eval_end"][sweep.metric], FINISHED: True})


@dataclass
class SweepResult:
    sweep: SweepConfig
    rows: list[dict]  # one per trial: its values, status, steps run, last metric
    best: dict | None  # the best finished trial's row
    table_path: str
    preset_path: str | None
    steps_run: int
    steps_without_asha: int


def sweep(sweep_file: str | Path, overrides: list[str] = (), resume: bool = False, address: str | None = None) -> SweepResult:
    """Run (or resume) the sweep of `sweep_file`; returns its table and best preset."""
    cfg, base = load_sweep(sweep_file, overrides)
    root = cfg.storage_path if storage.is_uri(cfg.storage_path) else str(storage.local_path(cfg.storage_path))
    sweep_dir = storage.join(root, cfg.name)
    started_ray = not ray.is_initialized()
    if started_ray:
        connect_ray(address, log_to_driver=True)
    try:
        cluster = ray.cluster_resources()
        by_node_type = pins_node_types(_probe(cfg, base), cluster)
        # every trial plans as the sweep decided here, whatever nodes the cluster has when it starts
        cfg = cfg.model_copy(
            update={"overrides": {**cfg.overrides, "resource.placement": "node_types" if by_node_type else "anywhere"}}
        )
        probe = _probe(cfg, base, _corner(cfg, -1))
        concurrent = concurrent_trials(trial_bundles(probe, by_node_type), cluster, cfg.max_concurrent_trials)
        print(
            f"each trial reserves {_describe(trial_bundles(probe, by_node_type))}; {concurrent} trial(s) at once on this cluster"
        )
        trainable = tune.with_resources(
            tune.with_parameters(run_trial, sweep=cfg, base=str(base)),
            lambda params: tune.PlacementGroupFactory(trial_bundles(_probe(cfg, base, params), by_node_type), strategy="PACK"),
        )
        if resume:
            if not tune.Tuner.can_restore(sweep_dir):
                raise TrainingError(f"--resume: no sweep to resume at {sweep_dir}")
            tuner = tune.Tuner.restore(sweep_dir, trainable, resume_errored=False, restart_errored=False)
        else:
            tuner = tune.Tuner(
                trainable,
                param_space=_space(cfg),
                tune_config=_tune_config(cfg, base, concurrent),
                run_config=_run_config(cfg, root),
            )
        grid = tuner.fit()
        return _summarise(cfg, base, grid, sweep_dir)
    finally:
        if started_ray:
            ray.shutdown()


def concurrent_trials(bundles: list[dict[str, float]], cluster: dict[str, float], cap: int | None) -> int:
    """How many trials with these bundles fit the cluster's CPUs and GPUs at once (at least one
    must fit, else an error names what is short).

    >>> concurrent_trials([{}, {"CPU": 1.0}, {"CPU": 0.5}], {"CPU": 4.0}, None)
    2
    """
    need = {kind: sum(b.get(kind, 0.0) for b in bundles) for kind in ("CPU", "GPU")}
    fits = min(math.floor(cluster.get(kind, 0.0) / n + 1e-9) for kind, n in need.items() if n > 0)
    if fits < 1:
        raise TrainingError(
            f"one trial needs {need['CPU']:g} CPUs and {need['GPU']:g} GPUs but the cluster has "
            f"{cluster.get('CPU', 0.0):g} CPUs and {cluster.get('GPU', 0.0):g} GPUs; lower the preset's resource keys"
        )
    return min(fits, cap) if cap else fits


def _describe(bundles: list[dict[str, float]]) -> str:
    cpus = sum(b.get("CPU", 0.0) for b in bundles)
    gpus = sum(b.get("GPU", 0.0) for b in bundles)
    return f"{len(bundles)} bundles, {cpus:g} CPUs" + (f", {gpus:g} GPUs" if gpus else "")


def _space(cfg: SweepConfig) -> dict:
    return {
        key: DISTRIBUTIONS[kind](*args) if kind != "choice" else tune.choice(args)
        for key, spec in cfg.space.items()
        for kind, args in spec.items()
    }


def _tune_config(cfg: SweepConfig, base: Path, concurrent: int) -> tune.TuneConfig:
    steps = _probe(cfg, base).training.steps
    return tune.TuneConfig(
        metric=cfg.metric,
        mode=cfg.mode,
        search_alg=OptunaSearch(seed=cfg.seed),
        scheduler=ASHAScheduler(
            time_attr="step",
            max_t=steps,
            grace_period=min(cfg.asha.grace_steps, steps),
            reduction_factor=cfg.asha.reduction_factor,
        ),
        num_samples=cfg.num_samples,
        max_concurrent_trials=concurrent,
    )


def _run_config(cfg: SweepConfig, root: str) -> tune.RunConfig:
    return tune.RunConfig(name=cfg.name, storage_path=root, failure_config=tune.FailureConfig(max_failures=0), verbose=1)


def _summarise(cfg: SweepConfig, base: Path, grid: tune.ResultGrid, sweep_dir: str) -> SweepResult:
    """The results table (printed, and saved as results.csv and results.json in the sweep's
    directory), the compute ASHA saved, and the best finished trial written as a preset."""
    steps = _probe(cfg, base).training.steps
    rows = []
    for result in grid:
        metrics = result.metrics or {}
        done = metrics.get(FINISHED) is True
        status = "error" if result.error else ("done" if done else "stopped early" if metrics else "not started")
        row = {
            "trial": metrics.get("trial_id") or _trial_id(result.path),
            **{key: result.config.get(key) for key in cfg.space},
            "status": status,
            "steps": int(metrics.get("step", 0)),
            cfg.metric: metrics.get(cfg.metric),
            "error": _first_line(result.error) if result.error else "",
        }
        rows.append(row)
    finished = [r for r in rows if r["status"] == "done" and r[cfg.metric] is not None]
    best = (max if cfg.mode == "max" else min)(finished, key=lambda r: r[cfg.metric]) if finished else None
    table_path = storage.join(sweep_dir, "results.csv")
    storage.write_text(table_path, _csv(rows))
    storage.write_text(storage.join(sweep_dir, "results.json"), json.dumps(rows, indent=2, default=str))
    preset_path = None
    if best is not None:
        preset_path = storage.join(sweep_dir, "best.yaml")
        storage.write_text(preset_path, best_preset(cfg, base, best))
    return SweepResult(cfg, rows, best, table_path, preset_path, sum(r["steps"] for r in rows), steps * len(rows))


def best_preset(cfg: SweepConfig, base: Path, best: dict) -> str:
    """The best trial's whole config as a preset for `raypo train -c` (evaluation and outputs as
    the base preset's: the sweep's evaluation settings serve ASHA, not the run)."""
    params = {key: best[key] for key in cfg.space}
    base_cfg = load_config(base)
    trial = trial_config(cfg, base, params, name=f"{cfg.name}_best", output_dir=base_cfg.output_dir)
    data = trial.model_dump(mode="json")
    data["eval"] = base_cfg.eval.model_dump(mode="json")
    header = (
        f"# Best trial {best['trial']} of sweep {cfg.name} ({cfg.num_samples} trials): held-out {cfg.metric} "
        f"{best[cfg.metric]:.4g} after {best['steps']} steps.\n# Base preset {base}; swept: "
        + ", ".join(f"{k}={v}" for k, v in params.items())
        + "\n"
    )
    return header + yaml.safe_dump(data, sort_keys=False)


def format_table(result: SweepResult, cfg: SweepConfig) -> Table:
    table = Table(title=f"sweep {cfg.name}: {len(result.rows)} trials")
    columns = list(result.rows[0]) if result.rows else []
    for column in columns:
        table.add_column(column)
    for row in sorted(
        result.rows, key=lambda r: (r[cfg.metric] is None, -(r[cfg.metric] or 0) if cfg.mode == "max" else r[cfg.metric] or 0)
    ):
        table.add_row(*(f"{v:.3g}" if isinstance(v, float) else str(v) for v in row.values()))
    return table


def print_summary(result: SweepResult) -> None:
    cfg = result.sweep
    console = Console()
    console.width = max(console.width, 160)  # a log file or pipe gets 80 columns, too narrow for the swept keys
    console.print(format_table(result, cfg))
    saved = 1 - result.steps_run / max(result.steps_without_asha, 1)
    print(f"steps run: {result.steps_run} of {result.steps_without_asha} without early stopping (ASHA saved {saved:.0%})")
    print(f"results: {result.table_path}")
    if result.best is not None:
        print(f"best: trial {result.best['trial']}, {cfg.metric} {result.best[cfg.metric]:.4g}; preset: {result.preset_path}")
        print(f"  raypo train -c {result.preset_path}")
    else:
        print("no trial finished: no best preset written")


def _csv(rows: list[dict]) -> str:
    out = io.StringIO()
    if rows:
        writer = csv.DictWriter(out, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    return out.getvalue()


def _first_line(error: BaseException) -> str:
    """The root cause of a trial's error (the trial's own exception, not Tune's wrapper)."""
    text = str(error).strip()
    return root_cause(text) if "\n" in text else text[:300] or type(error).__name__


def _trial_id(path: str) -> str:
    """`7288bf38` from a trial directory named `run_trial_7288bf38_2_training_lr=0.05_...`."""
    match = re.search(r"run_trial_([0-9a-f]+)", Path(path).name)
    return match.group(1) if match else Path(path).name
